"""The FastAPI app over one AsyncLLM, and `serve()`, which runs it under uvicorn with the SIGTERM drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time

import uvicorn
from fastapi import FastAPI

from ..engine.errors import RequestCancelledError
from ..generation_config import describe as describe_defaults
from ..generation_config import sampling_defaults
from . import (
    chat,
    completions,
    embeddings,
    kv_events_info,
    lora_adapters,
    model_list,
    probes,
    responses,
    tokenize,
    version,
)
from .access_log import quiet_probes
from .auth import APIKeyMiddleware
from .body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware
from .context import ServerContext
from .drain import Drain, DrainingServer, DrainMiddleware
from .errors import install_error_handlers
from .header_limits import HeaderLimitedProtocol
from .lora_sync import LoRAModulesFile
from .metrics import ServerMetrics
from .tls import serving_certificate
from .tool_parsers import parser_for
from .tracing import make_tracer_provider

log = logging.getLogger("capstan.server")


def build_app(
    ctx: ServerContext,
    api_keys: list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allow_runtime_lora_updating: bool = False,
    lora_modules_file: str | None = None,
) -> FastAPI:
    """allow_runtime_lora_updating: serve /v1/load_lora_adapter and /v1/unload_lora_adapter; lora_modules_file:
    follow that file's adapters (one frontend of several does)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await ctx.engine.start()  # an engine core's client connects on this loop
        tasks = [asyncio.create_task(_log_warmup(ctx.engine))]
        if lora_modules_file is not None:
            tasks.append(
                asyncio.create_task(LoRAModulesFile(ctx.engine, lora_modules_file, ctx.served_model_names).run())
            )
        yield
        for task in tasks:
            task.cancel()
        await ctx.engine.stop()

    app = FastAPI(title="Capstan", description="OpenAI-compatible LLM server", version="0.1.0", lifespan=lifespan)
    app.state.context = ctx
    install_error_handlers(app)
    for router in (
        completions.router,
        chat.router,
        responses.router,
        embeddings.router,
        tokenize.router,
        model_list.router,
        probes.router,
        version.router,
        kv_events_info.router,
        *([lora_adapters.router] if allow_runtime_lora_updating else []),
    ):
        app.include_router(router)
    app.add_middleware(APIKeyMiddleware, keys=api_keys or [])  # /v1 only: probes and /metrics stay open
    app.add_middleware(DrainMiddleware, drain=ctx.drain)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)  # added last: runs first
    return app


def make_context(
    engine,
    served_model_names: list[str] | None = None,
    log_prompts: bool = False,
    tracer_provider=None,
    tool_call_parser: str | None = None,
) -> ServerContext:
    names = served_model_names or [engine.model_name]
    tracer = tracer_provider.get_tracer("capstan.server") if tracer_provider is not None else None
    defaults = sampling_defaults(engine.config)  # from the config and the checkpoint's files: no device needed
    log.info(describe_defaults(defaults, engine.config))
    return ServerContext(
        engine=engine,
        served_model_names=names,
        metrics=ServerMetrics(engine),
        drain=Drain(),
        tracer=tracer,
        log_prompts=log_prompts,
        tool_parser=parser_for(tool_call_parser, engine.tokenizer),
        sampling_defaults=defaults,
    )


async def _log_warmup(engine) -> None:
    """The engine loads and compiles what a first request needs elsewhere; the log says when it can answer."""
    started = time.monotonic()
    if not engine.is_ready():
        log.info("loading the model and compiling what a first request needs; /ready answers 503 until then")
    while not engine.is_ready():
        if not engine.is_alive():
            log.error("the engine loop stopped during warm-up; see the errors above")
            return
        await asyncio.sleep(0.5)
    compiling = engine.stats().programs_compiling
    log.info(
        "ready to serve after %.1f s%s",
        time.monotonic() - started,
        f" ({compiling} more programs compile meanwhile: capstan_programs_compiling)" if compiling else "",
    )


def serve(
    engine,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_names: list[str] | None = None,
    api_keys: list[str] | None = None,
    drain_timeout: float = 30.0,
    log_prompts: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    tool_call_parser: str | None = None,
    reuse_port: bool = False,
    on_start=None,
    on_drain=None,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
    allow_runtime_lora_updating: bool = False,
    lora_modules_file: str | None = None,
) -> int:
    """Serves until SIGTERM (drain, then exit) or SIGINT; shuts the engine down on the way out. reuse_port: several
    frontend processes share the port (the kernel spreads connections); on_start(server) runs on the server's loop,
    on_drain() when a drain starts; ssl_keyfile and ssl_certfile: HTTPS, the pair read again when it changes. Returns
    the exit code (1 when the server drained because a part of it failed)."""
    certificate = serving_certificate(ssl_keyfile, ssl_certfile)
    provider = make_tracer_provider()
    ctx = make_context(engine, served_model_names, log_prompts, provider, tool_call_parser)
    app = build_app(ctx, api_keys, max_body_bytes, allow_runtime_lora_updating, lora_modules_file)
    # After a drain (or its timeout), give streams still open a moment, then cancel them (which aborts them).
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
        **(certificate.uvicorn_options() if certificate else {}),
        http=HeaderLimitedProtocol,  # bounded request heads (431, 408)
    )
    quiet_probes()  # successful probes at DEBUG
    watches = []  # keeps the certificate's reload task referenced
    if certificate is not None:
        certificate.attach(config)
        on_start = _also(on_start, lambda server: watches.append(asyncio.ensure_future(certificate.watch())))
    timeout_error = RequestCancelledError(
        f"the server is shutting down and its drain timeout ({drain_timeout:g} s) has passed; retry on another replica"
    )
    server = DrainingServer(
        config,
        ctx.drain,
        drain_timeout,
        on_timeout=lambda: engine.cancel_all(timeout_error),
        on_start=on_start,
        on_drain=on_drain,
    )
    auth = f"{len(api_keys)} API key(s)" if api_keys else "no API key (open)"
    log.info(
        "serving %s as %s on %s://%s:%d with %s",
        engine.model_name,
        ", ".join(ctx.served_model_names),
        "https" if certificate else "http",
        host,
        port,
        auth,
    )
    try:
        server.run(sockets=[shared_port_socket(host, port)] if reuse_port else None)
    finally:
        engine.shutdown()
        if provider is not None:
            provider.shutdown()
    return server.exit_code


def _also(first, second):
    """Both on_start hooks, in order (the first may be None)."""

    def both(server) -> None:
        if first is not None:
            first(server)
        second(server)

    return both


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other processes bind too (SO_REUSEPORT): one port, several frontends."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
