"""The chart and the Gateway API Inference Extension, rendered by `helm template` (no cluster): the vendored
InferencePool CRD only with inferencePool.installCRD, unchanged and kept on uninstall; and operator RBAC that
covers everything spec.inferencePool renders, including the rights it grants the picker."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helm_chart import CHART, needs_helm, template

from capstan.operator import api, render, render_pool

pytestmark = needs_helm
REPO = Path(__file__).resolve().parents[2]
VENDORED = "inference.networking.k8s.io_inferencepools.yaml"
OWNER = {"metadata": {"name": "qwen", "namespace": "serving", "uid": "1234"}}


def crds(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "CustomResourceDefinition"]


def test_the_crd_is_not_installed_unless_asked():
    assert not crds(template())
    assert not [p for p in (CHART / "crds").glob("*.yaml") if "inference.networking" in p.name]  # always installed


def test_asked_the_chart_installs_the_vendored_crd_unchanged_and_keeps_it():
    (crd,) = crds(template("--set", "inferencePool.installCRD=true"))
    vendored = yaml.safe_load((CHART / "files" / VENDORED).read_text())
    assert crd["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert crd["spec"] == vendored["spec"]
    assert [v["name"] for v in crd["spec"]["versions"]] == ["v1"]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # its deletion would delete every pool
    assert crd["metadata"]["annotations"]["inference.networking.k8s.io/bundle-version"] == "v1.6.0"


def test_the_vendored_copies_are_identical_and_name_their_source_and_license():
    chart_copy = (CHART / "files" / VENDORED).read_bytes()
    assert (REPO / "crds" / "gateway-api-inference-extension" / VENDORED).read_bytes() == chart_copy
    header = chart_copy.decode().split("apiVersion:")[0]
    assert "kubernetes-sigs/gateway-api-inference-extension v1.6.0" in header and "Apache License" in header
    for folder in (CHART / "files", REPO / "crds" / "gateway-api-inference-extension"):
        assert "Apache License" in (folder / "LICENSE-gateway-api-inference-extension").read_text()


def rules(role: dict) -> dict[tuple[str, str], set[str]]:
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    return granted


def operator_roles(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("ClusterRole", "Role") and d["metadata"]["name"] == "capstan"]


@pytest.mark.parametrize("flags", [(), ("--set", "watchNamespaces={team-a}")], ids=["cluster-wide", "namespaced"])
def test_operator_rbac_covers_what_it_renders_and_grants(flags):
    spec = api.InferenceServiceSpec.model_validate({"model": {"uri": "hf://org/m"}, "inferencePool": {}})
    objects = render_pool.render_all(OWNER, spec, render.render_all(OWNER, spec, 1))
    (role,) = operator_roles(template(*flags))
    granted = rules(role)
    for obj in objects:
        group = obj["apiVersion"].rpartition("/")[0]
        plural = obj["kind"].lower() + "s"
        # server-side apply creates or patches; pruning reads by name and deletes
        assert {"get", "create", "patch", "delete"} <= granted[(group, plural)], obj["kind"]
    # RBAC lets the operator grant only rights it holds itself (no escalate verb)
    (picker_role,) = [o for o in objects if o["kind"] == "Role"]
    for (group, resource), verbs in rules(picker_role).items():
        assert verbs <= granted[(group, resource)], (group, resource)
