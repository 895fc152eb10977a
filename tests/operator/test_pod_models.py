"""pod_models.py: which adapters a pod reports in its /v1/models (the cards with a parent), over real HTTP."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from capstan.operator.pod_models import fetch_pod_adapters, loaded_adapters

LISTING = {
    "object": "list",
    "data": [
        {"id": "qwen3", "object": "model", "root": "/mnt/models/qwen3", "parent": None},
        {"id": "sql", "object": "model", "root": "hf://org/sql", "parent": "qwen3"},
        {"id": "chat", "object": "model", "root": "/mnt/adapters/a/chat", "parent": "qwen3"},
    ],
}


def test_adapters_are_the_cards_with_a_parent():
    assert loaded_adapters(LISTING) == ["chat", "sql"]
    assert loaded_adapters({"data": [{"id": "base", "object": "model"}]}) == []
    assert loaded_adapters({"data": ["junk", {"parent": "x"}]}) == []


def test_fetch_over_http_reports_silent_pods_as_none():
    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(LISTING).encode() if self.path == "/v1/models" else b"{}"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        reported = fetch_pod_adapters({"pod-a": f"127.0.0.1:{server.server_port}", "pod-b": "127.0.0.1:1"})
    finally:
        server.shutdown()
    assert reported == {"pod-a": ["chat", "sql"], "pod-b": None}
