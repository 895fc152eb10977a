"""Every bound on what one request may ask, in one place: the server's pydantic models, SamplingParams.validate
and the engine read them from here, so a value out of bounds is refused (HTTP 400 naming the field and the
limit) before any per-choice, per-token or device structure is built.

Where OpenAI or vLLM document a limit, it is theirs; where neither does, the cap keeps one request's memory
and device arrays bounded (docs/server.md, "Request limits", works out the worst case per request).
"""

from __future__ import annotations

# request bodies: a 128k-token prompt as a JSON list of ids is about 1 MiB; parsing a body takes up to ~12x its size for
# a moment (docs/server.md, "Request limits")
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
INT32_MAX = 2**31 - 1  # integers that reach the device are int32
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1  # seed: OpenAI's int64, or vLLM's unsigned 64-bit

# sampling
MAX_TEMPERATURE = 2.0  # OpenAI
PENALTY_RANGE = 2.0  # presence/frequency penalties in [-2, 2] (OpenAI)
MAX_REPETITION_PENALTY = 10.0
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100] (OpenAI)
MAX_LOGIT_BIAS = 300  # entries: sizes the step's bias arrays (OpenAI and vLLM document none)
MAX_LOGPROBS = 20  # vLLM's --max-logprobs default; OpenAI's top_logprobs limit
MAX_TOP_LOGPROBS = 20  # OpenAI chat's top_logprobs
# DRY (sampling/dry.py): the device reads the last DRY_WINDOW tokens and matches at most DRY_MAX_MATCH of them (one
# fixed shape; past 64 a repeat's penalty is base^62 already); llama.cpp bounds neither but truncates breakers to 40
MAX_DRY_MULTIPLIER = 100.0
MAX_DRY_BASE = 100.0  # >= 1 (llama.cpp turns DRY off below 1)
DRY_WINDOW = 1024  # dry_penalty_last_n -1 (the whole context) or larger reads this many
DRY_MAX_MATCH = 64  # also dry_allowed_length's cap
MAX_DRY_BREAKERS = 32  # dry_sequence_breakers entries
MAX_DRY_BREAKER_CHARS = 40  # each breaker (llama.cpp's MAX_CHAR_LEN)

# stopping
MAX_STOP_STRINGS = 16  # OpenAI allows 4, vLLM any number; the matcher checks each one on every token
MAX_STOP_STRING_CHARS = 1024  # the matcher holds back as many characters as the longest stop string
MAX_STOP_TOKEN_IDS = 32  # a request's own stop_token_ids
MAX_STOP_TOKEN_IDS_IN_ENGINE = 40  # with the chat template's end-of-turn ids the server adds; plus EOS ids, fits
# the step's array of ids banned while below min_tokens (48)

# request shape
MAX_PROMPTS = 256  # prompts in one /v1/completions request, each its own engine request
MAX_MESSAGES = 2048  # messages in one chat request
MAX_CONTENT_PARTS = 256  # parts in one message's content list
MAX_TOOLS = 128  # OpenAI's limit on `tools`
MAX_PARALLEL_TOOL_CALLS = 8  # calls in one answer to tool_choice required: even a bad model's array ends
MAX_NAME_CHARS = 256  # model, name, user: identifiers, not text
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs keys
MAX_GRAMMAR_CHARS = 65536  # regex or grammar text (llguidance also bounds its own work per token)
MAX_CHOICES = 1024  # guided_choice / structured_outputs.choice entries
MAX_JSON_DEPTH = 32  # nesting of free-form JSON fields (response_format, tools, chat_template_kwargs)

# embeddings and tokenization
MAX_EMBEDDING_INPUTS = 2048  # inputs in one /v1/embeddings request (OpenAI's limit); also at most --max-waiting
MAX_DETOKENIZE_TOKENS = 131072  # ids in one /detokenize request: the longest contexts served

# an HTTP request's head (request line and headers), before any route sees it: capstan serve's frontends and the
# gateway (server/header_limits.py); nginx allows 4 x 8 KiB and 60 s, Apache 100 fields
MAX_HEADER_BYTES = 65536  # request line plus headers (431 past it)
MAX_HEADER_COUNT = 100  # header fields (431 past it)
HEADER_TIMEOUT_S = 10.0  # from a connection's (or a request's) first byte to its last header (408 past it)
