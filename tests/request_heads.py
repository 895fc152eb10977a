"""Raw HTTP/1.1 request heads over a socket, as no HTTP client library would send them (a header line of megabytes,
hundreds of fields, a head that never ends), and what the server answers; for capstan serve's and the gateway's
tests of their bounds (runtime/server/header_limits.py). Every read has a timeout."""

from __future__ import annotations

import socket
from pathlib import Path

from capstan.runtime.limits import HEADER_TIMEOUT_S, MAX_HEADER_BYTES, MAX_HEADER_COUNT


def answer(port: int, head: bytes, timeout: float = 30) -> tuple[int, bytes]:
    """(status, whole answer) for `head` sent on a new connection to 127.0.0.1:port; status 0 when none came."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(head)
            while chunk := s.recv(65536):
                data += chunk
        except (BrokenPipeError, ConnectionResetError):  # closed before all of it went: the answer may have come
            pass
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
    return status, data


def head(path: str = "/health", *headers: tuple[str, str]) -> bytes:
    return (
        f"GET {path} HTTP/1.1\r\nhost: x\r\n".encode()
        + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers)
        + b"connection: close\r\n\r\n"
    )


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def check_request_heads_are_bounded(port: int, pids: list[int]) -> None:
    """A head of the largest size and count passes; past either it is a 431 in OpenAI's error shape naming the
    limit, on several connections (several frontends share a port); a 16 MiB header line never grows the server."""
    assert answer(port, head("/health", ("x-big", "a" * (MAX_HEADER_BYTES - 200))))[0] == 200
    fields = [(f"x-{i}", "1") for i in range(MAX_HEADER_COUNT - 2)]  # with host and connection
    assert answer(port, head("/health", *fields))[0] == 200
    for _ in range(4):
        status, data = answer(port, head("/health", ("x-big", "a" * (MAX_HEADER_BYTES + 1000))))
        assert status == 431 and f"exceed {MAX_HEADER_BYTES} bytes".encode() in data, data[:300]
        assert b'"code":"request_header_fields_too_large"' in data.replace(b" ", b""), data[:300]
        status, data = answer(port, head("/health", *fields, ("x-one-more", "1")))
        assert status == 431 and f"more than {MAX_HEADER_COUNT} header fields".encode() in data, data[:300]
    before = sum(rss_bytes(p) for p in pids)
    for _ in range(2):
        status, _ = answer(port, b"GET /health HTTP/1.1\r\nx-huge: " + b"a" * (16 << 20))
        assert status in (431, 0)  # the answer may be lost to a reset: the server closed long before 16 MiB went
    grown = sum(rss_bytes(p) for p in pids) - before
    assert grown < 8 << 20, f"the servers grew {grown / 2**20:.1f} MiB on two 16 MiB header lines"


def check_half_sent_heads_are_closed(port: int, url_health: str) -> None:
    """Connections that never finish their head get a 408 and are closed after HEADER_TIMEOUT_S, while /health
    answers at once throughout."""
    import time

    import httpx

    sockets = []
    try:
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", port), timeout=HEADER_TIMEOUT_S + 20)
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")
            sockets.append(s)
        started = time.monotonic()
        assert httpx.get(url_health, timeout=5).status_code == 200
        for s in sockets:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 408 "), data[:200]
        waited = time.monotonic() - started
        assert waited < HEADER_TIMEOUT_S + 15, f"half-sent heads stayed open {waited:.0f} s"
    finally:
        for s in sockets:
            s.close()
