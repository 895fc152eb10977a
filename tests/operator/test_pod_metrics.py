"""pod_metrics.py: the gauges the autoscaler reads, as the server's Prometheus registry exposes them."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from capstan.operator.pod_metrics import PodAddresses, fetch_loads, parse_load
from capstan.runtime.server import metric_names


def exposition(running, waiting, kv):
    registry = CollectorRegistry()
    Gauge(metric_names.REQUESTS_RUNNING, "running", registry=registry).set(running)
    Gauge(metric_names.REQUESTS_WAITING, "waiting", registry=registry).set(waiting)
    Gauge(metric_names.KV_CACHE_USAGE, "kv", registry=registry).set(kv)
    return generate_latest(registry)


def test_parse_load_reads_the_three_gauges():
    load = parse_load(exposition(3, 5, 0.25).decode())
    assert (load.running, load.waiting, load.kv_cache_usage) == (3, 5, 0.25)


def test_fetch_over_http_skips_pods_that_do_not_answer():
    body = exposition(2, 1, 0.5)

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        loads = fetch_loads([f"127.0.0.1:{server.server_port}", "127.0.0.1:1"])
    finally:
        server.shutdown()
    assert len(loads) == 1 and loads[0].running == 2


def test_pod_addresses():
    pods = [{"metadata": {"name": n}, "status": {"podIP": ip}} for n, ip in [("b", "10.0.0.2"), ("a", "10.0.0.1")]]
    assert PodAddresses().resolve(pods) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert PodAddresses(["127.0.0.1:9"]).resolve(pods) == ["127.0.0.1:9", "127.0.0.1:9"]
