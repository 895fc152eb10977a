"""A request's prompt as a replica's prefix cache names it: its token ids (from a replica's own /tokenize, which
renders chat messages with the model's chat template exactly as /v1/chat/completions does: request_cost.py's
bodies, prompt_count.py's route) and the chained hashes of its full pages (kv/page_pool.py's, for each page size
the replicas use).

What the gateway cannot name exactly is not named (None), and the request routes by prompt hashing: several
prompts in one request, tools (rendered by the template from fields /tokenize does not take), Responses API
requests, a model that is a LoRA adapter (its pages are chained from a root each replica draws itself)."""

from __future__ import annotations

import httpx

from ..kv.page_pool import PageHash, chained_page_hashes
from .request_cost import prompt_pieces

TOKENIZED_ROUTES = ("/v1/completions", "/v1/chat/completions")
TOKENIZE_TIMEOUT = httpx.Timeout(2.0)  # routing advice: a slow answer routes by hashing instead of waiting


def tokenize_body(path: str, body: dict) -> dict | list[int] | None:
    """The /tokenize body for the request's one prompt, or its token ids when it sent ids; None: not named."""
    if path not in TOKENIZED_ROUTES or body.get("tools"):
        return None
    prompt = body.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list):
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if len(prompt) == 1 and isinstance(prompt[0], list) and all(isinstance(t, int) for t in prompt[0]):
            return prompt[0]
    pieces = prompt_pieces(path, body)
    if len(pieces) != 1 or pieces[0].tokenize is None:
        return None
    return pieces[0].tokenize


async def prompt_token_ids(
    client: httpx.AsyncClient, url: str, model: str, headers: dict[str, str], path: str, body: dict
) -> list[int] | None:
    """The request's prompt token ids, as the replica at url runs them (None: not named, or it could not say)."""
    asked = tokenize_body(path, body)
    if asked is None or isinstance(asked, list):
        return asked
    try:
        answer = await client.post(
            f"{url}/tokenize", json={"model": model, **asked}, headers=headers, timeout=TOKENIZE_TIMEOUT
        )
        tokens = answer.json().get("tokens") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None


def page_hashes(tokens: list[int], page_sizes: set[int]) -> dict[int, list[PageHash]]:
    """The chained hashes of the prompt's full pages, for each page size (a base model's chain: no adapter root)."""
    return {size: chained_page_hashes(None, tokens, size) for size in page_sizes}
