"""LoRARequest (vLLM's shape) and Adapter, one registration of it in an engine; no JAX here (frontends import it)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re

# A served name: what clients send as `model`, so no spaces or control characters; the length as requests' limit
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}")


class LoRAError(ValueError):
    """An adapter that cannot be served on this model: field names what is wrong (r, target_modules, a tensor...)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name, a positive integer id that keys it, and where its PEFT folder is (a
    local folder or hf://org/name[@revision])."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}", "lora_int_id")
        check_name(self.lora_name)

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def check_name(name: str, field: str = "lora_name") -> None:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise LoRAError(
            f"{field}: {name!r} is not a usable adapter name (1 to 256 letters, digits and ._:/@+-, "
            f"starting with a letter or digit)",
            field,
        )


@dataclasses.dataclass(eq=False)
class Adapter:
    """One registration of an adapter in an engine. serial is new at every registration, so pages cached under an
    earlier adapter of the same name (whose files may have changed since) are never found for this one."""

    request: LoRARequest
    serial: int

    @property
    def name(self) -> str:
        return self.request.lora_name

    @functools.cached_property
    def hash_root(self) -> bytes:
        """The parent of its sequences' first KV page in the prefix cache's hash chain (kv/page_pool.py): the same
        prompt under two adapters is two different K/V."""
        r = self.request
        key = f"lora\0{self.serial}\0{r.lora_int_id}\0{r.lora_name}\0{r.lora_path}".encode()
        return hashlib.blake2b(key, digest_size=16).digest()


def check_limits(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None) -> None:
    """The flags' ranges (vLLM's: max_cpu_loras at least max_loras)."""
    if max_loras < 1:
        raise LoRAError(f"max_loras must be at least 1, got {max_loras}", "max_loras")
    if not 1 <= max_lora_rank <= 512:
        raise LoRAError(f"max_lora_rank must be between 1 and 512, got {max_lora_rank}", "max_lora_rank")
    if max_cpu_loras is not None and max_cpu_loras < max_loras:
        raise LoRAError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})", "max_cpu_loras")
