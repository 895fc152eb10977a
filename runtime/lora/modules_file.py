"""--lora-modules-file: a JSON list of adapters, [{"name": ..., "path": ...}], as a mounted ConfigMap holds it."""

from __future__ import annotations

import json

from .request import LoRAError, check_name


def parse_modules_file(data: bytes, where: str) -> tuple[dict[str, str], list[str]]:
    """(name -> path of the good entries, one message per bad entry naming it). A file that is not a JSON list
    raises LoRAError: nothing in it can be trusted, so the caller keeps what it serves."""
    try:
        entries = json.loads(data or b"[]")
    except ValueError as e:
        raise LoRAError(f"{where}: not valid JSON: {e}", "lora_modules_file") from None
    if not isinstance(entries, list):
        raise LoRAError(f'{where}: expected a JSON list of {{"name": ..., "path": ...}}', "lora_modules_file")
    good: dict[str, str] = {}
    errors: list[str] = []
    for i, entry in enumerate(entries):
        name = entry.get("name") if isinstance(entry, dict) else None
        label = f"{where}: entry {i}" + (f" ({name!r})" if isinstance(name, str) else "")
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"]:
            errors.append(f'{label}: expected {{"name": ..., "path": ...}} with a non-empty path')
            continue
        if not isinstance(name, str):
            errors.append(f"{label}: name must be a string")
            continue
        try:
            check_name(name, "name")
        except LoRAError as e:
            errors.append(f"{label}: {e}")
            continue
        if name in good:
            errors.append(f"{label}: the name {name!r} is listed twice; the first entry is served")
            continue
        good[name] = entry["path"]
    return good, errors
