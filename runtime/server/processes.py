"""`capstan serve`'s processes: this one (the first frontend, and the supervisor), the engine core, and
--api-server-count - 1 more frontends on the same port.

The engine core and the other frontends are children that die with this process (so no orphan survives the pod's
main process, SIGKILL included). SIGTERM drains every frontend, then the core is told to stop. If the core dies,
every frontend fails /health; if another frontend dies, this one drains and exits 1: the pod restarts as a whole."""
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

from ..config import EngineConfig, served_model_name
from ..engine.core_client import EngineCoreClient
from ..engine.core_messages import CoreSpec, Shutdown, encode
from ..models.loader import resolve_checkpoint
from ..tokenizer import Tokenizer
from .app import serve
from .frontend_process import FrontendSpec, ServeOptions, serve_kwargs
from .metrics import share_across_processes

log = logging.getLogger("capstan.server")
CORE_STOP_TIMEOUT = 10.0  # seconds the core gets to leave its loop after Shutdown before it is killed


def serve_with_engine_core(config: EngineConfig, options: ServeOptions, api_server_count: int = 1,
                           cpu_max_num_seqs: int | None = None) -> int:
    """Serves until SIGTERM (after the drain) or SIGINT; returns the exit code. cpu_max_num_seqs: the core's
    max_num_seqs when it finds itself on a CPU (only the core may start JAX's backend)."""
    path = resolve_checkpoint(config.model)  # hf:// downloads once, here
    tokenizer_path = resolve_checkpoint(config.tokenizer) if config.tokenizer else path
    config = dataclasses.replace(config, model=str(path), tokenizer=str(tokenizer_path))
    tokenizer = Tokenizer.from_pretrained(tokenizer_path)
    model_name = served_model_name(path)
    workdir = tempfile.mkdtemp(prefix="capstan-")
    if api_server_count > 1:  # each frontend's latency histograms, added up by whichever one is scraped
        os.mkdir(f"{workdir}/metrics")
        share_across_processes(f"{workdir}/metrics")
    input_address = f"ipc://{workdir}/engine-core"
    output_addresses = [f"ipc://{workdir}/frontend-{i}" for i in range(api_server_count)]
    core = _spawn("capstan.runtime.engine.core_process", CoreSpec(
        config, input_address, output_addresses, os.getpid(), options.log_level.upper(), cpu_max_num_seqs))
    frontends: list[subprocess.Popen] = []
    stopping = False
    try:
        for i in range(1, api_server_count):
            frontends.append(_spawn("capstan.runtime.server.frontend_process", FrontendSpec(
                config, model_name, i, input_address, output_addresses[i], core.pid, os.getpid(), options),
                cpu_only=True))
        client = EngineCoreClient(config, tokenizer, model_name, frontend=0, input_address=input_address,
                                  output_address=output_addresses[0], core_pid=core.pid)

        def watch_frontends(server) -> None:
            import asyncio

            loop = asyncio.get_running_loop()
            for process in frontends:
                fd = os.pidfd_open(process.pid)

                def exited(process=process, fd=fd) -> None:
                    loop.remove_reader(fd)
                    os.close(fd)
                    if not stopping:
                        server.fail(f"frontend process {process.pid} exited ({process.wait()})")
                loop.add_reader(fd, exited)

        def drain_frontends() -> None:
            for process in frontends:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)

        code = serve(client, **serve_kwargs(options), reuse_port=api_server_count > 1,
                     on_start=watch_frontends if frontends else None, on_drain=drain_frontends)
        stopping = True
        return code
    finally:
        stopping = True
        _stop_frontends(frontends, timeout=options.drain_timeout + 10)
        _stop_core(core, input_address)
        shutil.rmtree(workdir, ignore_errors=True)


def _spawn(module: str, spec: msgspec.Struct, cpu_only: bool = False) -> subprocess.Popen:
    """A child running `python -m module`, its spec on stdin (API keys never show in `ps`)."""
    env = dict(os.environ)
    import jax  # only its configuration is read here: this process never starts a JAX backend

    cache_dir = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # jax.config's options are set at run time
    if cache_dir:  # the compilation cache this process chose, for the core too
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache_dir)
    if cpu_only:  # a frontend never touches the accelerator, whatever it imports
        env["JAX_PLATFORMS"] = "cpu"
    process = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, env=env)
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
