"""`capstan serve`'s processes: this one (the first frontend, and the supervisor), the engine core (or
--data-parallel-size of them, each on its own GPUs), and --api-server-count - 1 more frontends on the same port.

The engine core and the other frontends are children that die with this process (so no orphan survives the pod's
main process, SIGKILL included). SIGTERM drains every frontend, then the core is told to stop. If the core dies,
every frontend fails /health; if it dies before it was ever ready (it could not start: a setting, the checkpoint,
the devices), or another frontend dies, this one drains and exits 1: the pod restarts as a whole."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import msgspec
import zmq

# Light imports only up here: the engine cores start before this process imports JAX and the HTTP stack, which it
# then does while they load (serve_with_engine_core).
from ..config import EngineConfig, served_model_name
from ..engine.core_spec import CoreSpec
from ..models.checkpoint_path import resolve_checkpoint
from .lora_sync import adapters_at_start
from .metrics import share_across_processes
from .serve_options import FrontendSpec, ServeOptions

log = logging.getLogger("capstan.server")
CORE_STOP_TIMEOUT = 10.0  # seconds the core gets to leave its loop after Shutdown before it is killed


def serve_with_engine_core(
    config: EngineConfig,
    options: ServeOptions,
    api_server_count: int = 1,
    cpu_max_num_seqs: int | None = None,
    data_parallel_size: int = 1,
) -> int:
    """Serves until SIGTERM (after the drain) or SIGINT; returns the exit code. cpu_max_num_seqs: the core's
    max_num_seqs when it finds itself on a CPU (only a core may start JAX's backend). data_parallel_size: engine
    cores, each a replica of the model on its own tensor_parallel_size GPUs, behind every frontend."""
    path = resolve_checkpoint(config.checkpoint)  # hf:// downloads once, here
    tokenizer_path = resolve_checkpoint(config.tokenizer) if config.tokenizer else path
    config = dataclasses.replace(config, model=str(path), tokenizer=str(tokenizer_path))
    model_name = served_model_name(path)
    if config.enable_lora:  # bad adapters are refused before the model loads; hf:// ones download here, once
        lora_modules = adapters_at_start(
            config.lora_modules,
            options.lora_modules_file,
            path,
            config.max_lora_rank,
            options.served_model_names or [model_name],
        )
        config = dataclasses.replace(config, lora_modules=lora_modules or None)
    workdir = tempfile.mkdtemp(prefix="capstan-")
    if api_server_count > 1:  # each frontend's latency histograms, added up by whichever one is scraped
        os.mkdir(f"{workdir}/metrics")
        share_across_processes(f"{workdir}/metrics")
    input_addresses = [f"ipc://{workdir}/engine-core-{c}" for c in range(data_parallel_size)]
    output_addresses = [f"ipc://{workdir}/frontend-{i}" for i in range(api_server_count)]
    devices = [
        _core_devices(c, config.tensor_parallel_size) if data_parallel_size > 1 else None
        for c in range(data_parallel_size)
    ]  # checked before any core starts
    cores = [
        _spawn(
            "capstan.runtime.engine.core_process",
            CoreSpec(
                config,
                input_addresses[c],
                output_addresses,
                os.getpid(),
                options.log_level.upper(),
                cpu_max_num_seqs,
                c,
            ),
            devices=devices[c],
        )
        for c in range(data_parallel_size)
    ]
    core_pids = [core.pid for core in cores]
    from ..engine.core_client import EngineCoreClient  # while the cores start (each imports JAX as this does)
    from ..tokenizer import Tokenizer
    from .app import serve
    from .frontend_process import serve_kwargs

    frontends: list[subprocess.Popen] = []
    stopping = False
    try:
        for i in range(1, api_server_count):
            frontends.append(
                _spawn(
                    "capstan.runtime.server.frontend_process",
                    FrontendSpec(
                        config,
                        model_name,
                        i,
                        input_addresses,
                        output_addresses[i],
                        core_pids,
                        os.getpid(),
                        msgspec.structs.replace(options, lora_modules_file=None),  # the first frontend follows it
                    ),
                    cpu_only=True,
                )
            )
        tokenizer = Tokenizer.from_pretrained(tokenizer_path)  # while the cores load (a GGUF's vocabulary: seconds)
        client = EngineCoreClient(
            config,
            tokenizer,
            model_name,
            frontend=0,
            input_addresses=input_addresses,
            output_address=output_addresses[0],
            core_pids=core_pids,
        )

        def watch_frontends(server) -> None:
            import asyncio

            loop = asyncio.get_running_loop()
            for process in frontends:
                fd = os.pidfd_open(process.pid)

                def exited(process=process, fd=fd) -> None:
                    loop.remove_reader(fd)
                    os.close(fd)
                    if not stopping and not server.drain.draining:  # draining, each frontend ends when it is done
                        server.fail(f"frontend process {process.pid} exited ({process.wait()})")

                loop.add_reader(fd, exited)

        def on_start(server) -> None:
            client.on_start_failure = server.fail  # a core that never became ready: exit 1 with its reason
            watch_frontends(server)

        def drain_frontends() -> None:
            for process in frontends:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)

        code = serve(
            client,
            **serve_kwargs(options),
            reuse_port=api_server_count > 1,
            on_start=on_start,
            on_drain=drain_frontends,
        )
        stopping = True
        return code
    finally:
        stopping = True
        _stop_frontends(frontends, timeout=options.drain_timeout + 10)
        for core, address in zip(cores, input_addresses, strict=True):
            _stop_core(core, address)
        shutil.rmtree(workdir, ignore_errors=True)


def _core_devices(core: int, tensor_parallel_size: int) -> str:
    """The GPUs of data-parallel engine core `core`: its share of CUDA_VISIBLE_DEVICES (else of every GPU)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else None
    share = range(core * tensor_parallel_size, (core + 1) * tensor_parallel_size)
    if ids is not None and share.stop > len(ids):
        raise ValueError(
            f"--data-parallel-size x --tensor-parallel-size needs {share.stop} GPUs; "
            f"CUDA_VISIBLE_DEVICES has {len(ids)}"
        )
    return ",".join(ids[i] if ids is not None else str(i) for i in share)


def _spawn(module: str, spec: msgspec.Struct, cpu_only: bool = False, devices: str | None = None) -> subprocess.Popen:
    """A child running `python -m module`, its spec on stdin (API keys never show in `ps`)."""
    env = dict(os.environ)  # JAX_COMPILATION_CACHE_DIR among them: compilation_cache.py sets it
    if "jax" in sys.modules:  # imported already (a test calling main in-process): its configuration is the truth
        import jax

        cache_dir = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # set at run time
        if cache_dir:  # the compilation cache this process chose, for the core too
            env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    if cpu_only:  # a frontend never touches the accelerator, whatever it imports
        env["JAX_PLATFORMS"] = "cpu"
    if devices is not None:  # a data-parallel engine core sees only its own GPUs
        env["CUDA_VISIBLE_DEVICES"] = devices
    process = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, env=env)
    assert process.stdin is not None  # stdin=PIPE
    process.stdin.write(msgspec.json.encode(spec))
    process.stdin.close()
    return process


def _stop_frontends(frontends: list[subprocess.Popen], timeout: float) -> None:
    for process in frontends:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # drains (idempotent when it drains already)
    for process in frontends:
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("frontend process %d did not exit within %.0f s; killed", process.pid, timeout)
            process.kill()
            process.wait()


def _stop_core(core: subprocess.Popen, input_address: str) -> None:
    from ..engine.core_messages import Shutdown, encode

    if core.poll() is None:
        context = zmq.Context()
        outbox = context.socket(zmq.PUSH)
        outbox.connect(input_address)
        outbox.send(encode(Shutdown()))
        outbox.close(linger=1000)
        context.term()
        try:
            core.wait(CORE_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            log.warning("the engine core did not stop within %.0f s; killed", CORE_STOP_TIMEOUT)
            core.kill()
    core.wait()
