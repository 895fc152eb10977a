"""KVCache: the device-side page pool, one K and one V array for all layers."""
from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp


class KVCache(eqx.Module):
    """k, v: one [kv_heads, num_pages, page_size, head_dim] array per layer (each head's pages contiguous, as
    kernels read them; separate arrays so that a layer's update and read never copy the others)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_size: int = eqx.field(static=True)

    @staticmethod
    def allocate(num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype,
                 sharding=None) -> "KVCache":
        """sharding: where the pages live (tensor parallelism splits them by KV head); None: the default device."""
        shape = (kv_heads, num_pages, page_size, head_dim)
        return KVCache(tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)),
                       tuple(jnp.zeros(shape, dtype, device=sharding) for _ in range(num_layers)), page_size)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * page_size * kv_heads * head_dim * jnp.dtype(dtype).itemsize
