"""The post-processor that adds BOS/EOS around an encoded text, for the Hugging Face and GGUF tokenizers alike."""

from __future__ import annotations

import tokenizers
from tokenizers.processors import TemplateProcessing


def bos_eos_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> TemplateProcessing:
    """The post-processor transformers builds when tokenizer_config.json sets add_bos_token / add_eos_token."""

    def segment(sequence: str, type_id: int) -> list[str]:
        return [f"{t}:{type_id}" for t in (bos, sequence, eos) if t]

    single, pair = segment("$A", 0), segment("$A", 0) + segment("$B", 1)
    special = [(t, backend.token_to_id(t)) for t in {bos, eos} if t]
    return TemplateProcessing(single=single, pair=pair, special_tokens=special)
