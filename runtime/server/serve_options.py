"""What every frontend process is told: serve()'s options and, for a frontend of its own process, its sockets.
Light (msgspec and the config only), so that `capstan serve` builds them before it imports the HTTP stack."""

from __future__ import annotations

import msgspec

from ..config import EngineConfig


class ServeOptions(msgspec.Struct):
    """serve()'s arguments, as every frontend process gets them."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] | None = None
    api_keys: list[str] | None = None
    drain_timeout: float = 30.0
    log_prompts: bool = False
    max_body_bytes: int | None = None
    log_level: str = "info"
    tool_call_parser: str | None = None
    ssl_keyfile: str | None = None  # each frontend serves (and reloads) the same pair
    ssl_certfile: str | None = None
    allow_runtime_lora_updating: bool = False
    lora_modules_file: str | None = None  # followed by the first frontend only (processes.py)


class FrontendSpec(msgspec.Struct):
    config: EngineConfig
    model_name: str
    frontend: int
    input_addresses: list[str]  # one per engine core (--data-parallel-size)
    output_address: str
    core_pids: list[int]
    parent_pid: int
    options: ServeOptions
