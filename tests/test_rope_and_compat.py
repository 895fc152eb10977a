"""RoPE scaling rules and the JAX/haliax compatibility shim."""

import math
import types

import jax
import numpy as np

from capstan.runtime import compat
from capstan.runtime.models.config import RopeConfig
from capstan.runtime.models.rope import inverse_frequencies


def test_llama3_scaling_keeps_short_wavelengths_and_slows_long_ones():
    base = inverse_frequencies(RopeConfig(theta=500000.0), 64)
    scaled = inverse_frequencies(
        RopeConfig(
            theta=500000.0,
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
        64,
    )
    wavelen = 2 * math.pi / base
    short, long = wavelen < 256 / 4, wavelen > 256 / 1
    assert short.any() and long.any()
    np.testing.assert_array_equal(scaled[short], base[short])
    np.testing.assert_allclose(scaled[long], base[long] / 8.0, rtol=1e-6)
    medium = ~short & ~long
    assert np.all((scaled[medium] < base[medium]) & (scaled[medium] > base[medium] / 8.0))


def test_linear_scaling_divides_every_frequency():
    base = inverse_frequencies(RopeConfig(theta=1e6), 32)
    linear = inverse_frequencies(RopeConfig(theta=1e6, rope_type="linear", factor=8.0), 32)
    np.testing.assert_allclose(linear, base / 8.0, rtol=1e-6)


def test_is_constant_dim_shim_present_and_correct():
    compat.install_jax_core_is_constant_dim()
    fn = jax.core.is_constant_dim
    assert fn(3) and fn(np.int64(4)) and not fn(object())


def test_shim_installs_when_jax_lacks_it():
    core_without = types.SimpleNamespace()  # what jax.core looks like on JAX >= 0.11
    assert compat.install_jax_core_is_constant_dim(core_without) is True
    assert core_without.is_constant_dim(7) and not core_without.is_constant_dim("n")
