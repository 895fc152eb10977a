"""Paged attention: the plain-XLA reference defines correctness; faster kernels are chosen by backend."""
import jax

from .metadata import INVALID_SLOT, AttentionMetadata
from .reference import paged_attention, write_kv


def attend(q, k_cache, v_cache, meta: AttentionMetadata, *, k_new, v_new, scale: float, window: int | None,
           softcap):
    """Chooses the kernel at trace time, for layers without a window or soft-capping on GPUs: decode batches take
    the Pallas decode kernel; steps whose chunks all start their sequences take flash attention over the step's
    own K/V (decided at run time); everything else (CPU, sliding-window layers, cached context) the reference."""
    reference = lambda: paged_attention(q, k_cache, v_cache, meta, scale=scale, window=window,  # noqa: E731
                                        softcap=softcap)
    if window is not None or softcap or jax.default_backend() != "gpu":
        return reference()
    if meta.decode:
        from .gpu_decode import decode_attention

        return decode_attention(q, k_cache, v_cache, meta, scale=scale)
    from . import gpu_prefill

    if meta.fresh is None or not gpu_prefill.fits(q.shape[0]):
        return reference()
    return jax.lax.cond(meta.fresh, lambda: gpu_prefill.fresh_prefill_attention(q, k_new, v_new, meta, scale=scale),
                        reference)


__all__ = ["INVALID_SLOT", "AttentionMetadata", "attend", "paged_attention", "write_kv"]
