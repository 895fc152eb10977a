"""`capstan serve` as a process: keys from a file and the environment, 429 when the queue is full, spans over
OTLP, prompts kept out of the log, and SIGTERM draining in-flight streams before a clean exit (run last)."""

from __future__ import annotations

import http.server
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from servers import MODEL, ServeProcess

pytestmark = pytest.mark.slow
SECRET_PROMPT = "my-private-prompt-text"
HEADERS = {"Authorization": "Bearer file-key"}


class OTLPReceiver(http.server.ThreadingHTTPServer):
    """Collects the spans POSTed to /v1/traces, as an OpenTelemetry collector would receive them."""

    def __init__(self):
        self.spans: list = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        receiver.spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def otlp():
    receiver = OTLPReceiver()
    yield receiver
    receiver.shutdown()


@pytest.fixture(scope="module")
def proc(otlp, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("secret") / "api-keys"
    key_file.write_text("file-key\n")
    env = {
        "CAPSTAN_API_KEY": "env-key",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp.server_port}",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    # one sequence at a time, one decode step per dispatch: a 300-token stream lasts long enough to queue behind
    with ServeProcess(
        "--max-num-seqs=1",
        "--max-waiting=1",
        "--drain-timeout=120",
        "--decode-steps=1",
        f"--api-key-file={key_file}",
        env=env,
    ) as p:
        yield p


def stream(url: str, result: dict, max_tokens: int = 60) -> None:
    """One streaming completion; `result` gets its status, events and finish reason."""
    body = {"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=HEADERS, timeout=300) as r:
        result["status"], result["headers"] = r.status_code, r.headers
        result["events"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_for(condition, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def text_of(events: list[str]) -> tuple[str, str | None]:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]


def test_keys_from_file_and_env(proc):
    assert httpx.get(f"{proc.url}/v1/models").status_code == 401
    for key in ("file-key", "env-key"):
        assert httpx.get(f"{proc.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_queue_full_is_429_with_retry_after(proc):
    results = [{} for _ in range(6)]
    threads = [threading.Thread(target=stream, args=(proc.url, r, 200)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    statuses = sorted(r["status"] for r in results)
    assert 200 in statuses and 429 in statuses, statuses
    refused = next(r for r in results if r["status"] == 429)
    assert int(refused["headers"]["retry-after"]) >= 1


def test_spans_are_exported_over_otlp(proc, otlp):
    stream(proc.url, {}, max_tokens=7)

    def attributes(span) -> dict:
        return {a.key: a.value for a in span.attributes}

    def ours():
        return [
            s
            for s in otlp.spans
            if attributes(s).get("gen_ai.request.max_tokens", None) is not None
            and attributes(s)["gen_ai.request.max_tokens"].int_value == 7
        ]

    wait_for(ours, what="the request's span")
    span = ours()[0]
    a = attributes(span)
    assert span.name == f"text_completion {MODEL}"
    assert a["gen_ai.operation.name"].string_value == "text_completion"
    assert a["gen_ai.request.model"].string_value == MODEL
    assert a["gen_ai.usage.input_tokens"].int_value > 0 and a["gen_ai.usage.output_tokens"].int_value == 7
    assert [v.string_value for v in a["gen_ai.response.finish_reasons"].array_value.values] == ["length"]


def test_sigterm_drains_in_flight_streams_then_exits_0(proc):
    first, second = {}, {}
    threads = [threading.Thread(target=stream, args=(proc.url, r, 300)) for r in (first, second)]
    for t in threads:
        t.start()
    # One stream running, the other queued behind it (max-num-seqs=1): both are in flight. Once in CI (2026-12-02,
    # beside the cluster tests) no queued request showed within 60 s: wait longer, and say what was seen if not.
    try:
        wait_for(lambda: gauge(proc.url, "capstan_requests_waiting") == 1, timeout=150, what="a queued request")
    except AssertionError as e:
        seen = {name: gauge(proc.url, f"capstan_requests_{name}") for name in ("running", "waiting")}
        streams = [(r.get("status"), len(r.get("events", []))) for r in (first, second)]  # events: once it ended
        raise AssertionError(f"{e}; now {seen}, streams {streams}; log: {''.join(proc.output)[-3000:]}") from e
    kept_alive = socket.create_connection(("127.0.0.1", proc.port), timeout=10)
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: capstan\r\n\r\n")
    assert kept_alive.recv(4096).startswith(b"HTTP/1.1 200")
    proc.signal(signal.SIGTERM)
    # An idle kept-alive connection is closed at once, so its client's next request goes to another pod.
    while kept_alive.recv(4096):  # until the server closes it; a timeout fails the test
        pass
    kept_alive.close()
    wait_for(lambda: httpx.get(f"{proc.url}/ready").status_code == 503, timeout=10, what="readiness to fail")
    refused = httpx.get(f"{proc.url}/v1/models", headers=HEADERS)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert httpx.get(f"{proc.url}/health").status_code == 200
    for t in threads:
        t.join(timeout=300)
    for result in (first, second):
        assert result["status"] == 200 and result["events"][-1] == "[DONE]"
        assert text_of(result["events"])[1] == "length"
    assert proc.wait(timeout=60) == 0
    log = "".join(proc.output)
    assert "compil" in log and "drained" in log
    assert SECRET_PROMPT not in log
