"""Writes a named benchmark shape (shapes.py) as a Hugging Face checkpoint folder with random bfloat16 weights, so
`capstan serve` and the offline engine load the same files (benchmarks/online.py).

    python benchmarks/random_checkpoint.py --shape llama-3.2-1b /tmp/ckpt-1b

The tokenizer is the embedded default model's (runtime/default_model/), its vocabulary padded up to the shape's
with one plain piece per extra id (" q5000"), so every id a random model emits decodes to text and a server
streams a chunk for it as it would for a real model. Weights are random bits of a fixed exponent (magnitudes in
[1/32, 1/16) with random signs, [1/4, 1/2) for the embedding): no float maths, a 1B model in seconds."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES  # noqa: E402

from capstan.runtime.models.default_checkpoint import tensor_shapes  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "runtime" / "default_model"
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
# bfloat16 bits: sign and mantissa random, the exponent fixed (127 + e for magnitudes in [2^e, 2^(e+1)))
EXPONENT_BITS = {"embed": (127 - 2) << 7, "linear": (127 - 5) << 7}
ONE = 0x3F80  # 1.0: every norm weight
STAMP = "capstan-random-checkpoint.json"  # what was written: a folder with the same stamp is reused


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...], kind: str):
    import ml_dtypes

    n = int(np.prod(shape))
    bits: np.ndarray
    if kind == "norm":
        bits = np.full(n, ONE, dtype=np.uint16)
    else:
        bits = (np.frombuffer(rng.bytes(2 * n), dtype=np.uint16) & 0x807F) | EXPONENT_BITS[kind]
    return bits.reshape(shape).view(ml_dtypes.bfloat16)


def write_tokenizer(out: Path, vocab_size: int) -> dict[str, int]:
    """The default model's tokenizer files, its vocabulary padded to vocab_size; returns its special tokens' ids."""
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(DEFAULT_MODEL / name, out / name)
    tok = json.loads((DEFAULT_MODEL / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    specials = {a["content"]: a["id"] for a in tok["added_tokens"]}
    have = len(vocab) + len(specials)
    if vocab_size < have:
        raise SystemExit(f"--shape: vocab_size {vocab_size} is below the embedded tokenizer's {have} tokens")
    vocab.update(specials)  # in the model's vocabulary too, or the padding would push them past it
    for i in range(have, vocab_size):
        vocab[f"\u0120q{i}"] = i  # byte-level BPE's space, then ASCII: decodes to " q<id>"
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    return specials


def write_checkpoint(shape: str, out: Path, seed: int = 0) -> Path:
    """The folder `out` holding `shape` (reused when it holds it already, with this seed)."""
    from safetensors.numpy import save_file

    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape!r}: choose one of {', '.join(SHAPES)}")
    hf = {k: v for k, v in SHAPES[shape].items() if v is not None}
    arch = hf["architectures"][0]
    if arch not in MODEL_TYPES:
        raise SystemExit(f"--shape {shape}: {arch} checkpoints are not written here; choose a Llama or Qwen3 shape")
    stamp = {"shape": shape, "seed": seed, "config": hf}
    if (out / STAMP).is_file() and json.loads((out / STAMP).read_text()) == stamp:
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    specials = write_tokenizer(tmp, hf["vocab_size"])
    bos, eos, pad = specials["<|begin_of_text|>"], specials["<|eot_id|>"], specials["<|end_of_text|>"]
    config = dict(
        hf,
        model_type=MODEL_TYPES[arch],
        hidden_act="silu",
        dtype="bfloat16",
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    rng = np.random.default_rng(seed)
    tensors = {
        name: random_bf16(
            rng,
            s,
            "norm" if name.endswith("norm.weight") else "embed" if "embed" in name or "lm_head" in name else "linear",
        )
        for name, s in tensor_shapes(hf).items()
    }
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / STAMP).write_text(json.dumps(stamp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=list(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    print(write_checkpoint(a.shape, a.out, a.seed))
