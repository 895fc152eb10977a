"""The accelerators an InferenceService may ask for, and what each means to the scheduler.

GPU nodes are selected by the product label that NVIDIA's GPU feature discovery puts on every GPU
node; TPU nodes by the labels GKE puts on TPU node pools.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    resource: str | None  # extended resource the device plugin advertises
    node_labels: dict[str, str]  # what a node offering it is labelled with
    taint_key: str | None  # accelerator node pools are tainted so that other pods stay off them
    host_chips: tuple[int, ...] = ()  # TPU: the chips one host (VM) of a slice can have


GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"


def _gpu(product: str) -> Accelerator:
    return Accelerator("nvidia.com/gpu", {GPU_PRODUCT_LABEL: product}, "nvidia.com/gpu")


GKE_NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"  # a multi-host TPU slice is one node pool


def _tpu(accelerator: str, host_chips: tuple[int, ...]) -> Accelerator:
    return Accelerator("google.com/tpu", {TPU_ACCELERATOR_LABEL: accelerator}, "google.com/tpu", host_chips)


ACCELERATORS: dict[str, Accelerator] = {
    "cpu": Accelerator(None, {}, None),
    "nvidia-t4": _gpu("Tesla-T4"),
    "nvidia-l4": _gpu("NVIDIA-L4"),
    "nvidia-a10g": _gpu("NVIDIA-A10G"),
    "nvidia-a100-40gb": _gpu("NVIDIA-A100-SXM4-40GB"),
    "nvidia-a100-80gb": _gpu("NVIDIA-A100-SXM4-80GB"),
    "nvidia-h100": _gpu("NVIDIA-H100-80GB-HBM3"),
    "nvidia-h200": _gpu("NVIDIA-H200"),
    "nvidia-b200": _gpu("NVIDIA-B200"),
    # GKE's machine types: v5e/v6e hosts have 1, 4 or 8 chips (multi-host slices 4), v5p hosts 4.
    "tpu-v5e": _tpu("tpu-v5-lite-podslice", (1, 4, 8)),
    "tpu-v5p": _tpu("tpu-v5p-slice", (4,)),
    "tpu-v6e": _tpu("tpu-v6e-slice", (1, 4, 8)),
}


def is_tpu(accelerator_type: str) -> bool:
    return accelerator_type.startswith("tpu-")


def topology_chips(topology: str) -> int:
    """'2x2x4' -> 16: the chips of a TPU slice."""
    chips = 1
    for dimension in topology.split("x"):
        chips *= int(dimension)
    return chips
