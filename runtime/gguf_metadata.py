"""A GGUF file's key/value metadata, read without its tensors and without JAX (the HTTP frontend reads it).

gguf's GGUFReader parses every field and tensor header up front (seconds for a 49k-token vocabulary); this walks
the key/value section once, keeps the keys asked for and skips the rest. Layout: llama.cpp's docs/gguf.md."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

# Where models/gguf_index.py keeps GGUF files' parsed metadata: beside the compiled programs (config.COMPILATION_CACHE)
GGUF_INDEXES = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "capstan" / "gguf"

MAGIC = b"GGUF"
# value type -> struct code of one scalar (8: string, 9: array are read apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


class GGUFMetadataError(ValueError):
    """The file is not GGUF, or its metadata is cut short."""


def read_metadata(path: str | Path, keys: set[str] | None = None) -> dict[str, object]:
    """{key: value} for the keys asked (all when None); arrays of strings and numbers come back as lists."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != MAGIC:
            raise GGUFMetadataError(f"{path}: not a GGUF file (no GGUF magic)")
        # a big-endian file's version reads as a huge little-endian number
        order = "<" if struct.unpack_from("<I", data, 4)[0] < 0x10000 else ">"
        try:
            return _Walker(data, order, 8).items(keys)
        except struct.error as e:
            raise GGUFMetadataError(f"{path}: GGUF metadata cut short: {e}") from None


class _Walker:
    def __init__(self, data, order: str, offset: int):
        self.data, self.order, self.offset = data, order, offset

    def _unpack(self, code: str):
        value = struct.unpack_from(self.order + code, self.data, self.offset)[0]
        self.offset += struct.calcsize(code)
        return value

    def _string(self) -> str:
        size = self._unpack("Q")
        text = bytes(self.data[self.offset : self.offset + size])
        if len(text) != size:
            raise struct.error("a string runs past the end of the file")
        self.offset += size
        return text.decode("utf-8", errors="replace")

    def _value(self, kind: int, keep: bool):
        if kind == STRING:
            return self._string() if keep else self._skip_string()
        if kind == ARRAY:
            item, count = self._unpack("I"), self._unpack("Q")
            if item in SCALARS and not keep:  # fixed-size items: one jump
                self.offset += count * struct.calcsize(SCALARS[item])
                return None
            values = [self._value(item, keep) for _ in range(count)]
            return values if keep else None
        if kind not in SCALARS:
            raise struct.error(f"unknown value type {kind}")
        return self._unpack(SCALARS[kind])

    def _skip_string(self) -> None:
        self.offset += 8 + struct.unpack_from(self.order + "Q", self.data, self.offset)[0]

    def items(self, keys: set[str] | None) -> dict[str, object]:
        self._unpack("Q")  # tensor count
        found = {}
        for _ in range(self._unpack("Q")):
            key = self._string()
            keep = keys is None or key in keys
            value = self._value(self._unpack("I"), keep)
            if keep:
                found[key] = value
        return found
