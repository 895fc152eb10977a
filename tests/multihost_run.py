"""One host of tests/test_multihost.py: the golden llama-s11 over every process's CPU device, greedy and seeded.

The leader (JAX_PROCESS_ID=0) prints its tokens as JSON; followers follow. With JAX_NUM_PROCESSES unset it runs
alone, on one device: the reference."""

import json
import sys
from pathlib import Path

from capstan.runtime.engine.lockstep import LockstepEngine
from capstan.runtime.parallel.distributed import initialize_from_env

GOLDEN = Path(__file__).parent / "data" / "golden"


def main(case: str, max_tokens: int) -> None:
    import jax

    from capstan.runtime.config import EngineConfig
    from capstan.runtime.sampling.sampling_params import SamplingParams

    many = initialize_from_env(timeout_s=60)
    engine = LockstepEngine(
        EngineConfig(
            model=str(GOLDEN / case),
            max_model_len=256,
            max_num_seqs=4,
            decode_steps=4,  # past 8 tokens, decode dispatches are queued ahead (multi_step.py)
            max_num_batched_tokens=32,
            page_size=4,
            dtype="float32",
            warmup=False,
            tensor_parallel_size=jax.device_count(),
        )
    )
    if not engine.is_leader:
        engine.follow()
        return
    prompts = json.loads((GOLDEN / case / "reference.json").read_text())["prompts"]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    seeded = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", p, greedy)
    engine.add_request("s", prompts[0], seeded)
    tokens: dict[str, list] = {}
    logprobs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            o = out.outputs[0]
            tokens.setdefault(out.request_id, []).extend(o.token_ids)
            logprobs.setdefault(out.request_id, []).extend(
                lp[t].logprob
                for lp, t in zip(o.logprobs or [], o.token_ids, strict=False)  # none without logprobs
            )
    if many:
        engine.stop_followers()
    print(json.dumps({"devices": jax.device_count(), "tokens": tokens, "logprobs": logprobs}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8)
