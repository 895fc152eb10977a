"""Paged attention: the plain-XLA reference defines correctness; faster kernels are chosen by backend."""
import jax

from .metadata import INVALID_SLOT, AttentionMetadata
from .reference import paged_attention, write_kv


def attend(q, k_cache, v_cache, meta: AttentionMetadata, *, scale: float, window: int | None, softcap):
    """Chooses the kernel at trace time: GPU decode batches of layers without a window or soft-capping take the
    Pallas kernel; everything else (prefill chunks, CPU, sliding-window layers) the reference."""
    if meta.decode and window is None and not softcap and jax.default_backend() == "gpu":
        from .gpu_decode import decode_attention

        return decode_attention(q, k_cache, v_cache, meta, scale=scale)
    return paged_attention(q, k_cache, v_cache, meta, scale=scale, window=window, softcap=softcap)


__all__ = ["INVALID_SLOT", "AttentionMetadata", "attend", "paged_attention", "write_kv"]
