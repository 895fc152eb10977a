"""A frontend of `capstan serve --api-server-count N` beyond the first: the same FastAPI app on the same port
(SO_REUSEPORT), in front of the same engine core; started by processes.py, its FrontendSpec on stdin."""

from __future__ import annotations

import logging
import sys

import msgspec

from ..engine.core_client import EngineCoreClient
from ..engine.parent_death import die_with_parent
from ..tokenizer import Tokenizer
from .app import serve
from .serve_options import FrontendSpec, ServeOptions


def serve_kwargs(options: ServeOptions) -> dict:
    kwargs = {f: getattr(options, f) for f in options.__struct_fields__}
    if kwargs["max_body_bytes"] is None:
        del kwargs["max_body_bytes"]
    return kwargs


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=FrontendSpec)
    die_with_parent(spec.parent_pid)
    logging.basicConfig(
        level=spec.options.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [frontend {spec.frontend}]: %(message)s",
    )
    config = spec.config
    client = EngineCoreClient(
        config,
        Tokenizer.from_pretrained(config.tokenizer or config.checkpoint),
        spec.model_name,
        frontend=spec.frontend,
        input_addresses=spec.input_addresses,
        output_address=spec.output_address,
        core_pids=spec.core_pids,
    )
    return serve(client, **serve_kwargs(spec.options), reuse_port=True)


if __name__ == "__main__":
    sys.exit(main())
