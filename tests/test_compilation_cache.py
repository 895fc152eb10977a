"""The compilation cache's folder and the image's baked programs: copied in only for a CPU with the same features,
never over a program the cache has, whole or not at all."""

from __future__ import annotations

import os

from capstan.runtime import compilation_cache
from capstan.runtime.compilation_cache import cpu_fingerprint, persist_compilations, seed_from_image


def test_the_fingerprint_names_the_machine_and_hashes_its_cpu_features():
    fingerprint = cpu_fingerprint()
    machine, digest = fingerprint.rsplit("-", 1)
    assert machine == os.uname().machine and len(digest) == 16
    assert cpu_fingerprint() == fingerprint


def test_programs_baked_for_this_cpu_are_copied_once_and_others_never(tmp_path, monkeypatch):
    baked, cache = tmp_path / "baked", tmp_path / "cache"
    (baked / cpu_fingerprint()).mkdir(parents=True)
    (baked / "x86_64-0000000000000000").mkdir()  # another CPU's
    (baked / cpu_fingerprint() / "jit_step-abc-cache").write_bytes(b"program")
    (baked / cpu_fingerprint() / ".lockfile").write_bytes(b"")
    (baked / "x86_64-0000000000000000" / "jit_other-cache").write_bytes(b"other")
    (baked / "gguf").mkdir()  # the default model's GGUF index, the same for every CPU
    (baked / "gguf" / "0123.json").write_text("{}")
    cache.mkdir()
    (cache / "jit_kept-cache").write_bytes(b"kept")
    monkeypatch.setenv(compilation_cache.BAKED_PROGRAMS, str(baked))
    monkeypatch.setattr(compilation_cache, "GGUF_INDEXES", tmp_path / "indexes")
    assert seed_from_image(cache) == 1
    assert sorted(p.name for p in cache.iterdir()) == ["jit_kept-cache", "jit_step-abc-cache"]
    assert [p.name for p in (tmp_path / "indexes").iterdir()] == ["0123.json"]
    (cache / "jit_step-abc-cache").write_bytes(b"newer")  # the cache's own copy wins
    assert seed_from_image(cache) == 0 and (cache / "jit_step-abc-cache").read_bytes() == b"newer"
    monkeypatch.setenv(compilation_cache.BAKED_PROGRAMS, str(tmp_path / "absent"))
    assert seed_from_image(cache) == 0


def test_the_cache_is_chosen_by_the_environment_and_keeps_every_program(tmp_path, monkeypatch):
    monkeypatch.setenv(compilation_cache.CACHE_DIR, str(tmp_path / "xla"))
    monkeypatch.delenv(compilation_cache.MIN_COMPILE_SECONDS, raising=False)
    monkeypatch.delenv(compilation_cache.BAKED_PROGRAMS, raising=False)
    monkeypatch.delitem(__import__("sys").modules, "jax", raising=False)  # as `capstan serve` before its cores start
    assert persist_compilations() == tmp_path / "xla" and (tmp_path / "xla").is_dir()
    assert os.environ[compilation_cache.MIN_COMPILE_SECONDS] == "0"


PROGRAM = """
import sys
from capstan.runtime.compilation_cache import persist_compilations
persist_compilations()
import jax, jax.numpy as jnp
print(jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(jnp.ones((8, 8))).sum())
"""


def test_programs_compiled_under_one_folder_are_found_under_another(tmp_path):
    """An image bakes programs under its own folder and a pod reads them under another: JAX's default put the
    folder's path (XLA:GPU's autotune cache inside it) into every key, and a copied program was never found."""
    import shutil
    import subprocess
    import sys

    def run(folder):
        env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
        env.update({compilation_cache.CACHE_DIR: str(folder), "JAX_PLATFORMS": "cpu"})
        subprocess.run([sys.executable, "-c", PROGRAM], env=env, check=True, capture_output=True, timeout=120)
        return sorted(p.name for p in folder.iterdir() if p.name.endswith("-cache"))

    baked = run(tmp_path / "bake")
    assert baked
    shutil.copytree(tmp_path / "bake", tmp_path / "pod")
    assert run(tmp_path / "pod") == baked  # every program found: nothing new was compiled and written
