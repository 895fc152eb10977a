"""A worker host's probes (runtime/parallel/follower_health.py): /health at once, /ready once it has compiled,
404 naming the leader for anything else; a real HTTP server on 127.0.0.1."""

import socket
import threading

import httpx

from capstan.runtime.parallel.follower_health import serve_probes


def test_worker_probes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = threading.Event()
    server = serve_probes("127.0.0.1", port, ready)
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{url}/ready", timeout=5).status_code == 503
        ready.set()
        assert httpx.get(f"{url}/ready", timeout=5).status_code == 200
        other = httpx.get(f"{url}/v1/models", timeout=5)
        assert other.status_code == 404 and "leader" in other.text
    finally:
        server.shutdown()
        server.server_close()
