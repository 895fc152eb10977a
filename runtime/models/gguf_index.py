"""A GGUF file's metadata and tensor table, kept on disk after its first read.

gguf's reader parses the metadata element by element: SmolLM2's 49,152 tokens and 48,900 merges take ~2.4 s on a
small CPU, paid by every frontend (the tokenizer) and again by the engine core (the model) at every start. The
index (JSON, ~2 MB) loads in ~20 ms and maps the same tensor bytes. It is keyed by the file's resolved path, size
and modification time, and by gguf's version: a changed file, or another reader, is read afresh."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from ..gguf_metadata import GGUF_INDEXES

log = logging.getLogger("capstan")
INDEX_FORMAT = 1  # bump when what an index holds changes
KEEP_INDEXES = 32  # the newest; older ones go when one is added (files a test wrote and removed leave theirs)


@dataclass(frozen=True)
class IndexedField:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class IndexedTensor:
    """What the loader reads of gguf's ReaderTensor: the same names, types and array views."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's order (innermost first), as the reader gives it
    data: np.ndarray  # a read-only view of the file's bytes, in the reader's dtype and shape


class GGUFIndex:
    def __init__(self, fields: dict[str, Any], tensors: list[IndexedTensor]):
        self.fields = {key: IndexedField(value) for key, value in fields.items()}
        self.tensors = tensors

    def get_field(self, key: str) -> IndexedField | None:
        return self.fields.get(key)


def index_file(path: str) -> Path:
    resolved = Path(path).resolve()
    stat = resolved.stat()
    key = f"{INDEX_FORMAT}|{version('gguf')}|{resolved}|{stat.st_size}|{stat.st_mtime_ns}"
    return GGUF_INDEXES / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def save_index(reader: gguf.GGUFReader, path: str) -> None:
    """Best effort: an unwritable cache, or metadata JSON cannot hold, just means the next start reads again."""
    tensors = [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            "shape": t.shape.tolist(),
            "offset": int(t.data_offset),
            "bytes": int(t.n_bytes),
            "dtype": t.data.dtype.str,
            "dims": list(t.data.shape),
        }
        for t in reader.tensors
    ]
    temporary = None
    try:
        fields = {key: field.contents() for key, field in reader.fields.items()}
        target = index_file(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False) as out:
            temporary = out.name
            json.dump({"fields": fields, "tensors": tensors}, out, allow_nan=False)
        os.replace(temporary, target)  # whole or absent: a reader never sees half an index
        indexes = sorted(target.parent.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in indexes[KEEP_INDEXES:]:
            old.unlink(missing_ok=True)
    except (OSError, TypeError, ValueError) as e:
        log.debug("%s: GGUF index not kept: %s", path, e)
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def load_index(path: str) -> GGUFIndex | None:
    """The file's index, its tensors mapped; None when there is none (or it does not fit the file)."""
    try:
        with open(index_file(path)) as f:
            index = json.load(f)
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = []
        for t in index["tensors"]:
            if t["offset"] < 0 or t["offset"] + t["bytes"] > raw.size:
                return None
            data = raw[t["offset"] : t["offset"] + t["bytes"]].view(np.dtype(t["dtype"])).reshape(t["dims"])
            shape = np.array(t["shape"], dtype=np.uint64)
            tensors.append(IndexedTensor(t["name"], gguf.GGMLQuantizationType(t["type"]), shape, data))
        return GGUFIndex(index["fields"], tensors)
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or not one this code wrote: read the file
        return None
