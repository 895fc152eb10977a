"""`capstan gateway`'s request heads are bounded as capstan serve's are (issue 69, item 3): a header line past 64 KiB
or more than 100 fields is a 431 in OpenAI's error shape, a 16 MiB header line does not grow the process, and
connections that never finish their head get a 408 and are closed while /health answers at once. No replica is
needed: the head is refused before any route (the one static replica named is a closed port)."""

from __future__ import annotations

from processes import free_port, start_gateway
from request_heads import check_half_sent_heads_are_closed, check_request_heads_are_bounded


def test_request_heads_are_bounded():
    gateway = start_gateway([f"http://127.0.0.1:{free_port()}"])
    try:
        gateway.wait_ready(timeout=60)
        check_request_heads_are_bounded(gateway.port, [gateway.process.pid])
        check_half_sent_heads_are_closed(gateway.port, f"{gateway.url}/health")
    finally:
        gateway.kill()
