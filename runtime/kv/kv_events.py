"""KV events: what the prefix cache tells the outside about its pages, in vLLM's wire shape (vllm/distributed/
kv_events.py), so a consumer built for vLLM (llm-d's KV-cache indexer, `capstan gateway --routing kv-events`) reads
ours unchanged.

A batch goes out as one ZeroMQ message of three frames: the topic, an 8-byte big-endian sequence number, and the
msgpack (msgspec) payload of a KVEventBatch: `[ts, [event, ...], data_parallel_rank]`, each event an array whose
first item is its tag (`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`,
`["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`). Block hashes are page_pool's 16-byte chained
hashes (consumers read bytes or ints). KVEventLog records them as the PagePool names and evicts pages; the engine
core publishes the log after each step (kv_event_publisher.py)."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import msgspec

MEDIUM_DEVICE = "GPU"  # vLLM's name for the device tier (on any backend: the pages the step reads)
PUBLISHERS = ("null", "zmq")


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_DEVICE


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[bytes]
    medium: str | None = MEDIUM_DEVICE


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


encode_batch = msgspec.msgpack.Encoder().encode
decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """--kv-events-config, vLLM's JSON flag and fields. A `tcp://*:PORT` (or `::`, ipc://) endpoint is bound and
    subscribers connect; any other is connected to (a consumer that binds, as llm-d's indexer does). With several
    engine cores (--data-parallel-size) core k uses PORT + k, as vLLM's ranks do."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "null": none published
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER: send it a start sequence number, get the batches kept since
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ's send high-water mark: batches queued per subscriber before they are dropped
    max_queue_size: int = 100_000  # events one step may record; beyond, the step's batch is dropped and counted
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        try:
            fields: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config: not JSON ({e})") from None
        if not isinstance(fields, dict):
            raise ValueError("--kv-events-config: must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(fields) - known):
            raise ValueError(
                f"--kv-events-config: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        config = cls(**fields)
        config.validate()
        return config

    def validate(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"--kv-events-config: publisher must be one of {', '.join(PUBLISHERS)}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("--kv-events-config: replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 10_000_000:
                raise ValueError(f"--kv-events-config: {name} must be an integer from 1 to 10000000, got {value!r}")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def endpoint_of_core(endpoint: str | None, core: int) -> str | None:
    """Engine core k's endpoint: a tcp port moved up by k (vLLM's data-parallel ranks), an ipc path suffixed."""
    if endpoint is None or core == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + core}"
    return f"{endpoint}_dp{core}"


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or a local transport is bound; a named host is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventLog:
    """The events of one step, in order, as the PagePool records them; consecutive pages stored one after another
    (a prompt's run) share one BlockStored, as vLLM sends them. Bounded: past max_events the step's batch is lost
    (counted, and its sequence number skipped so subscribers see the gap)."""

    def __init__(self, page_size: int, max_events: int = KVEventsConfig.max_queue_size):
        self.page_size = page_size
        self.max_events = max_events
        self.events: list[KVEvent] = []
        self.overflowed = False

    def _add(self, event: KVEvent) -> None:
        if len(self.events) >= self.max_events:
            self.overflowed = True
            return
        self.events.append(event)

    def stored(self, h: bytes, parent: bytes | None, tokens: Sequence[int], lora_id: int | None = None) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent and last.lora_id == lora_id:
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
            return
        self._add(BlockStored([h], parent, list(tokens), self.page_size, lora_id))

    def removed(self, h: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(h)
            return
        self._add(BlockRemoved([h]))

    def cleared(self) -> None:
        self.events.clear()
        self.overflowed = False
        self._add(AllBlocksCleared())

    def take(self, rank: int | None = None) -> KVEventBatch | None:
        """The step's batch (None: nothing happened); ask take_overflow first."""
        if not self.events:
            return None
        batch = KVEventBatch(time.time(), self.events, rank)
        self.events = []
        return batch

    def take_overflow(self) -> bool:
        """Whether the step's batch was lost to the bound (and forget it)."""
        lost, self.overflowed = self.overflowed, False
        if lost:
            self.events = []
        return lost
