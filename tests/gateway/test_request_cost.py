"""request_cost.py: the fields a budget reads, by the server's rules, and a request's worst case in tokens."""

from __future__ import annotations

import pytest

from capstan.runtime.gateway.request_cost import generation_fields, prompt_pieces, worst_case
from capstan.runtime.server.error_body import APIError

CHAT = "/v1/chat/completions"


def test_fields_are_read_as_the_server_reads_them():
    assert generation_fields("/v1/responses", {"stream": "false"}).stream is False
    fields = generation_fields(CHAT, {"stream": "true", "stream_options": {"include_usage": "false"}})
    assert fields.stream and not fields.stream_options.include_usage
    assert generation_fields("/v1/completions", {"n": "3"}).n == 3
    assert generation_fields("/v1/embeddings", {"stream": "garbage"}) is None  # embeddings read no stream field
    with pytest.raises(APIError) as error:
        generation_fields(CHAT, {"stream": "maybe"})
    assert error.value.status == 400 and error.value.param == "stream"


def test_the_worst_case_is_the_prompt_plus_every_choices_limit_within_the_context():
    def cost(path, body, prompts, context=1024):
        return worst_case(path, generation_fields(path, body), prompts, context)

    assert cost("/v1/completions", {"max_tokens": 10}, [7]) == 17
    assert cost("/v1/completions", {"max_tokens": 10, "n": 3}, [7]) == 7 + 30  # usage counts a prompt once
    assert cost("/v1/completions", {"max_tokens": 10}, [7, 5]) == 17 + 15  # a list of prompts: each
    assert cost(CHAT, {"max_tokens": 99, "max_completion_tokens": 10}, [7]) == 17  # the newer field wins
    assert cost(CHAT, {}, [24]) == 1024  # no limit: up to the end of the context
    assert cost(CHAT, {"n": 2}, [24]) == 24 + 2 * 1000
    assert cost(CHAT, {"max_tokens": 5000}, [24]) == 1024  # the context caps a choice
    assert cost("/v1/responses", {"max_output_tokens": 8, "n": 4}, [3]) == 11  # Responses has one choice
    assert worst_case("/v1/embeddings", None, [3, 4], 1024) == 7


def test_prompts_are_pieces_to_count_by_route():
    [ids] = prompt_pieces("/v1/completions", {"prompt": [1, 2, 3]})
    assert ids.tokens == 3 and ids.tokenize is None
    texts = prompt_pieces("/v1/embeddings", {"input": ["a", [4, 5]]})
    assert [(p.tokens, p.tokenize) for p in texts] == [(None, {"prompt": "a"}), (2, None)]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    [chat] = prompt_pieces(CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert chat.tokenize["messages"] == [{"role": "user", "content": "hi"}] and chat.extra > 40  # tools by bytes
    [responses] = prompt_pieces("/v1/responses", {"input": "hi", "instructions": "be brief"})
    assert responses.tokenize["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert prompt_pieces("/tokenize", {"prompt": "hi"}) == []  # charges no tokens
