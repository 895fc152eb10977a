"""--api-server-count auto (runtime/server/frontend_count.py): one frontend on a CPU-only host, one per 4 CPUs (1-4)
beside a GPU or TPU; Kubernetes CPU quantities read as the operator reads a pod's request."""

import pytest

from capstan.runtime.server.frontend_count import cpu_quantity, frontends_for, host_cpus, host_has_accelerator


@pytest.mark.parametrize(
    "cpus, accelerator, count",
    [(2, False, 1), (64, False, 1), (2, True, 1), (7.9, True, 1), (8, True, 2), (16, True, 4), (128, True, 4)],
)
def test_frontends_for_the_host(cpus, accelerator, count):
    assert frontends_for(cpus, accelerator) == count


def test_cpu_quantities():
    assert [cpu_quantity(q) for q in ("500m", "4", 2.5, "16000m")] == [0.5, 4.0, 2.5, 16.0]
    assert [cpu_quantity(q) for q in ("four", "nan", "inf", "-1", "")] == [None] * 5


def test_this_host(monkeypatch):
    assert 1 <= host_cpus() <= 4096
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # JAX told to use the CPU: no accelerator, whatever is plugged in
    assert host_has_accelerator() is False
