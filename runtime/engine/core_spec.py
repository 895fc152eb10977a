"""What the serving process tells its engine core at start: light (msgspec and the config only), so that the
serving process can start its cores before it imports JAX and the HTTP stack itself (issue 63: ~1.5 s sooner)."""

from __future__ import annotations

import msgspec

from ..config import EngineConfig


class CoreSpec(msgspec.Struct):
    """What the serving process tells its engine core: the engine's configuration and the sockets."""

    config: EngineConfig
    input_address: str  # the core binds it; every frontend pushes to it
    output_addresses: list[str]  # one per frontend, which binds it; the core pushes to it
    parent_pid: int
    log_level: str = "INFO"
    cpu_max_num_seqs: int | None = None  # max_num_seqs when the backend is a CPU (none was given)
    core: int = 0  # which of --data-parallel-size engine cores this is
