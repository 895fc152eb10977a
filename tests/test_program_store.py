"""Serve's step and decode-scan programs, kept whole (engine/program_store.py): a second start loads every one without
tracing (the first request's before /ready, the rest in the background thread) and gives the same tokens as the
start that compiled them; a program read from JAX's own cache is never kept (XLA:CPU writes a broken copy of it,
without its kernels), whichever thread read it; a damaged file is removed and its program compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capstan.runtime.engine.program_store import PREFIX, ProgramStore

START = """
import json, logging, sys
from capstan.runtime.config import DEFAULT_MODEL
from capstan.runtime.engine.llm import LLM
from capstan.runtime.sampling.sampling_params import SamplingParams
logging.basicConfig(level=logging.WARNING)
llm = LLM(str(DEFAULT_MODEL), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
engine = llm.engine
engine.start_warmup()
warming = engine.warming
first = warming.loaded  # before /ready; the thread loads the rest
requests = [
    ("The capital of France is", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    ("Hello", SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.3, seed=3,
                             ignore_eos=True)),
]
outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
assert warming.join(300)
print(json.dumps({"first": first, "stored": warming.loaded, "scans": len(engine.multi_step.stored),
                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def start(cache) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)  # empty at first: the first start compiles every program
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_start_loads_every_program_whole_and_gives_the_same_tokens(tmp_path):
    first = start(tmp_path)
    kept = sorted(p for p in tmp_path.iterdir() if p.name.startswith(PREFIX))
    # every step and scan program (the grammar pipeline's are not kept); the multi-step scans among them
    assert first["stored"] == 0 and len(kept) >= 4
    second = start(tmp_path)
    assert second["first"] == 2 and second["stored"] == len(kept) and second["scans"] >= 1
    assert second["tokens"] == first["tokens"]

    kept[0].write_bytes(b"not a program")  # damaged: removed with a warning, and the program compiled instead
    third = start(tmp_path)
    assert third["stored"] == len(kept) - 1 and third["tokens"] == first["tokens"]
    # JAX's cache answered that compilation, and XLA's copy of a program it read back is not kept
    assert sorted(p for p in tmp_path.iterdir() if p.name.startswith(PREFIX)) == kept[1:]


@pytest.fixture
def every_compilation_cached():
    """JAX's cache keeps even a program that compiles in milliseconds (its default keeps those over a second)."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="XLA:CPU's serialisation")
def test_only_a_program_xla_compiled_in_this_process_is_kept(tmp_path, every_compilation_cached):
    assert jax.config.jax_compilation_cache_dir, "tests/conftest.py sets JAX's cache"
    salt = float(np.random.default_rng().integers(1 << 30))  # a program no earlier run put in JAX's cache
    x = jnp.ones((8, 8), jnp.float32)

    def program():  # a new function each time: JAX's in-memory cache misses, its persistent cache may not
        return jax.jit(lambda x: jnp.tanh(x @ x.T + salt))

    fresh = program().lower(x).compile()
    read_back = program().lower(x).compile()  # JAX's cache answers: XLA:CPU holds it without its kernels
    store = ProgramStore(tmp_path, "float32")
    store.save("read back", (x,), read_back)
    assert not list(tmp_path.iterdir())
    store.save("fresh", (x,), fresh)
    loaded = store.load("fresh", (x,))
    assert loaded is not None and np.array_equal(loaded(x), fresh(x))
