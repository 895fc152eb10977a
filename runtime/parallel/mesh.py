"""The model axis of the device mesh, as traced code sees it: the mesh a step runs under is set by the engine
(jax.set_mesh), so layers ask for it here instead of carrying it through every call."""

from __future__ import annotations

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
