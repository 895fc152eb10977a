"""Restore: pages a step copies back from the host tier itself, layer by layer (CAPSTAN_KV_OFFLOAD_LOAD_WAY=layered).

A `device_put` to the device waits for the programs queued before it (benchmarks/copy_overlap.py), so a step that
admits restored turns otherwise waits for all their copies and then computes. Copies a program makes from pinned
host memory run on a stream of their own beside its kernels (H200, benchmarks/copy_in_program.py: 32 matmul layers
of 51.7 ms, each reading its own 32 MiB host array, took 58.2 ms against 72 in series), but only from whole host
arrays: a slice of one is read by kernels on the compute stream. So the tier keeps each chunk as one host array per
layer (host_offload.gather_chunk_layers), and the step's model writes layer l's restored pages into layer l's cache
just before running it (DecoderModel.__call__): layer l's pages cross while the layers before it compute."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..arrays import HostLeaf
from .cache import KVCache


class Restore(eqx.Module):
    pages: HostLeaf  # [chunks, chunk_pages] i32: each row's device page (past the pool: padding, dropped)
    rows: HostLeaf  # [chunks, chunk_pages] i32: which row of its chunk each page takes
    layers: tuple  # [layer][chunk]: that chunk's pages of that layer in host memory, [chunk_pages, K/V, ...]
    page_axis: int = eqx.field(static=True)

    @property
    def num_chunks(self) -> int:
        return self.pages.shape[0]

    def write_layer(self, layer: int, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s cache arrays with its restored pages written (each chunk copied whole, then its rows)."""
        data = jnp.concatenate(
            [jax.device_put(c, jax.memory.Space.Device)[r] for c, r in zip(self.layers[layer], self.rows, strict=True)]
        )
        at = (slice(None),) * self.page_axis + (self.pages.reshape(-1),)
        k = k.at[at].set(jnp.moveaxis(data[:, 0], 0, self.page_axis), mode="drop")
        if v.size:  # (a TPU-layout cache keeps V inside K: one array a layer)
            v = v.at[at].set(jnp.moveaxis(data[:, 1], 0, self.page_axis), mode="drop")
        return k, v


def _write_restore(kv: KVCache, restore: Restore) -> KVCache:
    k, v = list(kv.k), list(kv.v)
    for i in range(len(k)):
        k[i], v[i] = restore.write_layer(i, k[i], v[i])
    return KVCache(tuple(k), tuple(v), kv.page_size)


# Every layer's restored pages at once, for a step whose program takes none (the cache is donated: written in place)
write_restore = jax.jit(_write_restore, donate_argnums=(0,))
