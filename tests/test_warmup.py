"""Serve's warm-up (engine/warmup.py): the first request's program compiled, the rest in a background thread; requests
served meanwhile by compiled stand-ins give the same tokens as after a full warm-up; nothing compiles on the request
path once the thread is done; a program that fails to compile leaves its stand-in serving; the thread waits (a
bounded time) while requests are in flight."""

import contextlib
import functools
import logging
import threading
import time

import jax
import jax.numpy as jnp
import pytest
from compile_watch import compiles_in_this_thread

from capstan.runtime.config import DEFAULT_MODEL
from capstan.runtime.engine.llm import LLM
from capstan.runtime.engine.warmup import BackgroundWarmup, Program
from capstan.runtime.sampling.sampling_params import SamplingParams

# buckets 16, 32, 64 tokens; row buckets 1, 4: a dozen programs
FLAGS = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
LONG = list(range(100, 200))  # 100 tokens: several chunks of the first bucket (16) while 64 still compiles
REQUESTS = [
    (LONG, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
    ("The capital of France is", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
    ("Once upon a time", SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)),
    ("Hello", SamplingParams(max_tokens=24, temperature=0.7, repetition_penalty=1.3, seed=3, ignore_eos=True)),
    ("Two choices", SamplingParams(max_tokens=16, temperature=1.0, n=2, seed=11, ignore_eos=True)),
]


def tokens(llm: LLM, requests=REQUESTS) -> list[list[list[int]]]:
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def serving():
    """An engine as `capstan serve` warms it: serving right after its first program. Made first: programs another
    engine of this process compiled would be found compiled already."""
    llm = LLM(str(DEFAULT_MODEL), **FLAGS)
    llm.engine.start_warmup()
    yield llm
    llm.engine.warming is None or llm.engine.warming.join(300)


@pytest.fixture(scope="module")
def during(serving) -> list[list[list[int]]]:
    """The tokens of requests served while the programs compile, by the stand-ins."""
    warming = serving.engine.warming
    assert warming is not None and warming.compiling() > 0
    with compiles_in_this_thread() as compiles:
        out = tokens(serving)
    assert compiles == [], "a request waited for a compilation"
    assert warming.compiling() > 0, "the background finished first: these requests met no stand-in"
    serving.engine.pool.check_all_free()
    return out


@pytest.fixture(scope="module")
def reference(during) -> list[list[list[int]]]:
    """The tokens after the full warm-up (every program compiled before the first request)."""
    return tokens(LLM(str(DEFAULT_MODEL), **FLAGS, warmup=True))


def test_requests_while_programs_compile_give_the_full_warmups_tokens(during, reference):
    assert during == reference


def test_once_the_background_is_done_no_request_compiles_and_the_limits_go(serving, reference):
    warming = serving.engine.warming
    assert warming is None or warming.join(300)
    with compiles_in_this_thread() as compiles:
        assert tokens(serving) == reference
    assert compiles == []
    assert serving.engine.warming is None  # the first step after the end lifts the token limit
    assert serving.engine.scheduler.max_num_batched_tokens == 64
    assert serving.engine.stats().programs_compiling == 0


def test_a_program_that_fails_to_compile_leaves_a_stand_in_serving(reference, caplog):
    llm = LLM(str(DEFAULT_MODEL), **FLAGS)
    engine = llm.engine
    first, rest = engine._programs()

    def broken():
        raise RuntimeError("injected: this program cannot compile")

    rest = [Program(p.key, broken) if p.key == ("step", "model", 64, None) else p for p in rest]
    warming = BackgroundWarmup(engine._precision)
    warming.compile_now(first)
    engine.warming = warming
    with caplog.at_level(logging.ERROR, logger="capstan.engine"):
        warming.start(rest)
        assert warming.join(300)
    assert warming.failed() == 1 and not warming.compiled(("step", "model", 64, None))
    assert "compiling ('step', 'model', 64, None) failed" in caplog.text
    assert tokens(llm) == reference  # the 100-token prompt in chunks of 32, the largest compiled bucket
    assert engine.warming is warming and engine.scheduler.max_num_batched_tokens == 32
    engine.pool.check_all_free()


def _tiny_programs(n: int) -> list[Program]:
    """Real programs that compile in milliseconds (a sum and a scale per key)."""
    x = jnp.ones((4,), jnp.float32)

    def lower(scale: int) -> list:
        return [jax.jit(lambda v: (v * scale).sum()).lower(x)]

    return [Program(("tiny", i), functools.partial(lower, i + 2)) for i in range(n)]


def test_the_thread_waits_while_requests_are_in_flight_then_compiles():
    in_flight = threading.Event()
    in_flight.set()
    warming = BackgroundWarmup(contextlib.nullcontext, busy=in_flight.is_set, yield_s=300)
    warming.start(_tiny_programs(2))
    time.sleep(0.5)
    assert warming.compiling() == 2  # the answer under way keeps the cores
    in_flight.clear()
    assert warming.join(60)


def test_under_steady_load_the_thread_waits_only_so_long_before_each_program():
    warming = BackgroundWarmup(contextlib.nullcontext, busy=lambda: True, yield_s=0.2)
    warming.start(_tiny_programs(2))
    assert warming.join(60)
