"""side_copy: copies from pinned host memory into device buffers outside XLA's queue (on a CPU device, memmoves;
on an NVIDIA GPU a CUDA stream of our own, checked by benchmarks/copy_overlap.py on the GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.kv import side_copy


def test_a_copy_lands_the_host_bytes_in_the_device_buffer():
    device = jax.devices()[0]
    assert side_copy.available(device)
    on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    rows = [np.arange(i, i + 4096, dtype=np.float32).reshape(64, 64) for i in range(3)]
    host = [jax.device_put(r, on_host) for r in rows]
    buffers = [jnp.zeros((64, 64), jnp.float32) + 0 for _ in rows]
    jax.block_until_ready([*host, *buffers])
    landing = side_copy.SideCopies([device]).copy(list(zip(host, buffers, strict=True)))
    landing.wait()
    assert landing.done()
    for r, b in zip(rows, buffers, strict=True):
        np.testing.assert_array_equal(np.asarray(b), r)


def test_a_buffer_of_another_size_is_refused():
    device = jax.devices()[0]
    host = jax.device_put(np.ones(8, np.float32), jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
    with pytest.raises(ValueError, match="bytes into a buffer of"):
        side_copy.SideCopies([device]).copy([(host, jnp.zeros(4, jnp.float32) + 0)])
