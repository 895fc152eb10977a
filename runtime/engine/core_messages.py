"""The wire between frontends and the engine core: msgpack (msgspec) messages, typed on both ends.

Frontends push requests, embeddings, aborts and the shutdown to the core's one input socket; the core pushes each
frontend its own requests' outputs, with the engine's stats, on that frontend's output socket."""

from __future__ import annotations

import msgspec

from ..config import EngineConfig
from ..lora.request import LoRARequest
from .engine_stats import EngineStats
from .input_processor import EmbeddingRequest, EngineRequest, ModelLimits
from .outputs import EmbeddingRequestOutput, RequestOutput


# ---- frontend -> engine core --------------------------------------------------------------------------------------
class Add(msgspec.Struct, tag="add", array_like=True):
    frontend: int  # whose output socket answers it
    request: EngineRequest


class Embed(msgspec.Struct, tag="embed", array_like=True):
    frontend: int
    request: EmbeddingRequest


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str
    index: int | None = None  # one choice only (a stop string ended it); None: the whole request


class LoadLoRA(msgspec.Struct, tag="load_lora", array_like=True):
    """Load a LoRA adapter under name (replacing none: the frontend checked the name is free); answered by LoRADone."""

    frontend: int
    call_id: str
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag="unload_lora", array_like=True):
    frontend: int
    call_id: str
    name: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ToCore = Add | Embed | Abort | LoadLoRA | UnloadLoRA | Shutdown


# ---- engine core -> frontend --------------------------------------------------------------------------------------
class Loaded(msgspec.Struct, tag="loaded", array_like=True):
    """The model is on the device: admission can start checking requests against it (warm-up follows)."""

    limits: ModelLimits
    config: EngineConfig  # as the core resolved it (max_model_len, num_pages, max_num_seqs)
    model_name: str
    core: int = 0


class LoRAs(msgspec.Struct, tag="loras", array_like=True):
    """The core's LoRA adapters, to every frontend when they change (and at load): what requests may name."""

    loras: list[LoRARequest]
    core: int = 0


class LoRADone(msgspec.Struct, tag="lora_done", array_like=True):
    """The answer to a LoadLoRA or UnloadLoRA: error None is success (unload: found says whether it was there)."""

    call_id: str
    error: str | None = None
    field: str | None = None
    found: bool = True
    core: int = 0


class Ready(msgspec.Struct, tag="ready", array_like=True):
    compile_seconds: float
    core: int = 0


class Failure(msgspec.Struct, array_like=True):
    """A request that failed alone: kind is "invalid" (400, param names the field), "queue_full" (429) or
    "failed" (a fault it triggered in the engine)."""

    request_id: str
    kind: str
    message: str
    param: str | None = None


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[RequestOutput]
    embeddings: list[list[EmbeddingRequestOutput]]
    failures: list[Failure]
    stats: EngineStats
    core: int = 0


class Dead(msgspec.Struct, tag="dead", array_like=True):
    """The engine core's last word before it exits: no request can make progress."""

    message: str
    core: int = 0


FromCore = Loaded | LoRAs | LoRADone | Ready | Outputs | Dead

encode = msgspec.msgpack.Encoder().encode
decode_to_core = msgspec.msgpack.Decoder(ToCore).decode
decode_from_core = msgspec.msgpack.Decoder(FromCore).decode
