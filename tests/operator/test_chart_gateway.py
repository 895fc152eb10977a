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


def test_client_keys_upstream_keys_and_tls_are_mounted_from_secrets():
    docs = template(
        "--set",
        "gateway.clientKeys.secrets={team-keys,batch-keys}",
        "--set",
        "gateway.replicaCount=2",
        "--set",
        "gateway.upstreamKeys.secretName=replica-keys",
        "--set",
        "gateway.tls.secretName=gw-tls",
    )
    pod = named(docs, "Deployment")[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert "--client-keys=/etc/capstan/client-keys/team-keys" in args
    assert "--client-keys=/etc/capstan/client-keys/batch-keys" in args
    assert "--budget-shares=2" in args and "--budget-window=60" in args  # each replica enforces half of a budget
    assert "--upstream-keys=/etc/capstan/upstream-keys/upstream.yaml" in args
    assert "--ssl-keyfile=/etc/capstan/tls/tls.key" in args and "--ssl-certfile=/etc/capstan/tls/tls.crt" in args
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {
        "client-keys-team-keys": "team-keys",
        "client-keys-batch-keys": "batch-keys",
        "upstream-keys": "replica-keys",
        "tls": "gw-tls",
    }
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert all("subPath" not in m and m.get("readOnly") for name, m in mounts.items() if name != "tmp")  # rotations
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert operator_env(docs)["CAPSTAN_GATEWAY_URL"].startswith("https://capstan-gateway.capstan-system.svc")


def test_open_gateway_by_default_and_upstream_keys_alone_are_refused():
    args = named(template(), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith(("--client-keys", "--upstream-keys", "--ssl-"))]
    import subprocess

    from helm_chart import CHART, HELM

    result = subprocess.run(
        [str(HELM), "template", "capstan", str(CHART), "--set", "gateway.upstreamKeys.secretName=replica-keys"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "gateway.upstreamKeys needs gateway.clientKeys.secrets" in result.stderr
