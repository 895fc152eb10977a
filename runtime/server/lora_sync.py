"""LoRAModulesFile: follows --lora-modules-file while the server runs. The operator mounts an InferenceService's
adapters as a ConfigMap there; Kubernetes rewrites the file when the list changes, and this loads the adapters added
and unloads those removed, without a restart. A bad entry is logged naming it (and tried again every RETRY_S seconds,
in case its files come later) while the others are served.

Runs in one frontend only (the main process: processes.py): the engine cores tell every frontend the new list."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from pathlib import Path

from ..lora.modules_file import parse_modules_file
from ..lora.request import LoRAError

log = logging.getLogger("capstan.server")
POLL_S = 2.0  # how often the file is read (Kubernetes updates a mounted ConfigMap within about a minute)
RETRY_S = 30.0  # how often an entry that failed to load is tried again while the file is unchanged


class LoRAModulesFile:
    def __init__(self, engine, path: str, served_model_names: list[str]):
        self.engine, self.path, self.served = engine, Path(path), set(served_model_names)
        self.applied: dict[str, str] = {}  # name -> path: adapters this file has loaded (only these it unloads)
        self.failed: dict[str, tuple[str, float]] = {}  # name -> (path, when it last failed)
        self._digest: bytes | None = None
        self._read_error: str | None = None

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next poll tries again; serving goes on
                log.exception("--lora-modules-file %s: reading it failed", self.path)
            await asyncio.sleep(POLL_S)

    async def poll(self) -> None:
        """Reads the file; when it changed (or a failed entry is due again), brings the adapters in line with it."""
        if not self.engine.is_ready():  # the adapters listed at start load with the model
            return
        try:
            data = await asyncio.to_thread(self.path.read_bytes)
        except OSError as e:
            if self._read_error != str(e):
                log.error("--lora-modules-file %s: cannot be read (%s); the adapters loaded stay served", self.path, e)
                self._read_error = str(e)
            return
        self._read_error = None
        digest = hashlib.blake2b(data, digest_size=16).digest()
        now = time.monotonic()
        due = any(now - when >= RETRY_S for _, when in self.failed.values())
        if digest == self._digest and not due:
            return
        self._digest = digest
        try:
            wanted, errors = parse_modules_file(data, str(self.path))
        except LoRAError as e:
            log.error("%s; the adapters loaded stay served", e)
            return
        for message in errors:
            log.error("%s", message)
        await self._apply(wanted, now)

    async def _apply(self, wanted: dict[str, str], now: float) -> None:
        for name, path in list(self.applied.items()):  # removed from the file, or moved to another path
            if wanted.get(name) != path:
                await self.engine.unload_lora(name)
                del self.applied[name]
                log.info("--lora-modules-file: LoRA adapter %s unloaded", name)
        self.failed = {n: f for n, f in self.failed.items() if wanted.get(n) == f[0]}
        loaded = {lora.lora_name: lora.lora_path for lora in self.engine.list_loras()}
        for name, path in wanted.items():
            if name in self.applied:
                continue
            if name in self.served:
                log.error("--lora-modules-file: adapter %s has the name of the served model; it is not loaded", name)
                continue
            if loaded.get(name) == path:  # loaded at start (or by hand) from the same files: this file's now
                self.applied[name] = path
                continue
            if name in self.failed and now - self.failed[name][1] < RETRY_S:
                continue
            try:
                if name in loaded:  # the file names another path for it: the file wins
                    await self.engine.unload_lora(name)
                await self.engine.load_lora(name, path)
            except LoRAError as e:
                log.error("--lora-modules-file: adapter %s (%s) is not served: %s", name, path, e)
                self.failed[name] = (path, now)
                continue
            self.failed.pop(name, None)
            self.applied[name] = path
            log.info("--lora-modules-file: LoRA adapter %s loaded from %s", name, path)


def adapters_at_start(
    lora_modules: dict[str, str] | None,
    modules_file: str | None,
    checkpoint: Path,
    max_lora_rank: int,
    served_model_names: list[str],
) -> dict[str, str]:
    """The adapters the engine loads with the model: --lora-modules, each checked now (a bad one is an error that
    names it, before the model loads), then the file's entries (a bad one is logged and left out)."""
    from ..lora.peft import check_adapter
    from ..models.config import ModelConfig

    cfg = ModelConfig.from_pretrained(checkpoint) if (checkpoint / "config.json").is_file() else None  # GGUF: later
    adapters: dict[str, str] = {}
    for name, path in (lora_modules or {}).items():
        if name in served_model_names:
            raise LoRAError(f"--lora-modules: {name} is the served model's name; name the adapter otherwise", "name")
        if cfg is not None:
            try:
                check_adapter(path, cfg, max_lora_rank)
            except LoRAError as e:
                raise LoRAError(f"--lora-modules {name}={path}: {e}", e.field) from None
        adapters[name] = path
    if modules_file is None:
        return adapters
    try:
        wanted, errors = parse_modules_file(Path(modules_file).read_bytes(), modules_file)
    except (OSError, LoRAError) as e:
        log.error("--lora-modules-file %s: %s; it is read again while serving", modules_file, e)
        return adapters
    for message in errors:
        log.error("%s", message)
    for name, path in wanted.items():
        if name in adapters or name in served_model_names:
            log.error("--lora-modules-file: adapter %s is named already (--lora-modules or the model); left out", name)
            continue
        try:
            if cfg is not None:
                check_adapter(path, cfg, max_lora_rank)
        except LoRAError as e:
            log.error("--lora-modules-file: adapter %s (%s) is not served: %s", name, path, e)
            continue
        adapters[name] = path
    return adapters
