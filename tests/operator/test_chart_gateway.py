"""The chart's gateway, rendered by `helm template` (no cluster): on by default with the RBAC its discovery and
demand signal need, its URL handed to the operator for status.url; off leaves no trace."""
from __future__ import annotations

from helm_chart import needs_helm, template

pytestmark = needs_helm


def named(docs: list[dict], kind: str, name: str = "capstan-gateway") -> list[dict]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]


def operator_env(docs: list[dict]) -> dict[str, str]:
    (deployment,) = named(docs, "Deployment", "capstan")
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_on_by_default_with_service_rbac_and_status_url():
    docs = template()
    (deployment,) = named(docs, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["capstan", "gateway"] and "--routing=prefix" in container["args"]
    (service,) = named(docs, "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    (role,) = named(docs, "ClusterRole")
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"list", "patch"} <= rules[("serving.capstan.dev", "inferenceservices")]
    assert "list" in rules[("discovery.k8s.io", "endpointslices")]
    assert operator_env(docs)["CAPSTAN_GATEWAY_URL"] == "http://capstan-gateway.capstan-system.svc.cluster.local/v1"


def test_namespaced_roles_follow_watch_namespaces():
    docs = template("--set", "watchNamespaces={team-a,team-b}")
    assert sorted(r["metadata"]["namespace"] for r in named(docs, "Role")) == ["team-a", "team-b"]
    args = named(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_off():
    docs = template("--set", "gateway.enabled=false")
    assert not [d for d in docs if "gateway" in d["metadata"]["name"]]
    assert "CAPSTAN_GATEWAY_URL" not in operator_env(docs)
