"""A request's prompt tokens, counted by a replica of its model with vLLM's /tokenize (the server renders chat
messages there exactly as /v1/chat/completions does), for the budget's worst case (request_cost.py). Only requests
of clients with a token budget pay this round trip. A prompt the replica cannot count (it refuses it, or fails) is
reserved as the model's whole context, the most any one prompt can be."""

from __future__ import annotations

import asyncio

import httpx

from .request_cost import PromptPiece

MAX_COUNTED = 64  # prompts of one request counted one by one; beyond these each reserves the whole context
CONCURRENT_COUNTS = 8
COUNT_TIMEOUT = httpx.Timeout(10.0)


async def count_prompts(
    client: httpx.AsyncClient, url: str, model: str, headers: dict[str, str], pieces: list[PromptPiece]
) -> tuple[list[int], int]:
    """Each piece's tokens (an upper bound), and the model's context length (max_model_len)."""
    gate = asyncio.Semaphore(CONCURRENT_COUNTS)

    async def tokenize(body: dict) -> tuple[int | None, int | None]:
        async with gate:
            try:
                answer = await client.post(
                    f"{url}/tokenize", json={"model": model, **body}, headers=headers, timeout=COUNT_TIMEOUT
                )
                document = answer.json() if answer.status_code == 200 else {}
            except (httpx.HTTPError, ValueError):
                return None, None
        count, context = document.get("count"), document.get("max_model_len")
        return (count if isinstance(count, int) else None), (context if isinstance(context, int) else None)

    to_count = [p.tokenize for p in pieces if p.tokens is None and p.tokenize is not None][:MAX_COUNTED]
    if not to_count:
        to_count = [{"prompt": ""}]  # token ids only: ask for the context length alone
    answers = await asyncio.gather(*(tokenize(body) for body in to_count))
    contexts = [context for _, context in answers if context is not None]
    if not contexts:
        raise LookupError(f"no replica of `{model}` answered /tokenize, to count the prompt against the budget")
    max_model_len = max(contexts)
    counts = iter(answers)
    tokens = []
    for piece in pieces:
        if piece.tokens is not None:
            counted: int | None = piece.tokens
        elif piece.tokenize is not None:
            counted = next(counts, (None, None))[0]
        else:
            counted = 0
        tokens.append(max_model_len if counted is None else min(counted + piece.extra, max_model_len))
    return tokens, max_model_len
