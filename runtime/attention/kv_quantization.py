"""FP8 K/V pages (`--kv-cache-dtype fp8`): what a stored value is, for every writer and reader of the cache.

A page holds float8_e4m3fn values with one static scale per layer for K and one for V (vLLM's default scheme:
1.0, or the checkpoint's `self_attn.k_scale` / `v_scale`). The stored value is x / scale clipped to e4m3's +-448
(a cast past it would give NaN: e4m3fn has no infinity). Readers upcast right after the load and fold the scales
into the float32 products: K's into the softmax scale, V's into the output, so no per-element multiply remains.
Other cache dtypes (bfloat16, the model's own) store the value cast, with no scale."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
# --kv-cache-dtype values (vLLM's names); "auto": the model's dtype
KV_CACHE_DTYPES = {"bfloat16": jnp.bfloat16, "fp8": FP8, "fp8_e4m3": FP8}


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(FP8)


def cache_dtype(name: str, model_dtype):
    """The stored dtype of --kv-cache-dtype `name` for a model computing in model_dtype."""
    return jnp.dtype(model_dtype) if name == "auto" else jnp.dtype(KV_CACHE_DTYPES[name])


def store(values: jax.Array, dtype, scale: float = 1.0) -> jax.Array:
    """values as a cache of `dtype` holds them: FP8 divided by scale and clipped to its range, others cast."""
    if not is_fp8(dtype):
        return values.astype(dtype)
    x = values.astype(jnp.float32)
    if scale != 1.0:
        x = x * (1.0 / scale)
    return jnp.minimum(jnp.maximum(x, -FP8_MAX), FP8_MAX).astype(dtype)  # plain max/min: Pallas lowers them


def load(stored: jax.Array, dtype) -> jax.Array:
    """A loaded page upcast to the compute dtype (exact for FP8 into bfloat16 or float32); the scale is the
    caller's to fold in. FP8 into float32 goes through bfloat16 (exact: e4m3's values are bfloat16 values), the
    conversion Triton has wherever it has FP8."""
    if is_fp8(stored.dtype) and jnp.dtype(dtype) == jnp.float32:
        stored = stored.astype(jnp.bfloat16)
    return stored.astype(dtype)


def scales_for(cache_dtype_, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales that apply to a cache: its layer's for FP8, none (1.0) for caches that store values as they are."""
    return (k_scale, v_scale) if is_fp8(cache_dtype_) else (1.0, 1.0)
