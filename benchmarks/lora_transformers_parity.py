"""LoRA parity against Hugging Face on a machine with torch and transformers (the lent GPU has them): for each golden
checkpoint, random PEFT adapters (all seven projections; rsLoRA on q and v) served by Capstan's LoRA engine, against
transformers' float32 logits of the checkpoint with the adapter merged (W + scale * B @ A, tests/lora_adapters.py),
and, where peft is installed, of the base checkpoint with the adapter loaded by peft itself (PeftModel). Teacher-forced
on Capstan's greedy tokens: every generated position's logprob and greedy pick.

python benchmarks/lora_transformers_parity.py            # prints the largest |logprob difference| per case
bash benchmarks/gpu_suite.sh lorapeft"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from golden import CASES, GOLDEN, reference  # noqa: E402
from lora_adapters import merge_adapter, write_adapter  # noqa: E402

from capstan import LLM, LoRARequest, SamplingParams  # noqa: E402

TOLERANCE = 1e-4  # the golden tests' bound on float32 logprobs


def logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def main() -> int:
    try:
        from peft import PeftModel
    except ImportError:
        PeftModel = None
        print("peft is not installed: merged checkpoints only")
    worst, failures = 0.0, 0
    for case in CASES:
        base, folder = GOLDEN / case, Path(tempfile.mkdtemp())
        adapters = {
            "full": write_adapter(folder / "full", base, seed=1),
            "rs": write_adapter(
                folder / "rs", base, seed=2, rank=4, alpha=4.0, targets=("q_proj", "v_proj"), rslora=True
            ),
        }
        llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", max_model_len=256)
        prompts = reference(case)["prompts"]
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
        for k, (name, adapter) in enumerate(adapters.items()):
            outs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=LoRARequest(name, k + 1, str(adapter)))
            references = {
                "merged": AutoModelForCausalLM.from_pretrained(
                    merge_adapter(base, adapter, folder / f"m-{name}"), dtype=torch.float32
                )
            }
            if PeftModel is not None:
                plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
                references["peft"] = PeftModel.from_pretrained(plain, adapter)
            for label, model in references.items():
                model.eval()
                for prompt, out in zip(prompts, outs, strict=True):
                    tokens = out.outputs[0].token_ids
                    lp = logprobs(model, list(prompt) + tokens)[len(prompt) - 1 : -1]
                    ours = np.array([p[t].logprob for p, t in zip(out.outputs[0].logprobs, tokens, strict=True)])
                    diff = float(np.max(np.abs(ours - lp[np.arange(len(tokens)), tokens])))
                    margin = np.sort(lp, -1)[:, -1] - np.sort(lp, -1)[:, -2]
                    picks = lp.argmax(-1) == np.array(tokens)
                    ok = diff < TOLERANCE and bool(np.all(picks | (margin < 1e-3)))
                    worst, failures = max(worst, diff), failures + (not ok)
                    print(
                        f"{case:>11} {name:>4} vs {label:>6}: prompt of {len(prompt):>3}, max |dlogprob| {diff:.2e}, "
                        f"greedy picks {int(picks.sum())}/{len(tokens)} {'ok' if ok else 'FAILED'}"
                    )
    print(f"largest |logprob difference| {worst:.2e}; {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
