"""One stream's decode in gpt-fast (pytorch-labs/gpt-fast: torch.compile with CUDA graphs), the peer issue 64 names.

git clone https://github.com/pytorch-labs/gpt-fast .peer/gpt-fast      # (on a machine with GitHub; carry it)
python benchmarks/peer_gpt_fast.py --gpt-fast .peer/gpt-fast --shape llama-3.2-1b

gpt-fast's own model.py and generate.py, imported from that checkout and run as its generate.py runs them
(`decode_one_token` under torch.compile(mode="reduce-overhead", fullgraph=True), the same inductor settings, bf16),
with random weights in a named shape of benchmarks/shapes.py in place of a converted checkpoint. Its sampling is
top-k with a temperature (its defaults: top-k 200, T 0.8; T 0 is its greedy: one token a row takes all the mass).
Prints ms a token: all in (a 256-token prompt's prefill included, as throughput.py's --single-stream-tokens counts
it) and the decode alone ((t(N) - t(2)) / (N - 2)), medians of --repeats runs."""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from shapes import shape_config  # noqa: E402


def load_gpt_fast(path: Path):
    """gpt-fast's generate and model modules from a checkout. Its tokenizer module (sentencepiece, tiktoken) is only
    for text, which random token ids never need: where those packages are missing it is left out, named."""
    sys.path.insert(0, str(path.resolve()))
    try:
        importlib.import_module("tokenizer")
    except ImportError as e:
        print(f"gpt-fast's tokenizer not importable ({e}): left out, token ids only", file=sys.stderr)
        sys.modules["tokenizer"] = types.ModuleType("tokenizer")
        sys.modules["tokenizer"].get_tokenizer = None  # type: ignore[attr-defined]  # never called
    return importlib.import_module("generate"), importlib.import_module("model")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpt-fast", type=Path, default=Path(".peer/gpt-fast"), help="a gpt-fast checkout")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samplings", nargs="+", default=["0.8:200", "0:200"], help="temperature:top_k pairs")
    a = ap.parse_args()
    if not (a.gpt_fast / "model.py").exists():
        raise SystemExit(
            f"--gpt-fast {a.gpt_fast}: no model.py there (git clone https://github.com/pytorch-labs/gpt-fast)"
        )
    import torch

    if not hasattr(torch.backends.cuda, "sdp_kernel"):  # gone from newer torch: its successor, the same choice
        from torch.nn.attention import SDPBackend, sdpa_kernel

        torch.backends.cuda.sdp_kernel = lambda **_: sdpa_kernel([SDPBackend.MATH])  # gpt-fast asks for math only
    gen, gf_model = load_gpt_fast(a.gpt_fast)
    c = shape_config(a.shape)
    rope = next(iter(c.rope.values()))
    scaling = None
    if rope.rope_type == "llama3":  # (precomputed frequencies: no cost a token either way)
        scaling = dict(
            factor=rope.factor,
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    args = gf_model.ModelArgs(
        block_size=a.prompt_len + a.tokens + 8,
        vocab_size=c.vocab_size,
        n_layer=c.num_layers,
        n_head=c.num_heads,
        n_local_heads=c.num_kv_heads,
        dim=c.hidden_size,
        intermediate_size=c.intermediate_size,
        rope_base=rope.theta,
        norm_eps=c.rms_norm_eps,
        rope_scaling=scaling,
    )
    assert args.head_dim == c.head_dim, f"gpt-fast's head_dim is dim // n_head: {args.head_dim} against {c.head_dim}"
    torch.manual_seed(0)
    with torch.device("meta"):
        model = gf_model.Transformer(args)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    model = model.to(dtype=torch.bfloat16).eval()
    # the bytes a token reads: every weight but the embedding table, of which it reads one row (gpt-fast unties the
    # 1B's output projection from it, so the 1B's table is not the head's weight here, as it is in Capstan)
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("tok_"))
    # as its generate.py main does with --compile
    gen.decode_one_token = torch.compile(gen.decode_one_token, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(0, c.vocab_size, (a.prompt_len,), device="cuda", dtype=torch.int)

    def seconds(n: int, temperature: float, top_k: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            gen.generate(
                model,
                prompt,
                n,
                batch_size=1,
                interactive=False,
                draft_model=None,
                temperature=temperature,
                top_k=top_k,
            )
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    print(
        f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.shape}: {weights / 1e9:.2f} GB of weights a token"
    )
    for sampling in a.samplings:
        t, k = sampling.split(":")
        temperature, top_k = float(t), int(k)
        for _ in range(2):  # compiles, then captures the CUDA graphs
            seconds(a.tokens, temperature, top_k)
        whole = [seconds(a.tokens, temperature, top_k) for _ in range(a.repeats)]
        # two tokens: the prefill's and one decode (its generate cannot make one alone: an empty torch.cat)
        first = [seconds(2, temperature, top_k) for _ in range(a.repeats)]
        all_in = 1000 * statistics.median(whole) / a.tokens
        decode = 1000 * (statistics.median(whole) - statistics.median(first)) / (a.tokens - 2)
        print(
            f"gpt-fast {a.shape} T {temperature} top-k {top_k}: {all_in:.3f} ms a token all in "
            f"({1000 * min(whole) / a.tokens:.3f}..{1000 * max(whole) / a.tokens:.3f}), decode alone {decode:.3f} ms "
            f"({weights / decode / 1e6:.0f} GB/s of weights)",
            flush=True,
        )


if __name__ == "__main__":
    main()
