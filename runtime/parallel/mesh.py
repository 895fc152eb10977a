"""The model axis of the device mesh, as traced code sees it: the mesh a step runs under is set by the engine
(jax.set_mesh), so layers ask for it here instead of carrying it through every call."""

from __future__ import annotations

import os

import jax
from jax.sharding import PartitionSpec as P

MODEL_AXIS = "model"  # tensor parallelism: heads, MLP columns, vocabulary and KV heads split along it


def model_parallel_size() -> int:
    """Devices along the model axis of the mesh in context; 1 without tensor parallelism."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[MODEL_AXIS]


def replicated(x: jax.Array) -> jax.Array:
    """x gathered onto every device of the mesh in context (a no-op without tensor parallelism)."""
    if model_parallel_size() == 1:
        return x
    return jax.lax.with_sharding_constraint(x, P())


def sequence_parallel(tokens: int) -> bool:
    """Whether a step of `tokens` tokens keeps its residual stream split by token between the layers' matmuls
    (Megatron's sequence parallelism, CAPSTAN_TP_SEQUENCE_PARALLEL_TOKENS: the fewest tokens split; 0, the
    default, never): each all-reduce becomes a reduce-scatter before the norms and residual adds, which then run on
    a device's share of the tokens, and an all-gather before the next matmul."""
    least = int(os.environ.get("CAPSTAN_TP_SEQUENCE_PARALLEL_TOKENS", "0") or 0)
    size = model_parallel_size()
    return size > 1 and least > 0 and tokens >= least and tokens % size == 0


def by_token(x: jax.Array, axis: int, split: bool) -> jax.Array:
    """x split along `axis` (its tokens) over the model axis when `split`, else whole on every device."""
    spec: list[str | None] = [None] * x.ndim
    if split:
        spec[axis] = MODEL_AXIS
    return jax.lax.with_sharding_constraint(x, P(*spec))
