"""Client keys of the gateway: who may call, which models (and LoRA adapters, which clients name in `model` as
with vLLM) each key may use, and its budgets. They come from files, one or more mounted Kubernetes Secrets, each
holding YAML:

    clients:
      - name: team-a                 # the label in metrics and logs; never the key
        key: sk-team-a-...           # or keySha256: the hex SHA-256 of the key
        models: [qwen3, "qwen3-lora-*"]   # names or fnmatch patterns; "*": every model
        requestsPerMinute: 600       # optional, each: no limit when absent
        tokensPerMinute: 200000      # prompt + completion tokens
        maxConcurrentRequests: 16

Only SHA-256 digests are kept in memory; the files are read again when their content changes (a rotated Secret
takes effect within a poll interval, without a restart), and a file that no longer parses keeps the keys in force.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

log = logging.getLogger("capstan.gateway")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")  # a Prometheus label value we can show
MAX_KEY_CHARS = 512
LIMIT_FIELDS = {
    "requestsPerMinute": "requests_per_minute",
    "tokensPerMinute": "tokens_per_minute",
    "maxConcurrentRequests": "max_concurrent",
}


@dataclass(frozen=True)
class ClientKey:
    name: str
    digest: bytes  # SHA-256 of the key: the key itself is not kept
    models: tuple[str, ...]
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def may_use(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_clients(text: str, source: str) -> list[ClientKey]:
    """One file's clients; a ValueError names the file, the entry and the field at fault."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{source}: not YAML ({error})") from None
    if not isinstance(document, dict) or not isinstance(document.get("clients"), list):
        raise ValueError(f"{source}: expected a mapping with a list `clients`")
    keys = []
    for index, entry in enumerate(document["clients"]):
        where = f"{source}: clients[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a mapping")
        unknown = set(entry) - {"name", "key", "keySha256", "models", *LIMIT_FIELDS}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ValueError(f"{where}.name: required, 1-63 letters, digits, '_', '.', '-'")
        keys.append(
            ClientKey(
                name,
                _digest(entry, f"{where}"),
                _models(entry, where),
                **{attr: _limit(entry, field_, where) for field_, attr in LIMIT_FIELDS.items()},
            )
        )
    return keys


def _digest(entry: dict, where: str) -> bytes:
    if ("key" in entry) == ("keySha256" in entry):
        raise ValueError(f"{where}: exactly one of `key` or `keySha256` is required")
    if "key" in entry:
        key = entry["key"]
        if not isinstance(key, str) or not 16 <= len(key) <= MAX_KEY_CHARS:
            raise ValueError(f"{where}.key: a string of 16 to {MAX_KEY_CHARS} characters")
        return digest_of(key)
    hex_digest = entry["keySha256"]
    if not isinstance(hex_digest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", hex_digest):
        raise ValueError(f"{where}.keySha256: 64 hex digits (sha256sum of the key)")
    return bytes.fromhex(hex_digest)


def _models(entry: dict, where: str) -> tuple[str, ...]:
    models = entry.get("models")
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise ValueError(f'{where}.models: a non-empty list of model names or patterns ("*": every model)')
    return tuple(models)


def _limit(entry: dict, field_: str, where: str) -> int | None:
    value = entry.get(field_)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**12:
        raise ValueError(f"{where}.{field_}: an integer from 1 to 10^12 (leave it out for no limit)")
    return value


def _files(path: Path) -> list[Path]:
    """A file, or every file of a folder (a mounted Secret: its dot-entries are the kubelet's bookkeeping)."""
    if path.is_dir():
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())
    return [path]


class KeyRing:
    """The client keys in force, looked up by digest; `reload()` reads the files again when their content changed."""

    def __init__(self, paths: list[str]):
        self.paths = [Path(p) for p in paths]
        self._fingerprint = b""
        self._by_digest: dict[bytes, ClientKey] = {}
        self.reload(strict=True)

    @property
    def clients(self) -> list[ClientKey]:
        return list(self._by_digest.values())

    def reload(self, strict: bool = False) -> bool:
        """True when the keys changed. strict (at start): a bad file raises; later it is logged and skipped."""
        try:
            texts = [(str(f), f.read_text()) for p in self.paths for f in _files(p)]
        except OSError as error:
            if strict:
                raise ValueError(f"--client-keys: cannot read {error.filename}: {error.strerror}") from None
            log.error("client keys unchanged: cannot read %s (%s)", error.filename, error.strerror)
            return False
        fingerprint = hashlib.sha256(repr(texts).encode()).digest()
        if fingerprint == self._fingerprint:
            return False
        try:
            keys = [key for source, text in texts for key in parse_clients(text, source)]
            by_digest = _index(keys)
        except ValueError as error:
            if strict:
                raise
            log.error("client keys unchanged: %s", error)
            self._fingerprint = fingerprint  # the same bad content is reported once
            return False
        self._fingerprint, self._by_digest = fingerprint, by_digest
        log.info("client keys loaded: %d from %s", len(keys), ", ".join(os.fspath(p) for p in self.paths))
        return True

    def authenticate(self, authorization: str | None) -> ClientKey | None:
        """The client of an `Authorization: Bearer KEY` header, or None."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip() or len(key) > MAX_KEY_CHARS:
            return None
        digest = digest_of(key.strip())
        found = self._by_digest.get(digest)
        # A dict lookup by digest reveals nothing about the key's characters; compare anyway, in constant time.
        return found if found is not None and hmac.compare_digest(found.digest, digest) else None


def _index(keys: list[ClientKey]) -> dict[bytes, ClientKey]:
    by_digest: dict[bytes, ClientKey] = {}
    names = set()
    for key in keys:
        if key.digest in by_digest:
            raise ValueError(f"clients {by_digest[key.digest].name!r} and {key.name!r} have the same key")
        if key.name in names:
            raise ValueError(f"client name {key.name!r} appears twice: names label metrics and must be unique")
        by_digest[key.digest] = key
        names.add(key.name)
    return by_digest
