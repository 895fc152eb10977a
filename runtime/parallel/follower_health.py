"""/health and /ready on a worker host (a follower of the leader's steps), which serves no API: the operator's
probes render the same for every host of a group, and a group is ready only when all its hosts are."""

from __future__ import annotations

import http.server
import threading


class _Probes(http.server.BaseHTTPRequestHandler):
    ready: threading.Event

    def do_GET(self):  # noqa: N802 - the http.server hook's name
        if self.path == "/health":
            code, body = 200, b"ok: following the leader's steps\n"
        elif self.path == "/ready":
            ok = self.ready.is_set()
            code, body = (200, b"ready\n") if ok else (503, b"loading or compiling\n")
        else:
            code, body = 404, b"a worker host serves only /health and /ready; the leader (process 0) serves the API\n"
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # probes every few seconds: not worth a log line each
        pass


def serve_probes(host: str, port: int, ready: threading.Event) -> http.server.ThreadingHTTPServer:
    """Answers the probes on a daemon thread until the process ends; /ready once `ready` is set."""
    handler = type("Probes", (_Probes,), {"ready": ready})
    server = http.server.ThreadingHTTPServer((host, port), handler)
    threading.Thread(target=server.serve_forever, name="worker-probes", daemon=True).start()
    return server
