"""Tensor parallelism on CPU devices: the golden checkpoints split over 2 and 4 devices give the greedy tokens of
one device, logprobs within 1e-4 of one device's and of transformers', and the same seeded samples.

XLA_FLAGS=--xla_force_host_platform_device_count must be set before JAX starts, and this pytest process has
started it with one device, so each check runs this file as a script in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from golden import GOLDEN, greedy_agreement_length, log_softmax, reference, reference_logits

TESTS = Path(__file__).parent
MAX_TOKENS = 10


def run_split(
    devices: int,
    cases: dict[str, int],
    gpu_kernels: bool = False,
    tpu_layout: bool = False,
    compiles: bool = False,
    made_split: bool = False,
    vocab_greedy: bool = False,
    halves: bool = False,
    queued: bool = False,
) -> dict:
    """Runs each case {name: tensor_parallel_size} on one device and split, in a process with `devices` CPUs;
    gpu_kernels: split only, through the GPU Pallas kernels interpreted on CPU; tpu_layout: split only, with the
    KV cache laid out as the TPU kernel reads it; halves: decode steps of 2 rows or more run as two halves of rows."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    if halves:
        env["CAPSTAN_DECODE_HALVES_MIN_ROWS"] = "2"
    flags = (
        ["gpu-kernels"] * gpu_kernels
        + ["tpu-layout"] * tpu_layout
        + ["compiles"] * compiles
        + ["made-split"] * made_split
        + ["vocab-greedy"] * vocab_greedy
        + ["halves"] * halves
        + ["queued"] * queued
    )
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(cases)] + flags,
        env=env,
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "devices, cases",
    [
        # llama-s11: GQA (2 KV heads) split one per device, untied LM head
        (2, {"llama-s11": 2}),
        # gemma3-s14: one KV head replicated 4x, sliding window, soft-capping; qwen2-s12: 2 KV heads replicated 2x, biases
        (4, {"gemma3-s14": 4, "qwen2-s12": 4}),
    ],
)
def test_split_model_matches_one_device_and_golden(devices, cases):
    got = run_split(devices, cases)
    for case, tp in cases.items():
        one, split = got[case]["1"], got[case][str(tp)]
        assert split["kv_sharding"] == "P('model',)" and split["devices"] == tp
        ref = reference(case)
        for i in range(len(ref["prompts"])):
            assert split["tokens"][i] == one["tokens"][i], f"{case} tp={tp} prompt {i}"
            np.testing.assert_allclose(split["logprobs"][i], one["logprobs"][i], atol=1e-4, err_msg=f"{case} {i}")
        assert_golden(case, split)
        assert split["plain_greedy"] == split["tokens"], f"{case}: greedy without logprobs differs under tp={tp}"
        assert split["sampled"] == one["sampled"], f"{case}: seeded sampling differs under tp={tp}"
        assert len(split["prompt_logprobs"]) == len(ref["prompts"][0]) - 1
        np.testing.assert_allclose(split["prompt_logprobs"], one["prompt_logprobs"], atol=1e-4)


def assert_golden(case: str, run: dict) -> None:
    ref = reference(case)
    for i, (prompt, cont) in enumerate(zip(ref["prompts"], ref["greedy_continuations"], strict=True)):
        owed = min(greedy_agreement_length(ref, i), MAX_TOKENS)
        assert run["tokens"][i][:owed] == cont[:owed], f"{case} prompt {i} vs transformers"
        expected = log_softmax(reference_logits(case, i))[
            np.arange(len(prompt) - 1, len(prompt) - 1 + owed), cont[:owed]
        ]
        np.testing.assert_allclose(run["logprobs"][i][:owed], expected, atol=1e-4, err_msg=f"{case} {i}")


@pytest.mark.slow
def test_gpu_kernels_run_per_shard():
    """The ragged and decode Pallas kernels (interpreted) inside attention's shard_map, one KV head per device."""
    split = run_split(2, {"llama-s11": 2}, gpu_kernels=True)["llama-s11"]["2"]
    assert split["kv_sharding"] == "P('model',)"
    assert_golden("llama-s11", split)


def test_decode_steps_in_two_halves_of_rows_give_the_same_tokens():
    """CAPSTAN_DECODE_HALVES_MIN_ROWS (issue 31's experiment: one half's all-reduces under the other half's work): each
    layer runs on the decode rows' two halves in turn, each half its own step of the fused decode kernel (the GPU's
    way, interpreted) over the shared pages; split over 2 devices, the tokens and logprobs are transformers'."""
    split = run_split(2, {"llama-s11": 2}, gpu_kernels=True, halves=True)["llama-s11"]["2"]
    assert split["halves_min_rows"] == 2 and split["decode_rows"] >= 4, split  # the halves path ran, on every row
    assert_golden("llama-s11", split)


def test_tpu_kv_layout_is_split_by_kv_head():
    """The TPU kernel's interleaved pages [pages, page_size, 2 * kv_heads, head_dim] split on their head axis: each
    device holds its heads' K and V side by side (the kernel itself does not run on CPU; see test_tpu_attention)."""
    split = run_split(2, {"llama-s11": 2}, tpu_layout=True)["llama-s11"]["2"]
    assert split["kv_sharding"] == "P(None, None, 'model')" and split["devices"] == 2
    assert_golden("llama-s11", split)


def test_a_warmed_split_engine_compiles_nothing_while_it_serves():
    """Warm-up compiles every program a run uses: the multi-step run's first dispatch and the ones queued after it
    once shared no program under a mesh (an unplaced zeros array against the last dispatch's replicated tokens), and
    the first run compiled the second in its middle (8B shape, TP=2 on two H100s: 8 s of a 10 s decode phase)."""
    got = run_split(2, {"llama-s11": 2}, compiles=True)["llama-s11"]
    assert got["dispatches"] >= 3, got  # a run's first dispatch and at least two queued behind it
    assert got["after_run"] == got["after_warmup"], got


def test_queued_steps_under_a_mesh_give_the_synchronous_tokens():
    """Asynchronous scheduling (the GPUs' default) under tensor parallelism: steps queued while the one before runs,
    their unread tokens (and penalties' histories) taken from that step's replicated samples, give the synchronous
    engine's tokens (seeded and greedy rows, penalized, all greedy), and compile nothing after warm-up (a `previous`
    placed apart from the samples would be a second program)."""
    got = run_split(2, {"llama-s11": 2}, queued=True)["llama-s11"]
    assert got["queued_steps"] >= 10, got
    assert got["same"] == [True, True, True], got
    assert got["after_run"] == got["after_warmup"], got


def _queued(case: str, tp: int) -> dict:
    import dataclasses

    from test_async_scheduling import results, workload

    from capstan.runtime.engine.llm import LLM
    from capstan.runtime.engine.multi_step import decode_steps_fn
    from capstan.runtime.engine.step import step_fn

    sizes = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=16, tensor_parallel_size=tp)
    sync = LLM(str(GOLDEN / case), async_scheduling=False, warmup=True, **sizes)
    queued = LLM(str(GOLDEN / case), async_scheduling=True, warmup=True, **sizes)
    steps, step_async = [], queued.engine._step_async

    def counted(*args):  # instruments the real method: how many steps went the queued way
        steps.append(1)
        return step_async(*args)

    queued.engine._step_async = counted  # type: ignore[method-assign]

    def programs() -> int:  # (_cache_size is not in jax's stubs)
        return decode_steps_fn._cache_size() + step_fn._cache_size()  # type: ignore[attr-defined]

    after_warmup, same = programs(), []
    for seed in (1, 5, 2):
        prompts, params = workload(seed)
        if seed == 5:
            params = [dataclasses.replace(p, repetition_penalty=1.5, frequency_penalty=0.7) for p in params]
        if seed == 2:  # all greedy: the plain argmax, picked from the vocabulary's shards
            params = [dataclasses.replace(p, temperature=0.0, top_p=1.0, top_k=0, logit_bias=None) for p in params]
        same.append(results(queued.generate(prompts, params)) == results(sync.generate(prompts, params)))
    queued.engine.pool.check_all_free()
    return {"queued_steps": len(steps), "same": same, "after_warmup": after_warmup, "after_run": programs()}


def test_random_weights_are_made_in_parts():
    """A benchmark's random model under tensor parallelism is made split as place_model splits it (the 70B shape
    fits no one GPU), with the values of the model made whole."""
    got = run_split(2, {"llama-s11": 2}, made_split=True)["llama-s11"]
    assert got["split"] == got["matrices"] > 0, got  # every projection and vocabulary table
    assert got["equal"], got


def test_sizes_the_model_cannot_split_are_refused_naming_the_flag():
    from capstan.runtime.models.config import ModelConfig
    from capstan.runtime.parallel.tensor_parallel import TensorParallelError, check_size

    cfg = ModelConfig.from_pretrained(GOLDEN / "llama-s11")  # 4 heads, 2 KV heads, intermediate 160
    check_size(cfg, 4, 8)  # KV heads replicated 2x
    for size, devices, words in [(3, 8, "num_attention_heads=4"), (8, 4, "exceeds the 4"), (0, 8, "at least 1")]:
        with pytest.raises(TensorParallelError, match=words) as e:
            check_size(cfg, size, devices)
        assert "--tensor-parallel-size" in str(e.value)
    six = ModelConfig.from_hf(
        {
            **json.loads((GOLDEN / "llama-s11" / "config.json").read_text()),
            "num_attention_heads": 12,
            "num_key_value_heads": 6,
            "head_dim": 16,
        }
    )
    with pytest.raises(TensorParallelError, match="num_key_value_heads=6 or be a multiple"):
        check_size(six, 4, 8)


def test_engine_refuses_more_devices_than_there_are():
    from capstan.runtime.engine.llm import LLM
    from capstan.runtime.parallel.tensor_parallel import TensorParallelError

    with pytest.raises(TensorParallelError, match=r"--tensor-parallel-size=2 exceeds the 1 cpu device"):
        LLM(str(GOLDEN / "llama-s11"), tensor_parallel_size=2, warmup=False)


def _generate(case: str, tp: int) -> dict:
    import capstan.runtime.engine.multi_step as multi_step
    from capstan.runtime.engine.llm import LLM
    from capstan.runtime.models import decoder
    from capstan.runtime.sampling.sampling_params import SamplingParams

    decode_rows, real = [0], multi_step.decode_steps_fn

    def counted(model, kv, inputs, active, *a, **k):  # the rows of each multi-step dispatch
        decode_rows.append(active.shape[0])
        return real(model, kv, inputs, active, *a, **k)

    multi_step.decode_steps_fn = counted  # type: ignore[assignment]  # the child process ends after its cases

    prompts = reference(case)["prompts"]
    llm = LLM(
        str(GOLDEN / case),
        max_model_len=256,
        # halves: the four greedy prompts alone in 4 rows (two in each half), prefilled in the first step so that
        # all of them decode in the multi-step dispatches; the seeded request waits for a free row
        max_num_seqs=4 if "halves" in sys.argv else 8,
        max_num_batched_tokens=256 if "halves" in sys.argv else 32,
        page_size=4,
        dtype="float32",
        tensor_parallel_size=tp,
        warmup=False,
        enable_prefix_caching=False,
    )  # the seeded request repeats prompt 0: its prompt logprobs are computed
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    seeded = SamplingParams(
        temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7, prompt_logprobs=0
    )
    outs = llm.generate(prompts + [prompts[0]], [greedy] * len(prompts) + [seeded])
    greedy_outs = [o.outputs[0] for o in outs[:-1]]
    # no logprobs asked: the decode scan's plain greedy program (split, it picks from the vocabulary shards)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    prompt_logprobs = outs[-1].prompt_logprobs
    assert prompt_logprobs is not None and all(o.logprobs is not None for o in greedy_outs)
    return {
        "devices": len({d for a in llm.engine.kv.k for d in a.sharding.device_set}),
        "kv_sharding": str(getattr(llm.engine.kv.k[0].sharding, "spec", None)),
        "tokens": [o.token_ids for o in greedy_outs],
        "logprobs": [[(o.logprobs or [])[k][t].logprob for k, t in enumerate(o.token_ids)] for o in greedy_outs],
        "plain_greedy": [o.outputs[0].token_ids for o in plain],
        "sampled": outs[-1].outputs[0].token_ids,
        "prompt_logprobs": [next(iter((p or {}).values())).logprob for p in prompt_logprobs[1:]],
        "halves_min_rows": decoder.HALVES_MIN_ROWS,
        "decode_rows": max(decode_rows),
    }


def _compiles(case: str, tp: int) -> dict:
    """The jitted steps' compiled programs after warm-up and after a greedy run long enough to queue dispatches."""
    import capstan.runtime.engine.multi_step as multi_step
    from capstan.runtime.engine.llm import LLM
    from capstan.runtime.engine.step import step_fn
    from capstan.runtime.sampling.sampling_params import SamplingParams

    llm = LLM(
        str(GOLDEN / case),
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        page_size=4,
        dtype="float32",
        tensor_parallel_size=tp,
        decode_steps=4,
        enable_prefix_caching=False,
        warmup=True,
    )

    def programs() -> int:  # jit's count of compiled programs (_cache_size is not in jax's stubs)
        return multi_step.decode_steps_fn._cache_size() + step_fn._cache_size()  # type: ignore[attr-defined]

    after_warmup, calls = programs(), []
    real = multi_step.decode_steps_fn

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    multi_step.decode_steps_fn = counted  # type: ignore[assignment]  # counts the dispatches, then restored
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm.generate(reference(case)["prompts"][:2], greedy)
    multi_step.decode_steps_fn = real
    return {"after_warmup": after_warmup, "after_run": programs(), "dispatches": len(calls)}


def _vocab_greedy(case: str, tp: int) -> dict:
    """Greedy picks from logits split over tp devices against argmax and log-softmax over whole rows: a vocabulary
    tp does not divide (padded), a row whose maximum is in two shards (the first wins), -inf everywhere but one."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from capstan.runtime.parallel.mesh import MODEL_AXIS
    from capstan.runtime.parallel.vocab_greedy import greedy_from_vocab_shards

    vocab, padded = 101, 104  # 101 real tokens; the padded columns hold larger values that must never win
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, padded)).astype(np.float32)
    x[:, vocab:] = 50.0
    x[1, [3, 80]] = 9.0  # a tie across shards: the lower id
    x[2, :] = -np.inf
    x[2, 77] = 0.0
    mesh = jax.make_mesh((tp,), (MODEL_AXIS,), devices=jax.devices()[:tp])
    with jax.set_mesh(mesh):
        split = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P(None, MODEL_AXIS)))
        tokens, logprob = jax.jit(greedy_from_vocab_shards, static_argnums=1)(split, vocab)
    real = x[:, :vocab]
    expected = np.asarray(jax.nn.log_softmax(jnp.asarray(real), axis=-1))
    want = real.argmax(-1)
    return {
        "tokens": np.asarray(tokens).tolist(),
        "want": want.tolist(),
        "logprob_error": float(np.max(np.abs(np.asarray(logprob) - expected[np.arange(5), want]))),
    }


def test_greedy_picks_from_vocabulary_shards_as_from_whole_rows():
    got = run_split(4, {"any": 4}, vocab_greedy=True)["any"]
    assert got["tokens"] == got["want"] and got["want"][1:3] == [3, 77], got
    assert got["logprob_error"] < 1e-5, got


def _made_split(case: str, tp: int) -> dict:
    import jax

    from capstan.runtime.models.config import ModelConfig
    from capstan.runtime.models.loader import random_model
    from capstan.runtime.parallel.tensor_parallel import TensorParallel

    cfg = ModelConfig.from_pretrained(GOLDEN / case)
    whole = jax.tree.leaves(random_model(cfg, "float32"))
    parts = jax.tree.leaves(random_model(cfg, "float32", split=TensorParallel.create(tp, cfg).checkpoint_sharding))
    matrices = [p for p in parts if p.ndim >= 2]  # the projections and vocabulary tables; norms and rope are vectors
    return {
        "matrices": len(matrices),
        "split": sum("model" in str(getattr(p.sharding, "spec", "")) for p in matrices),
        # the same draws (jit may fuse the scaling differently: within float32 rounding)
        "equal": all(
            np.allclose(np.asarray(w), np.asarray(p), rtol=1e-6, atol=1e-8) for w, p in zip(whole, parts, strict=True)
        ),
    }


if __name__ == "__main__":  # the child: one device, then split, for each case (split only through the GPU kernels)
    if "gpu-kernels" in sys.argv:
        from capstan.runtime import attention

        attention.KERNELS_INTERPRETED_ON_CPU = True
    if "tpu-layout" in sys.argv:
        from capstan.runtime import attention

        attention.TPU_LAYOUT_ON_CPU = True
    probes = (
        ("compiles", _compiles),
        ("made-split", _made_split),
        ("vocab-greedy", _vocab_greedy),
        ("queued", _queued),
    )
    for mode, probe in probes:
        if mode in sys.argv:
            print(json.dumps({case: probe(case, tp) for case, tp in json.loads(sys.argv[1]).items()}))
            sys.exit(0)
    split_only = "gpu-kernels" in sys.argv or "tpu-layout" in sys.argv
    sizes = lambda tp: (tp,) if split_only else (1, tp)  # noqa: E731
    results = {case: {str(n): _generate(case, n) for n in sizes(tp)} for case, tp in json.loads(sys.argv[1]).items()}
    print(json.dumps(results))
