"""The checked-in CRDs are exactly what operator/api.py generates, in crds/ and in the chart."""

from pathlib import Path

import pytest
import yaml

from capstan.operator import api
from capstan.operator.crd import CRD_FOLDERS, crd_files, inference_service_crd

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("folder", CRD_FOLDERS, ids=lambda f: str(f.relative_to(REPO)))
def test_checked_in_crds_match_the_models(folder):
    generated = crd_files()
    on_disk = {p.name: p.read_text() for p in folder.glob("*.yaml")}
    assert on_disk == generated, f"{folder} drifted from operator/api.py: run `python3 -m capstan.operator.crd`"


def test_chart_crds_are_identical_to_crds_folder():
    top, chart = (REPO / "crds"), (REPO / "charts" / "capstan" / "crds")
    assert sorted(p.name for p in top.glob("*.yaml")) == sorted(p.name for p in chart.glob("*.yaml"))
    for path in top.glob("*.yaml"):
        assert (chart / path.name).read_bytes() == path.read_bytes(), path.name


def test_crd_has_subresources_columns_and_a_short_name_that_is_not_kserves():
    version = inference_service_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert "status" in version["subresources"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Model", "Ready", "Desired", "URL", "Age"]
    assert "isvc" not in inference_service_crd()["spec"]["names"]["shortNames"]


def _walk(schema, path="spec"):
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


def test_schema_is_structural():
    """No $ref, anyOf, nulls or additionalProperties: false, which the API server refuses."""
    schema = inference_service_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    text = yaml.safe_dump(schema)
    for forbidden in ("$ref", "anyOf", "type: 'null'", "additionalProperties: false", "title:"):
        assert forbidden not in text
    for path, node in _walk(schema["properties"]["spec"]):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"


def test_model_uri_pattern_admits_the_documented_schemes_only():
    good = [
        "hf://Qwen/Qwen3-0.6B",
        "hf://meta-llama/Llama-3.1-8B@main",
        "hf://org/name@0123abc",
        "pvc://models/llama/3.1",
        "pvc://models",
        "gs://bucket/path/to/model",
        "s3://my.bucket/llama",
    ]
    bad = ["Qwen/Qwen3-0.6B", "hf://justname", "http://example.com/model", "pvc://Bad_Claim/x", "hf://org/na me"]
    for uri in good:
        api.ModelSpec(uri=uri)
    for uri in bad:
        with pytest.raises(ValueError):
            api.ModelSpec(uri=uri)


def test_every_spec_field_is_documented():
    spec = inference_service_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    reference = (REPO / "docs" / "inferenceservice.md").read_text()
    for path, node in _walk(spec):
        if path == "spec" or "properties" in node or path.endswith("[]"):
            continue
        field = path.removeprefix("spec.")
        documented = [field[:i] for i in range(len(field), 0, -1) if i == len(field) or field[i] == "."]
        assert any(f"`{p}`" in reference for p in documented), f"{field} is missing from docs/inferenceservice.md"
