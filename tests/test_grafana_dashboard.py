"""docs/grafana-dashboard.json charts only series the server exports (runtime/server/metric_names.py), and
filters on the labels the chart's PodMonitor puts on them."""

import json
import re
from pathlib import Path

from capstan.runtime.server import metric_names

DASHBOARD = Path(__file__).parents[1] / "docs" / "grafana-dashboard.json"
SUFFIXES = ("_bucket", "_total", "_sum", "_count")  # Prometheus's series of counters and histograms


def expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs + [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_every_series_is_exported():
    # The serving pods' series; the gateway's and the picker's (GATEWAY_*, PICKER_*) come from their own pods, which
    # the PodMonitor does not select.
    exported = {
        v
        for k, v in vars(metric_names).items()
        if k.isupper() and k != "PREFIX" and not k.startswith(("GATEWAY_", "PICKER_"))
    }
    used = set()
    for expr in expressions(json.loads(DASHBOARD.read_text())):
        for name in re.findall(r"\bcapstan_\w+", expr):
            base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s) and name[: -len(s)] in exported), name)
            assert base in exported, f"{name} in {expr!r} is not in metric_names.py"
            used.add(base)
    assert used == exported, f"metrics without a panel: {sorted(exported - used)}"


def test_panels_filter_on_the_pod_monitor_labels():
    dashboard = json.loads(DASHBOARD.read_text())
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            assert 'inference_service=~"$inference_service"' in t["expr"] and 'pod=~"$pod"' in t["expr"], p["title"]
    chart = (Path(__file__).parents[1] / "charts/capstan/templates/podmonitor.yaml").read_text()
    assert "targetLabel: inference_service" in chart
