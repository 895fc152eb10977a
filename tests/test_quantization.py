"""Quantized weights (--quantization fp8/int8, quantized checkpoints) on CPU: the quantize/dequantize round trip,
next-token logprobs of the golden checkpoints against transformers' float32 logits (deviation and greedy agreement
printed), compressed-tensors and Hugging Face FP8 checkpoints written by hand, refusals, and the tensor-parallel split.

Run with -s to see the measured figures."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from golden import CASES, GOLDEN, log_softmax, reference, reference_logits
from safetensors import safe_open
from safetensors.numpy import save_file
from test_models import PAGE, _fresh_cache, _run

from capstan.runtime.models.config import UnsupportedModelError
from capstan.runtime.models.loader import load_model
from capstan.runtime.models.quantization import QuantizedWeight, dequantize_rows, quantize_rows

# Measured on the four golden checkpoints (random weights, f32 activations), every position of every prompt: the
# largest |logprob - transformers'| over the whole vocabulary is 0.03-0.29 for int8 and 0.18-1.56 for fp8 (3 mantissa
# bits, activations rounded too; the largest are on tokens of tiny probability); at transformers' top token
# 0.002-0.05 (int8) and 0.005-0.35 (fp8); top-1 agreement 263-270/270 (int8), 256-270/270 (fp8). The bounds: ~2x.
MAX_LOGPROB_DEVIATION = {"int8": 0.6, "fp8": 3.0}
MAX_TOP_LOGPROB_DEVIATION = {"int8": 0.1, "fp8": 0.7}
MIN_TOP1_AGREEMENT = {"int8": 0.95, "fp8": 0.9}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("method, bound", [("int8", 1 / 254), ("fp8", 1 / 16)])
def test_round_trip_error_is_within_half_a_step(method, bound):
    """int8: |w - deq| <= scale / 2 = amax / 254; e4m3 (3 mantissa bits): relative error <= 2^-4 above its
    normal range, absolute <= scale * 2^-10 in the subnormals."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 256)).astype(np.float32) * rng.uniform(0.01, 10, size=(64, 1)).astype(np.float32)
    w[3] = 0.0  # an all-zero row must not divide by zero
    q = quantize_rows(w, method)
    deq = np.asarray(dequantize_rows(q))
    amax = np.abs(w).max(-1, keepdims=True)
    assert q.values.dtype == (jnp.int8 if method == "int8" else jnp.float8_e4m3fn) and q.scale.shape == (64,)
    assert np.all(deq[3] == 0)
    if method == "int8":
        assert np.all(np.abs(w - deq) <= amax * bound + 1e-7)
    else:
        scale = amax / 448
        assert np.all(np.abs(w - deq) <= np.maximum(np.abs(w) * bound, scale * 2.0**-9) + 1e-7)
    assert np.allclose(np.abs(deq).max(-1), amax[:, 0], rtol=1e-6)  # the largest value of a row is exact


def test_fp8_reads_its_weight_upcast_for_a_few_rows_and_quantizes_activations_for_more():
    """A step of at most FP8_WEIGHT_ONLY_MAX_ROWS rows is the dot with the dequantized weight (the activations kept
    as they are); a larger step rounds the activations to e4m3 too, so its rows differ, within e4m3's error."""
    import haliax as hax

    from capstan.runtime.models import quantization

    rng = np.random.default_rng(1)
    w = rng.normal(size=(48, 64)).astype(np.float32)
    q = quantize_rows(w, "fp8")
    Out, In = hax.Axis("out", 48), hax.Axis("in", 64)
    weight = QuantizedWeight(hax.named(q.values, (Out, In)), hax.named(q.scale, (Out,)))
    dense = np.asarray(dequantize_rows(q))
    few = quantization.FP8_WEIGHT_ONLY_MAX_ROWS
    assert few >= 1
    for rows in (1, few, few + 1):
        x = rng.normal(size=(rows, 64)).astype(np.float32)
        got = np.asarray(weight(hax.named(jnp.asarray(x), (hax.Axis("token", rows), In)), In).array)
        exact = x @ dense.T
        if rows <= few:
            np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
        else:
            assert not np.allclose(got, exact, rtol=1e-5, atol=1e-5)  # the activations' rounding shows
            np.testing.assert_allclose(got, exact, rtol=0.15, atol=0.15 * np.abs(exact).max())


def _teacher_forced(model, case):
    """Logits at every position of each golden prompt + continuation, one forward each."""
    ref = reference(case)
    out = []
    for prompt, cont in zip(ref["prompts"], ref["greedy_continuations"], strict=True):
        pages = list(range(1, 1 + 160 // PAGE))
        logits, _ = _run(model, _fresh_cache(model, 1 + len(pages)), prompt + cont[:-1], 0, pages, 160)
        out.append(logits)
    return out


@pytest.mark.parametrize("case", CASES)
def test_quantized_golden_logprobs_stay_near_transformers(case):
    ref_logits = [reference_logits(case, i) for i in range(len(reference(case)["prompts"]))]
    for method in ("int8", "fp8"):
        model = load_model(GOLDEN / case, "float32", method)
        assert isinstance(model.layers[0].mlp.down_proj, QuantizedWeight)
        assert not isinstance(model.lm_head, QuantizedWeight)
        deviation, top_deviation, agree, total = 0.0, 0.0, 0, 0
        for got, want in zip(_teacher_forced(model, case), ref_logits, strict=True):
            diff = np.abs(log_softmax(got) - log_softmax(want))
            deviation = max(deviation, float(diff.max()))
            top_deviation = max(top_deviation, float(np.take_along_axis(diff, want.argmax(-1)[:, None], -1).max()))
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += len(want)
        print(
            f"\n{case} {method}: max |logprob diff| {deviation:.4f} (any token), {top_deviation:.4f} (transformers' "
            f"top token); greedy (top-1) agreement {agree}/{total}"
        )
        assert deviation < MAX_LOGPROB_DEVIATION[method], f"{case} {method}: {deviation}"
        assert top_deviation < MAX_TOP_LOGPROB_DEVIATION[method], f"{case} {method}: {top_deviation}"
        assert agree / total >= MIN_TOP1_AGREEMENT[method], f"{case} {method}: {agree}/{total}"


def _write_quantized_checkpoint(src: Path, out: Path, quantization_config: dict, tensors_for) -> None:
    """The golden checkpoint with each linear weight replaced by tensors_for(name, f32 weight) (Hugging Face names)."""
    shutil.copytree(src, out)
    with safe_open(src / "model.safetensors", framework="numpy") as f:
        dense = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open handles do not iterate
    tensors = {}
    for name, w in dense.items():
        if name.endswith(tuple(f"{p}.weight" for p in LINEARS)):
            tensors.update(tensors_for(name, w.astype(np.float32)))
        else:
            tensors[name] = w
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))


def _compressed_tensors_config(kind: str) -> dict:
    """The quantization_config llm-compressor writes for FP8_DYNAMIC (float) or W8A8 int8 (int) schemes."""
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": kind,
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
    }


def _per_channel(name: str, w: np.ndarray, kind: str) -> dict:
    amax = np.abs(w).max(-1, keepdims=True)
    if kind == "float":
        scale = amax / 448
        values = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    else:
        scale = amax / 127
        values = np.round(w / scale).astype(np.int8)
    return {name: values, name + "_scale": scale.astype(np.float32)}


@pytest.mark.parametrize("kind, method", [("float", "fp8"), ("int", "int8")])
def test_compressed_tensors_checkpoint_loads_quantized_and_matches_its_dequantized_weights(tmp_path, kind, method):
    case = "llama-s11"
    written = {}

    def tensors_for(name, w):
        written[name] = _per_channel(name, w, kind)
        return written[name]

    _write_quantized_checkpoint(GOLDEN / case, tmp_path / "ct", _compressed_tensors_config(kind), tensors_for)
    model = load_model(tmp_path / "ct", "float32")
    down = model.layers[1].mlp.down_proj
    assert isinstance(down, QuantizedWeight) and down.method == method
    t = written["model.layers.1.mlp.down_proj.weight"]
    stored = np.asarray(t["model.layers.1.mlp.down_proj.weight"]).astype(np.float32)
    expected = stored * t["model.layers.1.mlp.down_proj.weight_scale"]
    np.testing.assert_array_equal(np.asarray(down.dequantize().array), expected)  # loaded as written, not requantized

    # the reference: the same weights dequantized into a dense float32 checkpoint
    def dequantized(name, w):
        values, scale = _per_channel(name, w, kind).values()
        return {name: np.asarray(values).astype(np.float32) * scale}

    _write_quantized_checkpoint(GOLDEN / case, tmp_path / "dense", {}, dequantized)
    cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "dense" / "config.json").write_text(json.dumps(cfg))
    dense = load_model(tmp_path / "dense", "float32")
    deviation = max(
        float(np.abs(log_softmax(a) - log_softmax(b)).max())
        for a, b in zip(_teacher_forced(model, case), _teacher_forced(dense, case), strict=True)
    )
    print(f"\ncompressed-tensors {method} vs its dequantized weights: max |logprob diff| {deviation:.2e}")
    # int8 is weight-only: the same numbers up to summation order; fp8 also rounds the activations to e4m3
    assert deviation < (1e-4 if method == "int8" else MAX_LOGPROB_DEVIATION["fp8"])


def test_hugging_face_block_fp8_checkpoint_is_requantized_per_channel(tmp_path):
    block = 16

    def tensors_for(name, w):
        out, inp = w.shape
        blocks = np.abs(w).reshape(out // block, block, inp // block, block).max(axis=(1, 3)) / 448
        full = np.repeat(np.repeat(blocks, block, 0), block, 1)
        return {name: (w / full).astype(ml_dtypes.float8_e4m3fn), name + "_scale_inv": blocks.astype(np.float32)}

    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    _write_quantized_checkpoint(GOLDEN / "llama-s11", tmp_path / "fp8", qc, tensors_for)
    model = load_model(tmp_path / "fp8", "float32")
    assert model.layers[0].attn.qkv_proj.method == "fp8"
    deviation = max(
        float(np.abs(log_softmax(a) - log_softmax(reference_logits("llama-s11", i))).max())
        for i, a in enumerate(_teacher_forced(model, "llama-s11"))
    )
    print(f"\nHF block FP8 requantized per channel vs transformers f32: max |logprob diff| {deviation:.4f}")
    assert deviation < MAX_LOGPROB_DEVIATION["fp8"]


@pytest.mark.parametrize(
    "qc, named",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format='pack-quantized'"),
        (
            _compressed_tensors_config("int")
            | {
                "config_groups": {
                    "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "symmetric": True}}
                }
            },
            "num_bits=4",
        ),
    ],
)
def test_unsupported_quantization_is_refused_naming_it(tmp_path, qc, named):
    shutil.copytree(GOLDEN / "llama-s11", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    with pytest.raises(UnsupportedModelError, match="quantization_config.*" + named.replace("(", r"\(")):
        load_model(tmp_path / "m")


def test_quantization_flag_is_checked():
    from capstan.runtime.cli import _engine_config, build_parser

    args = build_parser().parse_args(["generate", str(GOLDEN / "llama-s11"), "--prompt", "x", "--quantization", "fp8"])
    assert _engine_config(args).quantization == "fp8"
    with pytest.raises(ValueError, match="--quantization='int4'"):
        load_model(GOLDEN / "llama-s11", "float32", "int4")


def test_quantized_model_splits_over_devices_like_one_device():
    """qwen2-s12 (2 KV heads, replicated 2x, q/k/v biases) in fp8 over 4 CPU devices gives one device's greedy tokens
    (int8 weights and scales are placed by the same axis names; fp8 also takes its activation scales over a split
    contraction)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, __file__], env=env, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for method in ("fp8",):
        assert got[method]["4"]["tokens"] == got[method]["1"]["tokens"], method
        np.testing.assert_allclose(got[method]["4"]["logprobs"], got[method]["1"]["logprobs"], atol=1e-3)


if __name__ == "__main__":  # the child of the split test: one device, then four
    from capstan.runtime.engine.llm import LLM
    from capstan.runtime.sampling.sampling_params import SamplingParams

    prompts = reference("qwen2-s12")["prompts"][:3]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    results: dict[str, dict[str, dict]] = {}
    for method in ("fp8",):
        for tp in (1, 4):
            llm = LLM(
                str(GOLDEN / "qwen2-s12"),
                max_model_len=128,
                max_num_seqs=4,
                max_num_batched_tokens=64,
                page_size=4,
                dtype="float32",
                tensor_parallel_size=tp,
                warmup=False,
                quantization=method,
            )
            outs = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
            assert all(o.logprobs is not None for o in outs)  # logprobs=0: the chosen token's
            results.setdefault(method, {})[str(tp)] = {
                "tokens": [o.token_ids for o in outs],
                "logprobs": [[(o.logprobs or [])[k][t].logprob for k, t in enumerate(o.token_ids)] for o in outs],
            }
    print(json.dumps(results))


@pytest.mark.parametrize("case", ["qwen3-s13", "llama-s11"])
def test_gguf_q8_0_weights_are_served_in_their_blocks(tmp_path, case):
    """A Q8_0 GGUF keeps its linear weights as int8 blocks with one scale per 32 inputs (llama-s11's o_proj, whose
    blocks would straddle its 16-wide heads, is dequantized), and computes what the dequantized weights compute."""
    from gguf_files import write_gguf

    from capstan.runtime.models.gguf_checkpoint import load_gguf_model

    file = write_gguf(GOLDEN / case, tmp_path / f"{case}.q8_0.gguf", q8_0=True)
    kept = load_gguf_model(file, jnp.float32, "none")  # its own format (CPUs would requantize it to int8)
    dense = load_gguf_model(file, jnp.float32, "none", keep_q8_0=False)
    layer = kept.layers[0]
    blocked = [layer.attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(w, QuantizedWeight) and w.block == 32 and w.weight.dtype == jnp.int8 for w in blocked)
    assert isinstance(layer.attn.o_proj, QuantizedWeight) == (case == "qwen3-s13")
    assert layer.mlp.down_proj.scale.array.shape == (64, kept.cfg.intermediate_size // 32)  # [Embed, Mlp blocks]
    np.testing.assert_allclose(
        np.asarray(layer.mlp.down_proj.dequantize().array),
        np.asarray(dense.layers[0].mlp.down_proj.array),
        rtol=0,
        atol=0,
    )
    for got, want in zip(_teacher_forced(kept, case), _teacher_forced(dense, case), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(
        _teacher_forced(kept, case),
        [reference_logits(case, i) for i in range(len(reference(case)["prompts"]))],
        strict=True,
    ):
        assert (ours.argmax(-1) == theirs.argmax(-1)).mean() > 0.9  # Q8_0 moves little from the float model


def test_gguf_q8_0_in_blocks_is_refused_across_devices_naming_the_way_out(tmp_path):
    from gguf_files import write_gguf

    from capstan.runtime.models.gguf_checkpoint import load_gguf_model
    from capstan.runtime.parallel.tensor_parallel import TensorParallel, TensorParallelError

    model = load_gguf_model(write_gguf(GOLDEN / "qwen3-s13", tmp_path / "q.gguf", q8_0=True), jnp.float32, "none")
    import jax
    from jax.sharding import Mesh

    with pytest.raises(TensorParallelError, match="Q8_0.*--quantization int8"):
        TensorParallel(Mesh(np.asarray(jax.devices()[:1]), ("model",))).place_model(model)


def test_q8_0_blocks_as_gguf_writes_them():
    """quantize_blocks (benchmarks' random Q8_0 weights) is gguf-py's Q8_0, and q8_0_blocks reads gguf's bytes."""
    import gguf

    from capstan.runtime.models.gguf_checkpoint import q8_0_blocks
    from capstan.runtime.models.quantization import quantize_blocks

    w = np.random.default_rng(5).standard_normal((6, 96)).astype(np.float32)
    theirs = q8_0_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), w.shape)
    ours = quantize_blocks(w)
    assert theirs.scale.shape == ours.scale.shape == (6, 3) and theirs.block == ours.block == 32
    np.testing.assert_allclose(theirs.scale, ours.scale, rtol=1e-3)  # gguf stores float16 scales
    assert np.abs(np.asarray(theirs.values, np.int32) - np.asarray(ours.values, np.int32)).max() <= 1
    np.testing.assert_allclose(
        dequantize_rows(theirs),
        gguf.quants.dequantize(
            gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        ).reshape(w.shape),
    )
