"""LLMEngine: requests in, one step at a time: schedule (host), run the jitted step (device), apply results."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..attention.kv_quantization import cache_dtype
from ..config import DEFAULT_MODEL, EngineConfig, installed_smollm2, served_model_name, warn_random_default
from ..kv.cache import KVCache
from ..kv.host_offload import GIB, HostOffload
from ..kv.page_pool import PagePool
from ..lora.manager import LoRAManager, SlotWeights
from ..lora.request import LoRARequest
from ..models.checkpoint_path import resolve_checkpoint
from ..models.cpu_layout import cpu_int8_layout
from ..models.decoder import DecoderModel
from ..models.loader import load_model, parse_dtype
from ..models.lora import LoRAStack, fold_weights, folds_stored, is_folded, write_folded_slot, write_slot_fn
from ..parallel.tensor_parallel import TensorParallel
from ..sampling.dry import BreakerMasks
from ..sampling.grammar import GrammarTokenizer
from ..sampling.logprobs import position_logprobs, prompt_logprobs
from ..sampling.programs import ASYNC_BRANCHES, ASYNC_GREEDY, ASYNC_PENALIZED, ASYNC_SAMPLED
from ..sampling.sampler import Branches, SampleResult, StepOutputs
from ..sampling.sampling_params import InvalidRequestError, SamplingParams
from ..scheduling.batch import PENDING, BatchBuilder, BatchSizes
from ..scheduling.scheduler import ScheduledChunk, Scheduler
from ..scheduling.sequence import Sequence
from ..speculative.draft_model import load_draft
from ..speculative.speculator import Speculator
from ..tokenizer import Tokenizer
from . import layered_step, program_store
from .choice_text import ChoiceText
from .compile_counts import describe
from .embedder import Embedder
from .engine_stats import EngineStats
from .errors import ModelNotFoundError
from .input_processor import EngineRequest, InputProcessor, ModelLimits
from .multi_step import MultiStepDecoder
from .outputs import CompletionOutput, RequestOutput
from .program_store import ProgramStore
from .step import step_fn
from .warmup import BackgroundWarmup, Program

log = logging.getLogger("capstan.engine")
CPU_KV_BYTES = 512 << 20  # KV pool on CPU when num_pages is not given
LOAD_WAIT_S = 0.002  # an idle step's wait for a copy back from the host tier (the caller's loop goes on after it)


def _free_device_bytes() -> int | None:
    """The first local device's free memory, or None where JAX does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}  # (devices()[0] may be another host's)
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0) if "bytes_limit" in stats else None


@dataclasses.dataclass
class PendingStep:
    """A single step queued while the host applied the one before (asynchronous scheduling)."""

    chunks: list[ScheduledChunk]
    out: StepOutputs  # on the device
    ends: list[bool]  # whether each chunk reached its sequence's end (sampled its next token)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        model=None,
        tokenizer: Tokenizer | None = None,
        draft_model: DecoderModel | None = None,
    ):
        """model, draft_model: built already (benchmarks' random weights) instead of loaded from the config's paths."""
        config.validate()
        self.config = config
        path = resolve_checkpoint(config.checkpoint)
        dtype = (
            config.dtype if config.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
        )
        self.dtype = parse_dtype(dtype)
        self.kv_dtype = cache_dtype(config.kv_cache_dtype, self.dtype)  # what K/V pages store (FP8: half of bf16)
        if model is None and path.resolve() == DEFAULT_MODEL.resolve() and installed_smollm2() is None:
            warn_random_default()  # (a model given as an object is not the default, whatever config.model says)
        self.model = model if model is not None else load_model(path, dtype, config.quantization)
        checkpoint_cfg = self.model.cfg  # what LoRA adapters' shapes are checked against
        self.parallel = TensorParallel.create(config.tensor_parallel_size, self.model.cfg)
        self.model = self.parallel.place_model(self.model)  # may replicate KV heads: read cfg after
        if jax.default_backend() == "cpu" and self.parallel.size == 1:  # INT8 weights as CPU loops read them fastest
            self.model = cpu_int8_layout(self.model)
        cfg = self.model.cfg
        if config.enable_lora:  # the adapters' slots before the KV pool takes its share of the free memory
            if jax.process_count() > 1:
                raise ValueError("enable_lora is not supported across several hosts yet")
            stack = LoRAStack.allocate(cfg, config.max_loras, config.max_lora_rank, self.dtype)
            self.model = dataclasses.replace(self.model, lora=self.parallel.replicated(stack))
            if folds_stored(self.model, self.parallel.size):  # the shrinks ride in the projections' own matmuls
                self.model = fold_weights(self.model)
        spec, draft = config.speculative_config, None
        if spec is not None and spec.method == "draft_model":  # loaded first: the KV budget counts its pages
            assert spec.model is not None, "SpeculativeConfig.validate: draft_model names its model"
            draft = load_draft(spec.model, self.model, dtype, self.parallel, given=draft_model)
        self.tokenizer = tokenizer or Tokenizer.from_pretrained(
            resolve_checkpoint(config.tokenizer) if config.tokenizer else path
        )
        self.model_name = served_model_name(path)
        if config.max_model_len is None:
            config.max_model_len = min(cfg.max_position_embeddings, 8192)
        elif config.max_model_len > cfg.max_position_embeddings:  # (vLLM refuses it too)
            raise ValueError(
                f"max_model_len ({config.max_model_len}) is more than the model's context, max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids | set(cfg.eos_token_ids))
        self.grammar = GrammarTokenizer(
            self.tokenizer, set(self.tokenizer.end_of_turn_ids()) | self.eos_token_ids, cfg.vocab_size
        )
        if config.num_pages is not None:
            self._check_pages_fit(config.num_pages, draft)
        num_pages = config.num_pages or self._pages_that_fit(draft)
        config.num_pages = num_pages
        self.kv = KVCache.allocate(
            cfg.num_layers,
            num_pages,
            config.page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.kv_dtype,
            sharding=self.parallel.kv_sharding(),
        )
        log.info(
            "KV cache: %d pages of %d tokens, %s (%.1f MiB)",
            num_pages,
            config.page_size,
            jnp.dtype(self.kv_dtype).name,
            sum(a.nbytes for a in (*self.kv.k, *self.kv.v)) / (1 << 20),
        )
        self.pool = PagePool(num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens)
        if config.kv_offloading_size:  # evicted prefix pages go to host memory, and come back on a hit
            if self.parallel.kv_sharding() is None:
                # pages loaded from host memory arrive committed to the device, and so is every cache their scatter
                # writes: the cache starts committed, so the steps compile once, at warm-up
                device = next(iter(self.kv.k[0].devices()))
                self.kv = jax.device_put(self.kv, jax.sharding.SingleDeviceSharding(device))
            self.scheduler.attach_host_tier(HostOffload(self.kv, config.kv_offloading_size, context=self._precision))
        rows = BatchSizes(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            page_size=config.page_size,
            max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size,
            eos_token_ids=self.eos_token_ids,
            smallest_bucket=config.smallest_token_bucket,
        )
        self.inputs = InputProcessor(self.tokenizer, self.limits(), self.grammar)  # admission: no engine state
        self.builder = BatchBuilder(
            **rows,
            queries_per_kv=cfg.queries_per_kv,
            decode_row_buckets=config.uses_decode_row_buckets(),
            placement=self.parallel.inputs_sharding(),
        )
        self.builder.breaker_masks = BreakerMasks(self.tokenizer, cfg.vocab_size)
        self.speculator: Speculator | None = None  # None: every step decodes plainly
        if spec is not None:
            self.speculator = Speculator(self, spec, draft, rows)
        self.embedder = Embedder(self, config.embedding_pooling)  # /v1/embeddings: borrows pages from this pool
        self.multi_step = MultiStepDecoder(self)  # several decode steps a dispatch (config.decode_steps)
        self.loras: LoRAManager | None = None  # --enable-lora: the adapters, their host copies and device slots
        self._lora_ids = itertools.count(1)  # ids for adapters named by the configuration (lora_modules)
        if config.enable_lora:
            self._enable_lora(checkpoint_cfg)
        self.requests: dict[str, list[Sequence]] = {}
        self.failed: list[tuple[str, BaseException]] = []  # requests failed alone since the owner last took them
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.compile_seconds = 0.0
        self.warming: BackgroundWarmup | None = None  # serve's warm-up while it still compiles: run compiled programs
        self.program_store: ProgramStore | None = None  # serve's first programs kept whole (program_store.py)
        self.stored_steps: dict[tuple, jax.stages.Compiled] = {}  # (variant, inputs' layout) -> a program it loaded
        self.layered: dict[tuple, layered_step.LayeredStep] = {}  # likewise -> a stand-in while serve compiles it
        # asynchronous scheduling: the next single step is scheduled, built and queued while this one runs
        self.async_steps = (
            config.uses_async_scheduling()
            and jax.process_count() == 1
            and self.speculator is None
            and self.scheduler.offload is None
        )
        self.pending: PendingStep | None = None  # the step queued last, whose tokens the host has not read yet

    def _enable_lora(self, checkpoint_cfg) -> None:
        """The manager of the model's adapter slots (whole on every device under tensor parallelism), and the
        adapters of lora_modules loaded."""
        c, cfg = self.config, self.model.cfg
        self.loras = LoRAManager(
            checkpoint_cfg,
            layout=cfg,
            max_loras=c.max_loras,
            max_lora_rank=c.max_lora_rank,
            max_cpu_loras=c.max_cpu_loras or c.max_loras,
            dtype=self.dtype,
            write_slot=self._write_lora_slot,
        )
        self.scheduler.lora = self.loras
        for name, path in (c.lora_modules or {}).items():
            self.add_lora(LoRARequest(name, next(self._lora_ids), path))

    def _write_lora_slot(self, slot: int, weights: SlotWeights) -> None:
        with self._precision():
            stack = write_slot_fn(self.model.lora, np.int32(slot), weights)
            model = dataclasses.replace(self.model, lora=self.parallel.replicated(stack))
            if is_folded(model):
                self.kv  # noqa: B018 - a dispatch queued ahead takes the folded arrays before they are donated
                model = write_folded_slot(model, slot, weights)
        self.model = model

    # ---- LoRA adapters ------------------------------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest, weights: SlotWeights | None = None) -> None:
        """Registers an adapter by its name (read now unless weights, from LoRAManager.read, are given); LoRAError
        names what is wrong with it."""
        self.lora_manager().add(lora, weights)

    def remove_lora(self, name: str) -> bool:
        """New requests can no longer name it; those admitted already finish with it."""
        return self.lora_manager().remove(name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.loras is None else self.loras.list()

    def lora_manager(self) -> LoRAManager:
        if self.loras is None:
            raise InvalidRequestError("LoRA adapters need enable_lora (--enable-lora)", "lora_request")
        return self.loras

    def _bytes_per_page(self, draft_model: DecoderModel | None) -> int:
        """One page's K/V bytes on each device (the draft's too)."""
        cfg, c = self.model.cfg, self.config
        per_page = KVCache.bytes_per_page(cfg.num_layers, c.page_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)
        if draft_model is not None:  # a page holds the draft's K/V of its tokens too
            d = draft_model.cfg
            per_page += KVCache.bytes_per_page(d.num_layers, c.page_size, d.num_kv_heads, d.head_dim, self.kv_dtype)
        return per_page // self.parallel.size  # each device holds its KV heads' share of every page

    def _pages_that_fit(self, draft_model: DecoderModel | None) -> int:
        c = self.config
        useful = c.max_num_seqs * -(-self.max_model_len // c.page_size) + 1  # more than this is never used
        free = _free_device_bytes()
        budget = CPU_KV_BYTES if free is None else free * c.kv_memory_fraction
        return int(max(2, min(useful, budget // self._bytes_per_page(draft_model))))

    def _check_pages_fit(self, num_pages: int, draft_model: DecoderModel | None) -> None:
        """A given num_pages must fit the device's free memory (the host's, on CPU): else a message naming it, not
        an allocation failure."""
        free, where = _free_device_bytes(), "the device has"
        if free is None:
            free, where = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this host has"
        need = num_pages * self._bytes_per_page(draft_model)
        if need > free:
            raise ValueError(
                f"num_pages ({num_pages}) needs {need / GIB:.1f} GiB of KV cache; {where} {free / GIB:.1f} GiB free"
            )

    # ---- requests -------------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """lora_request: the adapter to run with (vLLM's), registered on first sight."""
        lora_name = None
        if lora_request is not None:
            self.lora_manager().find(lora_request)
            lora_name = lora_request.lora_name
        self.enqueue(self.prepare(request_id, prompt, params, lora_name))

    def limits(self) -> ModelLimits:
        c, cfg = self.config, self.model.cfg
        return ModelLimits(
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            page_size=c.page_size,
            num_pages=self.pool.num_pages,
            max_num_seqs=c.max_num_seqs,
            max_logprobs=c.max_logprobs,
            eos_token_ids=sorted(self.eos_token_ids),
            hidden_size=cfg.hidden_size,
        )

    def validate(self, params: SamplingParams) -> None:
        """Every sampling field within its limit for this model and configuration (InvalidRequestError)."""
        self.inputs.validate(params)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        self.inputs.check_prompt_chars(chars, param)

    def prepare(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, lora_name: str | None = None
    ) -> list[Sequence]:
        """Validates and tokenizes a request without touching engine state (safe from any thread)."""
        request = self.inputs.process(request_id, prompt, params)
        request.lora_name = lora_name
        return self.make_sequences(request)

    def make_sequences(self, request: EngineRequest) -> list[Sequence]:
        """The request's n choices, ready to enqueue (the engine core's half of admission)."""
        ids, params, now = request.prompt_ids, request.params, time.monotonic()
        adapter = None
        if request.lora_name is not None:
            adapter = self.loras.get(request.lora_name) if self.loras is not None else None
            if adapter is None:  # unloaded since the frontend looked, or never loaded
                raise ModelNotFoundError(request.lora_name)

        def text() -> ChoiceText | None:
            return ChoiceText(self.tokenizer, ids, params) if params.detokenize and request.text_in_engine else None

        seqs = [
            Sequence(
                request_id=request.request_id,
                index=i,
                prompt_ids=ids,
                params=params,
                seed=request.seed,
                arrival=now,
                text=text(),
                max_tokens=request.max_tokens,
                prompt_text=request.prompt_text,
                constraint=self.grammar.matcher(params.structured) if params.structured else None,
                lora=adapter,
            )
            for i in range(params.n)
        ]
        seqs[0].pending_forks = seqs[1:]
        return seqs

    def enqueue(self, seqs: list[Sequence]) -> None:
        request_id = seqs[0].request_id
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self.requests[request_id] = seqs
        self.prompt_tokens += len(seqs[0].prompt_ids)
        self.scheduler.add(seqs[0])

    def abort(self, request_id: str) -> RequestOutput | None:
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        for seq in seqs:
            if not seq.finished:
                self._finish(seq, "abort")
        return self._collect(request_id)

    def abort_choice(self, request_id: str, index: int) -> None:
        """One choice ends (a frontend found its stop string); the request's other choices go on."""
        seqs = self.requests.get(request_id)
        if seqs is not None and index < len(seqs) and not seqs[index].finished:
            self._finish(seqs[index], "abort")

    def fail(self, request_id: str, error: BaseException) -> None:
        """One request's own failure: it ends, its pages are freed, its owner hears of it; the engine goes on."""
        log.error("request %s failed and was dropped: %s: %s", request_id, type(error).__name__, error, exc_info=error)
        for seq in self.requests.pop(request_id, []):  # every choice, pending forks included
            seq.pending_forks = []
            if not seq.finished:
                self.scheduler.finish(seq)
        self.failed.append((request_id, error))

    def take_failed(self) -> list[tuple[str, BaseException]]:
        failed, self.failed = self.failed, []
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        s, e = self.scheduler, self.embedder  # embedding inputs are load too (the autoscaler reads these)
        spec = self.speculator
        return EngineStats(
            running=len(s.running) + len(e.running),
            waiting=len(s.waiting) + len(e.waiting),
            kv_pages_used=self.pool.num_used,
            kv_pages_total=self.pool.num_pages,
            prefix_cache_queried_tokens=s.prefix_queried_tokens,
            prefix_cache_hit_tokens=s.prefix_hit_tokens,
            preemptions=s.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            spec_draft_tokens=spec.draft_tokens if spec else 0,
            spec_accepted_tokens=spec.accepted_tokens if spec else 0,
            spec_drafts=spec.drafts if spec else 0,
            spec_accepted_per_pos=tuple(spec.accepted_per_pos) if spec else (),
            programs_compiling=self.warming.compiling() if self.warming is not None else 0,
            **s.host_tier_stats(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        loras = self.loras
        if loras is None:
            return {}
        return dict(
            lora_slots_used=loras.slots_used,
            lora_slots_total=loras.max_loras,
            lora_slot_loads=loras.slot_loads,
            lora_requests_waiting=self.scheduler.lora_waiting,
        )

    # ---- warm-up ------------------------------------------------------------------------------------------------
    def start_warmup(self) -> None:
        """Serve's warm-up: the programs a first request needs now, every other one in a background thread while
        requests are served (warmup.py). Tensor parallelism, several hosts and speculation compile all now."""
        if self.parallel.size > 1 or jax.process_count() > 1 or self.speculator is not None:
            return self.warmup()
        start = time.monotonic()
        warming = BackgroundWarmup(self._precision, busy=self.has_unfinished)
        cache = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # set at run time
        if cache and program_store.AVAILABLE:
            self.program_store = ProgramStore(Path(cache), str(self.dtype))
        first, rest = self._programs()
        warming.compile_now(first)
        if self.scheduler.offload is not None:  # the copies between the tiers
            self.kv = self.scheduler.offload.warmup(self.kv)
        self.compile_seconds = time.monotonic() - start
        loaded, compiled = warming.loaded, describe(warming.counted_from)  # (before the thread adds its own)
        self.warming = warming
        warming.start(rest)
        standing = warming.standing_in()
        log.info(
            "compiled the %d program(s) a first request needs in %.1f s (%s%s%s); %d more compile in the background "
            "while serving (until then a compiled program stands in: larger token buckets, single decode steps)",
            len(first),
            self.compile_seconds,
            f"{loaded} loaded whole from the program store, " if loaded else "",
            f"{standing} as stand-ins run layer by layer until their whole programs compile first, "
            if standing
            else "",
            compiled,
            len(rest) + standing,
        )

    def _programs(self) -> tuple[list[Program], list[Program]]:
        """Every program warmup() compiles: the first request's (a token bucket every running decode fits, and one
        stream's decode step where decodes have row buckets: on CPU a 16-token step costs a decoded token ~10x a
        one-row step), then the rest in the order a newcomer's traffic meets them (small decode steps, multi-step
        decoding of a few rows, larger token buckets, then the other row buckets and the grammar pipeline)."""
        b, variants = self.builder, self._variants()
        first_bucket, small = b.bucket_for(b.S), b.row_buckets[:-1]
        layered = layered_step.applies(self.model, self.dtype)  # the first shapes' stand-ins, compiled in seconds
        first = [self._step_program(v, first_bucket, None, layered) for v in variants]
        first += [self._step_program(v, r, r, layered) for v in variants for r in small[:1]]
        rest = [self._step_program(v, r, r) for v in variants for r in small[1:]]
        near, far = self.multi_step.programs(variants) if self.config.decode_steps > 1 else ([], [])
        tokens = [self._step_program(v, t, None) for t in b.buckets if t != first_bucket for v in variants]
        return first, rest + near + tokens + far + self._async_programs()

    def _async_programs(self) -> list[Program]:
        """The asynchronous single steps' programs (one per token bucket and sampling branches), compiled last: the
        engine schedules synchronously until every program is compiled."""
        if not self.async_steps:
            return []
        programs = []
        for v, model in self._variants().items():
            for t in self.builder.queued_buckets:
                inputs = self.builder.build([], bucket=t)
                for branches in ASYNC_BRANCHES:
                    lower = functools.partial(self._lower_async, model, inputs, branches)
                    programs.append(Program(("step", v, t, None, branches), lower))
        return programs

    def _lower_async(self, model, inputs, branches: Branches) -> list:
        return [step_fn.lower(model(), self._kv, inputs, branches=branches)]

    def _variants(self) -> dict:
        """The model variants model_for can give, by the name variant_of gives them."""
        if self.loras is None:
            return {"model": lambda: self.model}
        return {"base": lambda: dataclasses.replace(self.model, lora=None), "lora": lambda: self.model}

    def variant_of(self, chunks: list[ScheduledChunk]) -> str:
        """The name of the model variant model_for(chunks) gives (a part of each program's key)."""
        if self.loras is None:
            return "model"
        return "lora" if any(c.seq.lora is not None for c in chunks) else "base"

    def _step_program(self, variant: str, bucket: int, rows: int | None, layered: bool = False) -> Program:
        """Loaded from the program store when it has it, else compiled and then kept there. layered: with a stand-in
        compiled layer by layer (layered_step.py) for serve to run until this is compiled."""
        inputs, model = self.builder.build([], bucket=bucket, rows=rows), self._variants()[variant]
        key, store = ("step", variant, bucket, rows), self.program_store
        lower = lambda: [step_fn.lower(model(), self._kv, inputs)]  # noqa: E731

        def stand_in() -> None:
            self.layered[(variant, inputs.layout)] = layered_step.LayeredStep(model(), self._kv, inputs)

        if store is None:
            return Program(key, lower, stand_in=stand_in if layered else None)

        def load() -> bool:
            compiled = store.load(key, (model(), self._kv, inputs))
            if compiled is not None:
                self.stored_steps[(variant, inputs.layout)] = compiled
            return compiled is not None

        keep = lambda compiled: store.save(key, (model(), self._kv, inputs), compiled[0])  # noqa: E731
        return Program(key, lower, load, keep, stand_in if layered else None)

    def compiled(self, key) -> bool:
        """Whether the program of this key may run now: any may, unless serve's warm-up still compiles some."""
        return self.warming is None or self.warming.compiled(key)

    def _serve_compiled(self) -> None:
        """While the warm-up compiles: a step's tokens fit the largest compiled token bucket; once every program is
        compiled, nothing is limited."""
        warming, b = self.warming, self.builder
        assert warming is not None, "called while warming"
        if warming.done() and not warming.failed():
            self.warming = None
            self.layered.clear()
            self.scheduler.max_num_batched_tokens = self.config.max_num_batched_tokens
            return
        self.scheduler.max_num_batched_tokens = min(
            max(t for t in b.buckets if self.compiled(("step", v, t, None))) for v in self._variants()
        )

    def _token_bucket(self, variant: str, tokens: int) -> int | None:
        """The smallest compiled token bucket for this many tokens (None: the builder's own choice)."""
        if self.warming is None:
            return None
        return next(t for t in self.builder.buckets if t >= tokens and self.compiled(("step", variant, t, None)))

    # ---- stepping -------------------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compiles every token bucket now, so no request ever waits for XLA."""
        start = time.monotonic()
        b = self.builder
        small = b.row_buckets[:-1]  # steps of a few tokens and rows: one program each (row buckets)
        log.info(
            "compiling %d step shapes (token buckets %s, small steps %s)", len(b.buckets) + len(small), b.buckets, small
        )
        models = self.model_variants()
        shapes = [(t, None) for t in b.buckets] + [(r, r) for r in small]
        for model, (bucket, rows) in ((m, shape) for m in models for shape in shapes):
            inputs = b.build([], bucket=bucket, rows=rows)
            with self._precision():
                self.kv, out = step_fn(model, self.kv, inputs)
                queued = self.async_steps and rows is None and bucket in b.queued_buckets
                for branches in ASYNC_BRANCHES if queued else ():  # the asynchronous single steps' programs
                    self.kv, out = step_fn(model, self.kv, inputs, branches=branches)
            jax.block_until_ready(out)
        if self.speculator is not None:
            self.speculator.warmup(models)
        if self.config.decode_steps > 1:
            for model in models:
                self.multi_step.warmup(model)
        if self.scheduler.offload is not None:  # the copies between the tiers
            self.kv = self.scheduler.offload.warmup(self.kv)
        self.compile_seconds = time.monotonic() - start
        log.info("compilation done in %.1f s", self.compile_seconds)

    def step(self) -> list[RequestOutput]:
        """One step. A failure that belongs to one request fails that request alone (see `fail`); one that
        belongs to none (the device, a compilation) propagates: the engine cannot go on."""
        if self.scheduler.offload is not None and self.scheduler.offload.busy:  # copies between the tiers
            kv = self.scheduler.poll_host_tier(lambda: self.kv)  # reads (settles) the cache only to write loads
            if kv is not None:
                self.kv = kv
        if self.multi_step.ahead is not None:  # queued by the last step while its tokens were applied
            return self.multi_step.continue_run()
        if self.warming is not None:
            self._serve_compiled()
        chunks = self.scheduler.schedule()
        for seq, error in self.scheduler.take_failed():
            self.fail(seq.request_id, error)
        if self.scheduler.writing:  # admitted with pages a load copies back: written before the step reads them
            kv = self.scheduler.poll_host_tier(lambda: self.kv)
            if kv is not None:
                self.kv = kv
        chunks = [c for c in chunks if c.seq.request_id in self.requests]
        branches = self._async_branches(chunks)
        if self.pending is not None and branches is None:  # its tokens first: this schedule saw them PENDING
            return self._settle()
        if not chunks:
            if self.scheduler.loading:  # only copies back are left: wait (GIL released) until one lands, not spin
                assert self.scheduler.offload is not None, "sequences load only from a host tier"
                self.scheduler.offload.wait_landed(LOAD_WAIT_S)
            elif self.loras is not None and self.scheduler.blocked_on_adapters():  # adapters being read: likewise
                self.loras.wait_read(LOAD_WAIT_S)
            return []
        if self.speculator is not None and self.speculator.active():  # proposals take tokens the chunks leave
            budget = self.config.max_num_batched_tokens - sum(c.num_tokens for c in chunks)
            if self.speculator.propose(chunks, budget):
                return self._collect_all(self.speculator.verify(chunks))
        active = self.multi_step.plan(chunks)
        if active is not None:
            return self.multi_step.decode(chunks, active)
        small = self.builder.small_step(chunks)  # a few decodes: as many rows and tokens as the step's row bucket
        variant = self.variant_of(chunks)
        if small is not None and not self.compiled(("step", variant, small, small)):
            small = None
        bucket = small or self._token_bucket(variant, sum(c.num_step_tokens for c in chunks))
        if branches is not None:
            return self._step_async(chunks, bucket, branches)
        chunks, inputs = self._build(chunks, bucket=bucket, rows=small)
        if not chunks:
            return []
        run: Callable = self.stored_steps.get((variant, inputs.layout), step_fn) if self.stored_steps else step_fn
        if self.warming is not None and not self.warming.whole(("step", variant, bucket, small)):
            run = self.layered.get((variant, inputs.layout), run)  # its stand-in, until the thread compiles it
        with self._precision():
            self.kv, out = run(self.model_for(chunks), self.kv, inputs)
        return self.apply_step(chunks, self._fetch_step(out, chunks))

    # ---- asynchronous scheduling ----------------------------------------------------------------------------
    def _async_branches(self, chunks: list[ScheduledChunk]) -> Branches | None:
        """The sampling branches of these chunks' step when it may be queued while the step before runs (vLLM's
        async scheduling), else None. Only steps with prompt tokens (the prefill phase; decodes alone go multi-step)
        and whose rows need no token of their own on the host before the next step is built: no grammar, DRY,
        prompt logprobs or choices still to fork (penalties read the unread tokens on the device; a row's logprobs
        are read with its token when the step settles)."""
        if not (self.async_steps and chunks and self.warming is None and self.builder.small_step(chunks) is None):
            return None
        if not any(c.num_tokens > 1 for c in chunks):
            return None
        if self.builder.bucket_for(sum(c.num_step_tokens for c in chunks)) < self.builder.queued_buckets[0]:
            return None  # (not small, so never below them; a program compiled on a request's path if it were)
        plain, penalties, logprobs = True, False, False
        for c in chunks:
            seq, p = c.seq, c.seq.params
            if (
                seq.constraint is not None
                or p.uses_dry
                or p.prompt_logprobs is not None
                or seq.pending_forks
                or c.draft
            ):
                return None
            filters = p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
            plain &= p.temperature == 0.0 and not p.logit_bias and not filters and seq.num_output >= p.min_tokens
            penalties |= p.uses_penalties
            logprobs |= p.logprobs is not None
        if plain and not (penalties or logprobs):
            return ASYNC_GREEDY
        return (ASYNC_PENALIZED if penalties else ASYNC_SAMPLED)[logprobs]

    def _step_async(self, chunks: list[ScheduledChunk], bucket: int | None, branches: Branches) -> list[RequestOutput]:
        """Queues this step (its PENDING tokens taken from the pending step's samples on the device), then reads and
        applies the pending step's tokens while it runs: the host's work overlaps the device's. A sequence found
        finished then has computed one token too many in this step, which is dropped (as in vLLM)."""
        previous = None if self.pending is None else self.pending.out.sampled.tokens
        chunks, inputs = self._build(chunks, bucket=bucket, previous=previous)
        if not chunks:
            return self._settle() if self.pending is not None else []
        with self._precision():
            self.kv, out = step_fn(self.model_for(chunks), self.kv, inputs, branches=branches)
        outputs = self._settle() if self.pending is not None else []
        self.pending = PendingStep(chunks, out, self._advance(chunks))
        return outputs

    def _advance(self, chunks: list[ScheduledChunk]) -> list[bool]:
        """What the next schedule needs of a queued step before its tokens are read: each chunk's tokens computed,
        and a PENDING token for each sample (row r of the step's). Whether each chunk reached its sequence's end."""
        ends = []
        for r, c in enumerate(chunks):
            seq = c.seq
            ends.append(c.samples)
            if seq.request_id not in self.requests or seq.finished:
                continue
            seq.num_computed = c.start + c.num_tokens
            self.scheduler.register_full_pages(seq)
            if c.samples and seq.max_tokens > 0:
                seq.token_ids.append(PENDING)
                seq.pending_row = r
        return ends

    def _settle(self) -> list[RequestOutput]:
        """The pending step's tokens read and applied in place of its sequences' PENDING ones."""
        p, self.pending = self.pending, None
        assert p is not None, "called with a step pending"
        out = self._fetch_step(p.out, p.chunks)
        sampled = out.sampled
        tokens = sampled.tokens.tolist()
        for r, (c, end) in enumerate(zip(p.chunks, p.ends, strict=True)):
            seq = c.seq
            if seq.request_id not in self.requests or seq.finished or not end:
                continue
            try:
                if seq.max_tokens == 0:
                    self._finish_prompt_only(seq)
                    continue
                assert seq.pending_row == r and seq.token_ids[-1] == PENDING, "the row's token is the last"
                seq.token_ids.pop()
                seq.pending_row = None
                self._append_token(seq, tokens[r], sampled, r)
            except Exception as e:  # noqa: BLE001 - this request's own fault
                self.fail(seq.request_id, e)
        return self._collect_all(c.seq.request_id for c in p.chunks)

    def apply_step(self, chunks: list[ScheduledChunk], out: StepOutputs) -> list[RequestOutput]:
        """A single step's results (on the host) into its sequences; what their requests have new."""
        t = 0
        sampled = out.sampled  # (an attribute of an equinox module costs ~3 us a read: read once a step, not a row)
        tokens = sampled.tokens.tolist()
        for r, c in enumerate(chunks):
            seq = c.seq
            if seq.request_id in self.requests:
                try:
                    self._apply_chunk(c, r, t, out, sampled, tokens[r])
                except Exception as e:  # noqa: BLE001 - this request's own fault
                    self.fail(seq.request_id, e)
            t += c.num_tokens
        return self._collect_all(c.seq.request_id for c in chunks)

    def model_for(self, chunks: list[ScheduledChunk]) -> DecoderModel:
        """The model a step of these rows runs: with its LoRA slots when some row has an adapter, else without them,
        which is another compiled program (the base model's): rows without adapters never pay for LoRA's matmuls."""
        if self.loras is None or any(c.seq.lora is not None for c in chunks):
            return self.model
        return dataclasses.replace(self.model, lora=None)

    def model_variants(self) -> list[DecoderModel]:
        """Every model model_for can give: each is compiled at warm-up."""
        return [self.model] if self.loras is None else [self.model, dataclasses.replace(self.model, lora=None)]

    @property
    def kv(self) -> KVCache:
        """The KV cache pool; when a decode dispatch was queued ahead (multi_step.py), its output, once its call
        returns: whoever reads the cache waits for that first. Pages evicted to the host tier since the last read
        have their copies queued first, so they are read before anything (the reader's call) writes them."""
        ahead = self.__dict__.get("multi_step") and self.multi_step.ahead
        if ahead:
            self.multi_step.settle()
        offload = self.__dict__.get("scheduler") and self.scheduler.offload
        if offload:
            offload.flush(self._kv)
        return self._kv

    @kv.setter
    def kv(self, value: KVCache) -> None:
        self._kv = value

    def fetch(self, out):
        """A device call's results on the host (every step's one wait for the device)."""
        return jax.device_get(out)

    def _fetch_step(self, out: StepOutputs, chunks: list[ScheduledChunk]) -> StepOutputs:
        """What the host reads of a step's outputs: the tokens, and the log-probabilities only when a row asked for
        them. Each output array is its own copy from the device, ~60 us apart (H100, a 2,048-token prefill step:
        9 copies, 0.5 ms), and a step where no row asked reads one; the rest stay on the device, never read."""
        logprobs = any(c.seq.params.logprobs is not None for c in chunks)
        prompt = any(c.seq.params.prompt_logprobs is not None for c in chunks)
        wanted = (out.sampled if logprobs else out.sampled.tokens, out.prompt if prompt else None)
        sampled, prompt_out = self.fetch(wanted)
        if not logprobs:
            sampled = eqx.tree_at(lambda s: s.tokens, out.sampled, sampled)
        return StepOutputs(sampled, prompt_out if prompt else out.prompt)

    def _add_prompt_logprobs(self, seq: Sequence, c: ScheduledChunk, out: StepOutputs, t0: int) -> None:
        """The logprobs of the prompt tokens this chunk computed (each token's, given the ones before it)."""
        n = seq.params.prompt_logprobs
        assert n is not None and out.prompt is not None, "called for requests that asked for prompt logprobs"
        if c.start == 0:
            seq.prompt_logprobs = [None]  # the first prompt token has no context
        count = max(0, min(c.num_tokens, len(seq.prompt_ids) - 1 - c.start))  # the last one predicts the output
        targets = seq.token_ids[c.start + 1 : c.start + 1 + count]
        seq.prompt_logprobs += prompt_logprobs(self.tokenizer, targets, out.prompt, t0, n)
        if c.start + c.num_tokens >= len(seq.prompt_ids):
            seq.prompt_logprobs_done = True

    def _apply_chunk(
        self, c: ScheduledChunk, r: int, t: int, out: StepOutputs, sampled: SampleResult, token: int
    ) -> None:
        """sampled, token: out.sampled and row r's token, read by the caller once for every row."""
        seq = c.seq
        seq.num_computed = c.start + c.num_tokens
        self.scheduler.register_full_pages(seq)
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_done:
            self._add_prompt_logprobs(seq, c, out, t)
        if not c.samples or seq.finished:
            return
        if seq.max_tokens == 0:
            return self._finish_prompt_only(seq)
        if seq.pending_forks:
            self._fork(seq)
        self._append_token(seq, token, sampled, r)

    def _build(
        self,
        chunks: list[ScheduledChunk],
        bucket: int | None = None,
        masks: bool = True,
        rows: int | None = None,
        previous: jax.Array | None = None,
    ):
        """The step's inputs; when building fails, each chunk is tried alone and the requests whose chunks fail
        are failed, so one request's bad input never stops the engine."""
        try:
            return chunks, self.builder.build(chunks, bucket=bucket, masks=masks, rows=rows, previous=previous)
        except Exception:  # noqa: BLE001 - find whose it is, below
            log.exception("building a step failed; looking for the request at fault")
        kept = []
        for c in chunks:
            try:
                self.builder.build([c], previous=previous)
                kept.append(c)
            except Exception as e:  # noqa: BLE001
                self.fail(c.seq.request_id, e)
        if len(kept) == len(chunks):
            raise RuntimeError("building a step failed, though every chunk builds alone")
        kept = [c for c in kept if c.seq.request_id in self.requests]
        return kept, (
            self.builder.build(kept, bucket=bucket, masks=masks, rows=rows, previous=previous) if kept else None
        )

    def _collect_all(self, request_ids) -> list[RequestOutput]:
        outputs = []
        for rid in dict.fromkeys(request_ids):
            if rid not in self.requests:
                continue  # failed (and reported) during this step
            try:
                if (o := self._collect(rid)) is not None:
                    outputs.append(o)
            except Exception as e:  # noqa: BLE001
                self.fail(rid, e)
        return outputs

    @contextlib.contextmanager
    def _precision(self):
        """Every device call runs in here: float32 means float32 (no TF32 shortcuts in matmuls on GPUs: golden
        parity is to 1e-4), and under tensor parallelism the steps trace and run on its mesh."""
        with (
            jax.default_matmul_precision("float32" if self.dtype == jnp.float32 else "default"),
            self.parallel.context(),
        ):
            yield

    def _fork(self, parent: Sequence) -> None:
        """Choices 1..n-1 start from the parent's computed prompt pages, shared by reference count."""
        page = self.config.page_size
        shared = (len(parent.prompt_ids) - 1) // page  # leave at least one prompt token for the child to compute
        for child in reversed(parent.pending_forks):
            child.pages = parent.pages[:shared]
            child.page_hashes = parent.page_hashes[:shared]
            self.pool.share(child.pages)
            child.num_computed = child.num_cached_tokens = shared * page
            child.prompt_logprobs_done = True
            self.scheduler.add(child, front=True)
        parent.pending_forks = []

    def _append_token(self, seq: Sequence, token: int, s: SampleResult, at, grammar_done: bool | None = None) -> None:
        """Adds a sampled token; `at` indexes its logprob data in s (a row, or (step, row) for multi-step);
        grammar_done is given when the grammar has taken the token already (the decode pipeline)."""
        p = seq.params
        # a refusal raises (this request fails alone); a complete grammar ends the output whatever its stop token
        if grammar_done is None:
            grammar_done = seq.constraint is not None and seq.constraint.accept(token)
        seq.token_ids.append(token)
        seq.new_token_ids.append(token)
        self.generation_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if p.logprobs is not None:
            seq.new_logprobs.append(
                position_logprobs(
                    self.tokenizer,
                    token,
                    float(s.logprob[at]),
                    int(s.rank[at]),
                    s.top_ids[at],
                    s.top_logprobs[at],
                    p.logprobs,
                )
            )
        if token in (p.stop_token_ids or ()):
            return self._finish(seq, "stop", stop_reason=token)
        if token in self.eos_token_ids and not p.ignore_eos:
            return self._finish(seq, "stop")
        if seq.text is not None:
            text, stopped = seq.text.add(token)
            seq.new_text += text
            if stopped:
                return self._finish(seq, "stop", stop_reason=seq.text.stop)
        if grammar_done:
            return self._finish(seq, "stop")
        if seq.num_output >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")

    def _finish_prompt_only(self, seq: Sequence) -> None:
        """max_tokens 0 (echo, scoring): the prompt is computed and its logprobs taken; every choice ends there."""
        forks, seq.pending_forks = seq.pending_forks, []
        for s in (seq, *forks):
            s.prompt_logprobs_done = True
            self._finish(s, "length")

    def _finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        if seq.text is not None and not isinstance(stop_reason, str):  # a stop string's text has ended already
            seq.new_text += seq.text.finish()
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        for child in seq.pending_forks:  # the parent ended before its prefill did (an abort): so do they
            self._finish(child, "abort")
        seq.pending_forks = []
        self.scheduler.finish(seq)

    def _collect(self, request_id: str) -> RequestOutput | None:
        """The request's news since the last collection, as a delta RequestOutput; drops finished requests."""
        seqs = self.requests[request_id]
        outputs, prompt_lp = [], None
        for seq in seqs:
            if seq.new_token_ids or seq.new_text or (seq.finish_reason and not seq.reported_finish):
                outputs.append(
                    CompletionOutput(
                        index=seq.index,
                        text=seq.new_text,
                        token_ids=seq.new_token_ids,
                        logprobs=seq.new_logprobs if seq.params.logprobs is not None else None,
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
                seq.new_text, seq.new_token_ids, seq.new_logprobs = "", [], []
                seq.reported_finish = seq.finish_reason is not None
            if seq.index == 0 and seq.prompt_logprobs_done and seq.prompt_logprobs and not seq.prompt_logprobs_sent:
                prompt_lp, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        if not outputs and prompt_lp is None:
            return None
        finished = all(s.finished for s in seqs)
        if finished:
            del self.requests[request_id]
        return RequestOutput(
            request_id=request_id,
            prompt=seqs[0].prompt_text,
            prompt_token_ids=seqs[0].prompt_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=seqs[0].num_cached_tokens,
        )
