"""What the TPU image shows without a TPU: jax finds libtpu's PJRT plugin, loads it, and compiles for a TPU.

Run by the image's own Python: image/build.py runs it in the TPU image's root filesystem before packing it, and
tests/test_image_tpu.py in the packed image. No TPU is needed: jax compiles ahead of time against a TPU topology
that the plugin describes (jax.experimental.topologies), as it does for a slice it is not running on. What it
cannot show: that the plugin finds and drives real chips (/dev/accel*, GKE's TPU_* variables), nor any speed.

    /opt/capstan/bin/python tpu_check.py     # one JSON line of findings; exits 1 naming what failed
"""

from __future__ import annotations

import json
import os
import sys
import time

TOPOLOGY = "v5e:2x4"  # docs/examples/tpu-v5e.yaml's slice: one host of 8 v5e chips
DEVICE_KIND = "TPU v5 lite"  # what jax calls a v5e chip
# Off a TPU VM, libtpu logs errors looking for its slice's hosts; GKE's TPU device plugin sets these on a node.
OFF_TPU_ENV = {"TPU_ACCELERATOR_TYPE": "v5litepod-8", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0"}


class CheckFailed(Exception):
    pass


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def plugin_library() -> dict:
    """jax's TPU backend discovery names libtpu's shared library, and it is there."""
    import jax

    try:
        import libtpu
    except ImportError as error:
        raise CheckFailed(f"libtpu is not installed: {error}") from None
    from jax._src.cloud_tpu_init import get_tpu_library_path  # what jax's TPU backend factory loads

    path = get_tpu_library_path()
    if path is None:
        raise CheckFailed("jax finds no TPU plugin library")
    require(path == libtpu.get_library_path(), f"jax loads {path}, not libtpu's {libtpu.get_library_path()}")
    require(os.path.isfile(path), f"{path} is missing")
    return {
        "jax": jax.__version__,
        "libtpu": libtpu.__version__,
        "library": path,
        "library_mib": round(os.path.getsize(path) / 2**20),
    }


def topology_devices():
    """The plugin loaded and initialized: it describes a v5e slice's chips (compile-only devices)."""
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(TOPOLOGY, "tpu").devices
    require(len(devices) == 8, f"{TOPOLOGY} has {len(devices)} devices, not 8")
    require(devices[0].device_kind == DEVICE_KIND, f"{TOPOLOGY}'s chips are {devices[0].device_kind!r}")
    return devices


def compile_sharded_matmul(devices) -> dict:
    """XLA's TPU compiler, from the plugin: a matmul sharded over the slice's 8 chips, with TPU tiled layouts."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(devices, ("tensor",))
    rows = NamedSharding(mesh, PartitionSpec("tensor"))
    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec()))
    hlo = jax.jit(lambda x, w: x @ w).lower(x, w).compile().as_text() or ""
    require("num_partitions=8" in hlo, "the matmul was not compiled for 8 chips")
    require(":T(" in hlo, "the compiled HLO has no TPU tiled layouts")
    return {"matmul_partitions": 8}


def compile_ragged_attention(devices) -> dict:
    """JAX's ragged paged-attention Pallas kernel (the runtime's TPU attention) lowered through Mosaic for one v5e
    chip, on the arguments Capstan's kernel_arguments gives it for a decode step."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
    from jax.sharding import Mesh, SingleDeviceSharding

    from capstan.runtime.attention.metadata import AttentionMetadata
    from capstan.runtime.kernels.tpu_ragged_attention import kernel_arguments

    rows, kv_heads, group, head_dim, pages, page_size, pages_per_row = 8, 2, 4, 128, 64, 16, 8
    chip = SingleDeviceSharding(devices[0])

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=chip)

    def decode(q, kv_pages, positions, slots, block_tables, seq_lens):
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            token_seq=jnp.arange(rows, dtype=jnp.int32),
            block_tables=block_tables,
            seq_lens=seq_lens,
            decode=True,
        )
        kv_lens, page_indices, cu_q_lens, num_seqs = kernel_arguments(meta)
        return ragged_paged_attention(
            q.reshape(rows, kv_heads * group, head_dim),
            kv_pages,
            kv_lens,
            page_indices,
            cu_q_lens,
            num_seqs,
            sm_scale=head_dim**-0.5,
            # the tuned block sizes are looked up on the local device, which here is the CPU
            num_kv_pages_per_block=4,
            num_queries_per_block=8,
        )

    # Pallas reads the chip's generation from the mesh in context (off a TPU the default device is the CPU).
    with jax.set_mesh(Mesh([devices[0]], ("chip",))):
        lowered = jax.jit(decode).lower(
            spec((rows, kv_heads, group, head_dim), jnp.bfloat16),
            spec((pages, page_size, 2 * kv_heads, head_dim), jnp.bfloat16),
            spec((rows,), jnp.int32),
            spec((rows,), jnp.int32),
            spec((rows, pages_per_row), jnp.int32),
            spec((rows,), jnp.int32),
        )
        hlo = lowered.compile().as_text() or ""
    require("tpu_custom_call" in hlo, "the attention kernel did not compile to a Mosaic TPU custom call")
    return {"ragged_attention": "tpu_custom_call"}


def main() -> int:
    for name, value in OFF_TPU_ENV.items():
        os.environ.setdefault(name, value)
    started = time.monotonic()
    findings: dict = {"topology": TOPOLOGY}
    try:
        findings |= plugin_library()
        devices = topology_devices()
        findings["device_kind"] = devices[0].device_kind
        findings |= compile_sharded_matmul(devices)
        findings |= compile_ragged_attention(devices)
    except CheckFailed as failure:
        print(f"TPU image check failed: {failure}", file=sys.stderr)
        return 1
    findings["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(findings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
