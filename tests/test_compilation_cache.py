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
    cache.mkdir()
    (cache / "jit_kept-cache").write_bytes(b"kept")
    monkeypatch.setenv(compilation_cache.BAKED_PROGRAMS, str(baked))
    assert seed_from_image(cache) == 1
    assert sorted(p.name for p in cache.iterdir()) == ["jit_kept-cache", "jit_step-abc-cache"]
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
