"""LoRAManager: the engine's adapters, by name; their weights in host memory (least recently used out beyond
--max-cpu-loras) and in --max-loras device slots.

A waiting sequence with an adapter is admitted only once its adapter has a slot (`acquire`): one already there, a
free one (written from the host copy, or after its files are read again on a background thread), or none yet, and
then it waits while the scheduler admits the sequences behind it. A slot is held while any sequence of its adapter
runs, so a step's rows never see their adapter replaced; when the last one ends the slot stays written, first in line
to be reused by whichever adapter needs one next (least recently used first). Everything here runs on the engine's
thread except the file reads."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..models.config import ModelConfig
from ..models.lora import slot_weights
from .peft import read_adapter, resolve_adapter
from .request import Adapter, LoRAError, LoRARequest, check_name

log = logging.getLogger("capstan.lora")
SlotWeights = tuple[dict[str, np.ndarray], ...]


class LoRAManager:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        layout: ModelConfig | None = None,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype,
        write_slot: Callable[[int, SlotWeights], None],
    ):
        """cfg: the checkpoint's, which adapters are checked against; layout: the served model's, whose KV heads
        tensor parallelism may have replicated (default cfg); write_slot(slot, weights) puts one adapter's weights
        into a device slot."""
        self.cfg, self.layout, self.dtype = cfg, layout or cfg, dtype
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self._write_slot = write_slot
        self.adapters: dict[str, Adapter] = {}  # the registry: what requests may name
        self._host: collections.OrderedDict[int, SlotWeights] = collections.OrderedDict()  # by serial, LRU first
        self._slots: list[Adapter | None] = [None] * max_loras
        self._refs = [0] * max_loras  # sequences holding each slot
        self._slot_of: dict[int, int] = {}  # serial -> slot
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict((s, None) for s in range(max_loras))
        self._reads: dict[int, Future] = {}  # serial -> its files being read again (evicted from host memory)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="capstan-lora-read")
        self._serials = itertools.count(1)
        self.slot_loads = 0  # adapters written into a slot (a metric of swapping)

    # ---- the registry -------------------------------------------------------------------------------------------
    def read(self, request: LoRARequest) -> SlotWeights:
        """An adapter's files read, checked and laid out as one slot (LoRAError naming the field); thread-safe."""
        modules = read_adapter(resolve_adapter(request.lora_path), self.cfg, self.max_lora_rank)
        weights = slot_weights(self.layout, self.max_lora_rank, modules, self.dtype)
        for layer, arrays in enumerate(weights):  # finite in float32 (read_adapter checked), maybe not in the model's
            for name, w in arrays.items():
                if not np.isfinite(w.astype(np.float32)).all():
                    raise LoRAError(
                        f"{request.lora_path}: layer {layer}'s {name} weights overflow the model's dtype "
                        f"({np.dtype(self.dtype).name}); an adapter's scaled weights must fit it",
                        "lora_path",
                    )
        return weights

    def add(self, request: LoRARequest, weights: SlotWeights | None = None) -> Adapter:
        """Registers the adapter under its name (reading it unless weights are given); an adapter of that name is
        replaced: its running sequences finish with it, new requests get this one."""
        check_name(request.lora_name)
        if weights is None:
            weights = self.read(request)
        old = self.adapters.get(request.lora_name)
        adapter = Adapter(request, next(self._serials))
        self.adapters[request.lora_name] = adapter
        self._keep(adapter.serial, weights)
        if old is not None:
            self._forget(old)
        log.info("LoRA adapter %s (id %d) loaded from %s", request.lora_name, request.lora_int_id, request.lora_path)
        return adapter

    def remove(self, name: str) -> bool:
        """Unregisters it: new requests may no longer name it; sequences already admitted finish with it."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            return False
        self._forget(adapter)
        log.info("LoRA adapter %s unloaded", name)
        return True

    def get(self, name: str) -> Adapter | None:
        return self.adapters.get(name)

    def find(self, request: LoRARequest) -> Adapter:
        """The registration for an offline request: the one of its name when id and path agree, else a new one."""
        adapter = self.adapters.get(request.lora_name)
        if adapter is not None and adapter.request == request:
            return adapter
        return self.add(request)

    def list(self) -> list[LoRARequest]:
        return [a.request for a in self.adapters.values()]

    # ---- device slots -------------------------------------------------------------------------------------------
    def acquire(self, adapter: Adapter) -> int | None:
        """A slot holding the adapter, referenced for one sequence; None while there is none to give (every slot is
        held by running sequences, or its files are being read again). Raises when its files cannot be read."""
        slot = self._slot_of.get(adapter.serial)
        if slot is None:
            weights = self._host_copy(adapter)
            if weights is None or not self._idle:
                return None
            slot = next(iter(self._idle))  # least recently used: an empty one, or one whose adapter idles longest
            gone = self._slots[slot]
            if gone is not None:
                del self._slot_of[gone.serial]
            self._write_slot(slot, weights)
            self.slot_loads += 1
            self._slots[slot], self._slot_of[adapter.serial] = adapter, slot
        self._refs[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        self._refs[slot] -= 1
        assert self._refs[slot] >= 0, f"LoRA slot {slot} released twice"
        if self._refs[slot] == 0:
            adapter = self._slots[slot]
            if adapter is not None and self.adapters.get(adapter.name) is not adapter:  # unloaded or replaced
                self._slots[slot] = None
                del self._slot_of[adapter.serial]
                self._idle[slot] = None
                self._idle.move_to_end(slot, last=False)  # empty: reused first
            else:
                self._idle[slot] = None  # most recently used: reused last

    @property
    def slots_used(self) -> int:
        """Slots some sequence holds."""
        return sum(1 for refs in self._refs if refs)

    @property
    def reading(self) -> bool:
        return bool(self._reads)

    def wait_read(self, timeout: float) -> None:
        """An idle engine's wait for a read to finish, instead of spinning."""
        for future in list(self._reads.values())[:1]:
            with contextlib.suppress(TimeoutError):
                future.exception(timeout)

    def _host_copy(self, adapter: Adapter) -> SlotWeights | None:
        """Its weights from host memory, or None while its files are read again (they left host memory)."""
        weights = self._host.get(adapter.serial)
        if weights is not None:
            self._host.move_to_end(adapter.serial)
            return weights
        future = self._reads.get(adapter.serial)
        if future is None:
            log.info("LoRA adapter %s is read again from %s", adapter.name, adapter.request.lora_path)
            self._reads[adapter.serial] = self._reader.submit(self.read, adapter.request)
            return None
        if not future.done():
            return None
        del self._reads[adapter.serial]
        weights = future.result()  # raises when it cannot be read any more: its sequence fails alone
        self._keep(adapter.serial, weights)
        return weights

    def _keep(self, serial: int, weights: SlotWeights) -> None:
        self._host[serial] = weights
        self._host.move_to_end(serial)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _forget(self, adapter: Adapter) -> None:
        """Drops a registration's host copy, and its slot when no sequence holds it."""
        self._host.pop(adapter.serial, None)
        slot = self._slot_of.get(adapter.serial)
        if slot is not None and self._refs[slot] == 0:
            self._refs[slot] += 1  # release() clears a slot whose adapter is no longer registered
            self.release(slot)
