"""A consumer that falls behind the engine takes what queued meanwhile as one delta (as vLLM's output collector
does): fewer, larger stream chunks under load, the same text, tokens and logprobs."""

from __future__ import annotations

import asyncio

from capstan.runtime.sampling.sampling_params import SamplingParams

PROMPT = "The quick brown fox"


def test_a_consumer_behind_the_engine_gets_what_queued_as_one_delta(engine):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2, n=2)

    async def consume(request_id: str, pause_s: float) -> list:
        deltas = []
        async for out in engine.generate(PROMPT, params, request_id):
            deltas.append(out)
            if len(deltas) == 1:
                await asyncio.sleep(pause_s)  # the engine runs on while this consumer is away
        return deltas

    eager = asyncio.run(consume("eager", 0.0))
    behind = asyncio.run(consume("behind", 2.0))

    def joined(deltas, index):
        choices = [c for d in deltas for c in d.outputs if c.index == index]
        return (
            "".join(c.text for c in choices),
            [t for c in choices for t in c.token_ids],
            [p for c in choices for p in c.logprobs or []],
            [c.finish_reason for c in choices if c.finish_reason],
        )

    for index in (0, 1):
        text, tokens, logprobs, ends = joined(behind, index)
        assert (text, tokens, ends) == joined(eager, index)[:2] + (["length"],)
        assert len(tokens) == len(logprobs) == 48
        assert [next(iter(position)) for position in logprobs] == tokens  # each position's chosen token first
    after_pause = behind[1]
    assert sum(len(c.token_ids) for c in after_pause.outputs) > 2, "what queued during the pause came in one delta"
    assert len(behind) < len(eager)
    assert behind[-1].finished and not any(d.finished for d in behind[:-1])
