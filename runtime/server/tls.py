"""TLS for Capstan's HTTP servers (`capstan gateway`, `capstan serve`): vLLM's `--ssl-keyfile`/`--ssl-certfile`, and
the certificate reloaded when its files change (a cert-manager Secret renewed in place), without a restart.

uvicorn builds one `ssl.SSLContext` at start; loading a new chain into that same context makes every later
handshake present the new certificate, while open connections keep theirs. A half-written or mismatched pair is
refused and the certificate in force stays, until the files are whole again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from pathlib import Path
from typing import TypedDict

import uvicorn

log = logging.getLogger("capstan.server")
RELOAD_SECONDS = 5.0  # how soon a renewed certificate is served once its files have changed


def _check_pair(keyfile: str, certfile: str) -> None:
    """Load the pair into a scratch context: a ValueError names the flag and the file at fault."""
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not Path(path).is_file():  # ssl's FileNotFoundError names no file (its filename is None)
            raise ValueError(f"{flag} {path}: no such file")
    scratch = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        scratch.load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as error:
        raise ValueError(
            f"--ssl-certfile {certfile} and --ssl-keyfile {keyfile}: not a PEM certificate chain and "
            f"its private key ({error})"
        ) from None


class UvicornTLS(TypedDict, total=False):
    """uvicorn.Config's TLS keywords (none: plain HTTP)."""

    ssl_keyfile: str
    ssl_certfile: str


class ServingCertificate:
    """A key and certificate file pair served by uvicorn and reloaded when their content changes."""

    def __init__(self, keyfile: str, certfile: str):
        self.keyfile, self.certfile = keyfile, certfile
        _check_pair(keyfile, certfile)
        self._fingerprint = self._read_fingerprint()
        self.context: ssl.SSLContext | None = None

    def uvicorn_options(self) -> UvicornTLS:
        """Keyword arguments for `uvicorn.Config`."""
        return UvicornTLS(ssl_keyfile=self.keyfile, ssl_certfile=self.certfile)

    def attach(self, config: uvicorn.Config) -> None:
        """Take the context uvicorn built from `uvicorn_options()` (loading the config now), to reload into it."""
        if not config.loaded:
            config.load()
        assert config.ssl is not None, "uvicorn.Config without uvicorn_options(): no TLS context to reload"
        self.context = config.ssl

    def _read_fingerprint(self) -> bytes:
        return hashlib.sha256(Path(self.certfile).read_bytes() + b"\0" + Path(self.keyfile).read_bytes()).digest()

    def reload(self) -> bool:
        """True when a changed, whole pair is now served; a broken one is logged and the old one stays."""
        try:
            fingerprint = self._read_fingerprint()
            if fingerprint == self._fingerprint:
                return False
            _check_pair(self.keyfile, self.certfile)
        except (OSError, ValueError) as error:
            log.error("TLS certificate unchanged: %s", error)
            return False
        assert self.context is not None, "attach() comes before the first reload"
        self.context.load_cert_chain(self.certfile, self.keyfile)
        self._fingerprint = fingerprint
        log.info("TLS certificate reloaded from %s", self.certfile)
        return True

    async def watch(self, interval: float = RELOAD_SECONDS) -> None:
        while True:
            await asyncio.sleep(interval)
            await asyncio.to_thread(self.reload)


def serving_certificate(keyfile: str | None, certfile: str | None) -> ServingCertificate | None:
    """From the two flags: both or neither."""
    if bool(keyfile) != bool(certfile):
        missing = "--ssl-certfile" if keyfile else "--ssl-keyfile"
        raise ValueError(
            f"{missing} is required with {'--ssl-keyfile' if keyfile else '--ssl-certfile'}: TLS needs "
            "the certificate (chain) and its private key"
        )
    return ServingCertificate(keyfile, certfile) if keyfile and certfile else None


def add_tls_flags(parser) -> None:
    parser.add_argument("--ssl-keyfile", default=None, help="PEM private key: serve HTTPS (with --ssl-certfile)")
    parser.add_argument(
        "--ssl-certfile",
        default=None,
        help="PEM certificate chain for --ssl-keyfile; both are read again when they change",
    )
