"""FP8 K/V pages (--kv-cache-dtype fp8) on CPU: golden parity with transformers within a measured tolerance, a
wrong scale caught by that tolerance, the page budget doubled, the engine through the GPU kernels interpreted,
checkpoint scales read, bad values refused naming the flag. (The kernels against the reference on random FP8
pages: tests/test_attention.py; TPU's mapping: tests/test_tpu_attention.py; `capstan serve`: tests/server.)

Run with -s to see the measured figures."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden import CASES, GOLDEN, log_softmax, reference, reference_logits
from safetensors.numpy import save_file
from test_models import PAGE, _run

from capstan.runtime.attention.kv_quantization import FP8
from capstan.runtime.config import EngineConfig
from capstan.runtime.engine import engine as engine_module
from capstan.runtime.engine.engine import LLMEngine
from capstan.runtime.engine.llm import LLM
from capstan.runtime.kv.cache import KVCache
from capstan.runtime.models.config import UnsupportedModelError
from capstan.runtime.models.loader import load_model
from capstan.runtime.sampling.sampling_params import SamplingParams

# Measured (CPU, float32 model, FP8 pages), teacher-forced over every position of every golden prompt against
# transformers' float32 logits, with scales 1.0 (vLLM's default) and 0.05 (a checkpoint's): the largest |logprob
# difference| over the whole vocabulary is gemma3 0.52, llama 0.11, qwen2 0.56, qwen3 0.85 (bf16 pages: 0.005-0.05);
# at transformers' top token at most 0.14; top-1 agreement 262-270 of 270 (llama-s11 has near ties). The bounds are
# ~2x those, per checkpoint, so that a K or V scale off by 2x fails every case (test below: 0.68-10.4 for K, 1.09-8.9
# for V) and an ignored scale fails by far.
MAX_LOGPROB_DEVIATION = {"gemma3-s14": 1.0, "llama-s11": 0.25, "qwen2-s12": 1.2, "qwen3-s13": 1.7}
MAX_TOP_LOGPROB_DEVIATION = 0.3
MIN_TOP1_AGREEMENT = 0.95
CHECKPOINT_SCALE = 0.05  # a non-unit per-layer scale, as a calibrated checkpoint gives: a reader must apply it
# a greedy token may differ from transformers' only where its top-2 margin is within twice the top-token deviation
FP8_TIE_MARGIN = 2 * MAX_TOP_LOGPROB_DEVIATION


def _scaled(model, k_scale: float, v_scale: float):
    return model.with_kv_scales([(k_scale, v_scale)] * model.cfg.num_layers)


def _fp8_cache(model, pages: int) -> KVCache:
    c = model.cfg
    return KVCache.allocate(c.num_layers, pages, PAGE, c.num_kv_heads, c.head_dim, FP8)


def _deviation(got: np.ndarray, want: np.ndarray) -> tuple[float, float, int]:
    """(max |logprob diff| over the vocabulary, at transformers' top token, top-1 agreements) over positions."""
    diff = np.abs(log_softmax(got) - log_softmax(want))
    top = np.take_along_axis(diff, want.argmax(-1)[:, None], -1)
    return float(diff.max()), float(top.max()), int((got.argmax(-1) == want.argmax(-1)).sum())


def _within_tolerance(case: str, deviation: float, top: float, agree: int, total: int) -> bool:
    return (
        deviation < MAX_LOGPROB_DEVIATION[case]
        and top < MAX_TOP_LOGPROB_DEVIATION
        and agree / total >= MIN_TOP1_AGREEMENT
    )


def _teacher_forced(model, case: str) -> tuple[float, float, int, int]:
    """Every prompt + continuation in one step through FP8 pages (written, then read back in the same step)."""
    ref, worst = reference(case), (0.0, 0.0, 0, 0)
    for i, (prompt, cont) in enumerate(zip(ref["prompts"], ref["greedy_continuations"], strict=True)):
        pages = list(range(1, 1 + 160 // PAGE))[::-1]
        got, _ = _run(model, _fp8_cache(model, 1 + len(pages)), prompt + cont[:-1], 0, pages, 160)
        d, t, a = _deviation(got, reference_logits(case, i))
        worst = (max(worst[0], d), max(worst[1], t), worst[2] + a, worst[3] + len(got))
    return worst


def _written_then_read(writer, reader, case: str) -> tuple[float, float, int, int]:
    """The prompt's pages written by `writer`, the continuation computed by `reader` over them: a reader whose
    scales differ from the writer's reads every prompt key and value wrongly."""
    ref, worst = reference(case), (0.0, 0.0, 0, 0)
    for i, (prompt, cont) in enumerate(zip(ref["prompts"], ref["greedy_continuations"], strict=True)):
        pages = list(range(1, 1 + 160 // PAGE))
        _, kv = _run(writer, _fp8_cache(writer, 1 + len(pages)), prompt, 0, pages, 160)
        got, _ = _run(reader, kv, cont[:-1], len(prompt), pages, 32)
        d, t, a = _deviation(got, reference_logits(case, i)[len(prompt) :])
        worst = (max(worst[0], d), max(worst[1], t), worst[2] + a, worst[3] + len(got))
    return worst


@pytest.mark.parametrize("case", CASES)
def test_fp8_pages_keep_golden_logprobs_near_transformers(case):
    model = load_model(GOLDEN / case)
    for scale in (1.0, CHECKPOINT_SCALE):
        deviation, top, agree, total = _teacher_forced(_scaled(model, scale, scale), case)
        print(
            f"\n{case} fp8 pages, scales {scale}: max |logprob diff| {deviation:.4f} (any token), {top:.4f} "
            f"(transformers' top token); top-1 agreement {agree}/{total}"
        )
        assert _within_tolerance(case, deviation, top, agree, total), (case, scale, deviation, top, agree)


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_fp8_scale_fails_the_tolerance(case):
    """The tolerance above would catch a broken scale: pages written with one scale and read with K's or V's
    off by 2x, or with none, fall outside it; read with the writer's own scales they stay inside."""
    model = load_model(GOLDEN / case)
    s = CHECKPOINT_SCALE
    writer = _scaled(model, s, s)
    assert _within_tolerance(case, *_written_then_read(writer, writer, case))
    for name, reader in (("K x2", _scaled(model, 2 * s, s)), ("V x2", _scaled(model, s, 2 * s)), ("none", model)):
        deviation, top, agree, total = _written_then_read(writer, reader, case)
        print(f"\n{case} read with {name}: {deviation:.3f} (any token), {top:.3f} (top token), {agree}/{total}")
        assert not _within_tolerance(case, deviation, top, agree, total), (case, name)


def _engine(dtype: str, kv_cache_dtype: str, **kw) -> LLMEngine:
    config = EngineConfig(
        model=str(GOLDEN / "llama-s11"), dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_model_len=256, **kw
    )
    return LLMEngine(config)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a fixed budget: the CPU's (devices measure their own)")
def test_the_page_budget_doubles_with_fp8_pages(monkeypatch):
    """At a fixed memory budget (the CPU default, made small enough that sequences could use every page), the
    engine's page count follows the stored dtype: bf16 model, FP8 pages -> 2x the pages of bf16 pages."""
    monkeypatch.setattr(engine_module, "CPU_KV_BYTES", 1 << 20)
    pages = {}
    for dtype, kv in (("bfloat16", "auto"), ("bfloat16", "fp8"), ("bfloat16", "fp8_e4m3"), ("float32", "bfloat16")):
        engine = _engine(dtype, kv, max_num_seqs=64)
        pages[dtype, kv] = engine.config.num_pages
        assert engine.kv.k[0].dtype == {"auto": jnp.bfloat16, "bfloat16": jnp.bfloat16}.get(kv, FP8)
        held = sum(a.nbytes for a in (*engine.kv.k, *engine.kv.v))
        assert held <= 1 << 20 < held + held // pages[dtype, kv]  # as many whole pages as the budget holds
    print(f"\npages in 1 MiB (llama-s11): {pages}")
    bf16 = pages["bfloat16", "auto"]
    assert pages["bfloat16", "fp8"] == pages["bfloat16", "fp8_e4m3"] in (2 * bf16, 2 * bf16 + 1)  # whole pages
    assert pages["float32", "bfloat16"] == pages["bfloat16", "auto"]  # bfloat16 pages under a float32 model


def _agreement_until_a_near_tie(ref: dict, i: int, margin: float) -> int:
    """Greedy tokens owed before the first step whose top-2 margin is below `margin` (FP8 may flip that one)."""
    margins = ref["step_top2_margins"][i]
    return next((step for step, m in enumerate(margins) if m < margin), len(margins))


# qwen3 and qwen2: no near ties in their greedy continuations (llama-s11's first steps are within 0.01)
@pytest.mark.parametrize("case, interpreted", [("qwen3-s13", True), ("qwen2-s12", False)])
def test_golden_through_the_engine_with_fp8_pages(case, interpreted, monkeypatch):
    """The engine end to end with FP8 pages: chunked prefill over 4-token pages mixed with sampled fillers, multi-step
    decode; interpreted: through the Pallas kernels (ragged for prefill chunks, fused decode writing FP8 in place),
    else the chunked XLA path. Greedy tokens equal transformers' until a near tie, their logprobs within the
    top-token tolerance."""
    from capstan.runtime import attention

    monkeypatch.setattr(attention, "KERNELS_INTERPRETED_ON_CPU", interpreted)
    jax.clear_caches()  # steps traced with the other attention must be traced again
    try:
        ref = reference(case)
        llm = LLM(
            str(GOLDEN / case),
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=48,
            page_size=4,
            dtype="float32",
            kv_cache_dtype="fp8",
            warmup=False,  # (only the shapes this run takes are compiled: interpreted kernels compile slowly)
        )
        assert llm.engine.kv.k[0].dtype == FP8
        rng = np.random.default_rng(0)
        fillers = [rng.integers(10, 500, size=int(n)).tolist() for n in (3, 60, 17, 90)]
        greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
        noisy = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=5)
        outs = llm.generate(ref["prompts"] + fillers, [greedy] * len(ref["prompts"]) + [noisy] * len(fillers))
        worst, checked = 0.0, 0
        for i, (prompt, cont) in enumerate(zip(ref["prompts"], ref["greedy_continuations"], strict=True)):
            got = outs[i].outputs[0]
            owed = _agreement_until_a_near_tie(ref, i, FP8_TIE_MARGIN)
            checked += owed
            assert got.token_ids[:owed] == cont[:owed], f"{case} prompt {i}"
            expected = log_softmax(reference_logits(case, i))
            for k in range(owed):
                worst = max(worst, abs(got.logprobs[k][cont[k]].logprob - expected[len(prompt) - 1 + k, cont[k]]))
        print(f"\n{case} engine, fp8 pages ({'kernels interpreted' if interpreted else 'chunked XLA'}): {worst:.4f}")
        assert worst < MAX_TOP_LOGPROB_DEVIATION and checked == 4 * 24
        llm.engine.pool.check_all_free()
    finally:
        jax.clear_caches()


def test_checkpoint_kv_scales_are_read_and_bad_ones_refused(tmp_path):
    """self_attn.k_scale / v_scale (llm-compressor's names, which vLLM reads) become each layer's FP8 scales."""
    case = "llama-s11"
    from safetensors import safe_open

    with safe_open(GOLDEN / case / "model.safetensors", framework="numpy") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open handles do not iterate
    layers = json.loads((GOLDEN / case / "config.json").read_text())["num_hidden_layers"]

    def write(folder, extra):
        shutil.copytree(GOLDEN / case, folder)
        save_file(tensors | extra, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    scales = {}
    for i in range(layers):
        scales[f"model.layers.{i}.self_attn.k_scale"] = np.asarray(0.02 * (i + 1), np.float32)
        scales[f"model.layers.{i}.self_attn.v_scale"] = np.asarray([0.01 * (i + 1)], np.float32)  # shape [1] too
    model = load_model(write(tmp_path / "scaled", scales))
    assert [(b.attn.k_scale, b.attn.v_scale) for b in model.layers] == [
        pytest.approx((0.02 * (i + 1), 0.01 * (i + 1))) for i in range(layers)
    ]
    assert load_model(GOLDEN / case).layers[0].attn.k_scale == 1.0  # none in the checkpoint: vLLM's default
    per_head = scales | {"model.layers.1.self_attn.k_scale": np.full(2, 0.1, np.float32)}
    with pytest.raises(UnsupportedModelError, match="model.layers.1.self_attn.k_scale must be one positive"):
        load_model(write(tmp_path / "per_head", per_head))
    partial = {k: v for k, v in scales.items() if not k.startswith("model.layers.2.")}
    with pytest.raises(UnsupportedModelError, match="some layers only"):
        load_model(write(tmp_path / "partial", partial))


def test_bad_kv_cache_dtypes_are_refused_naming_the_flag(capsys):
    from capstan.runtime.cli import build_parser

    for value in ("fp8_e5m2", "int8", "float16"):
        with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\) must be one of"):
            EngineConfig(model=str(GOLDEN / "llama-s11"), kv_cache_dtype=value).validate()
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--kv-cache-dtype", value])
        assert "--kv-cache-dtype: invalid choice" in capsys.readouterr().err
    for value in ("auto", "bfloat16", "fp8", "fp8_e4m3"):
        assert build_parser().parse_args(["serve", "--kv-cache-dtype", value]).kv_cache_dtype == value
