"""KVCache: the device-side page pool, one K and one V array for all layers."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..attention import PAGES_INTERLEAVED, kv_layout
from ..kernels.tpu_ragged_attention import allocate_pages
from ..parallel.mesh import MODEL_AXIS


class KVCache(eqx.Module):
    """k, v: one [kv_heads, num_pages, page_size, head_dim] array per layer (each head's pages contiguous, as
    kernels read them; separate arrays so that a layer's update and read never copy the others). On TPUs whose
    kernel takes the model's shapes (attention.kv_layout): k holds each layer's [num_pages, page_size,
    2 * kv_heads, head_dim] with K and V interleaved by head, as JAX's TPU kernel reads it, and v empty arrays."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_size: int = eqx.field(static=True)

    @staticmethod
    def allocate(
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        sharding=None,
        layout: str | None = None,
    ) -> KVCache:
        """sharding: where the pages live (tensor parallelism splits them by KV head); None: the default device.
        layout: None chooses by backend."""
        if layout is None:
            shards = 1 if sharding is None else sharding.mesh.shape.get(MODEL_AXIS, 1)
            layout = kv_layout(jax.default_backend(), kv_heads // shards, head_dim, dtype)
        if layout == PAGES_INTERLEAVED:
            empty = None if sharding is None else jax.sharding.NamedSharding(sharding.mesh, P())
            return KVCache(
                tuple(
                    allocate_pages(num_pages, page_size, kv_heads, head_dim, dtype, sharding) for _ in range(num_layers)
                ),
                tuple(jnp.zeros((0,), dtype, device=empty) for _ in range(num_layers)),
                page_size,
            )
        shape = (kv_heads, num_pages, page_size, head_dim)
        return KVCache(
            tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)),
            tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)),
            page_size,
        )

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * page_size * kv_heads * head_dim * jnp.dtype(dtype).itemsize
