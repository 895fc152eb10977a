"""Writes Capstan's embedded default checkpoint: a tiny Llama-architecture model with RANDOM weights and a
byte-level BPE tokenizer trained on Python's own docstrings, in the Hugging Face layout.

It exists so that `capstan serve` works on a machine with no network; its text is gibberish.
Usage: python -m capstan.runtime.models.default_checkpoint runtime/default_model"""

from __future__ import annotations

import json
import pkgutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

VOCAB = 4096
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    dtype="bfloat16",
)


def corpus():
    import importlib

    for mod in sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_"))[:200]:
        try:
            doc = importlib.import_module(mod).__doc__
        except Exception:
            continue
        if doc:
            yield doc


def write_tokenizer(out: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer)
    tok.add_special_tokens(SPECIALS)
    ids: dict[str, int] = {}
    for special in SPECIALS:
        token_id = tok.token_to_id(special)
        assert token_id is not None, f"{special} was just added to the vocabulary"
        ids[special] = token_id
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", ids["<|begin_of_text|>"])]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "pad_token": "<|end_of_text|>",
                "model_max_length": CONFIG["max_position_embeddings"],
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=1,
        )
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return ids


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """The tensors runtime/models/loader.py reads for a Llama or Qwen3 config.json (benchmarks write them too)."""
    E, I, V = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    H, KV = hf["num_attention_heads"], hf["num_key_value_heads"]
    D = hf.get("head_dim") or E // H
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,)}
    if not hf.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, E)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (H * D, E),
                p + "self_attn.k_proj.weight": (KV * D, E),
                p + "self_attn.v_proj.weight": (KV * D, E),
                p + "self_attn.o_proj.weight": (E, H * D),
                p + "mlp.gate_proj.weight": (I, E),
                p + "mlp.up_proj.weight": (I, E),
                p + "mlp.down_proj.weight": (E, I),
                p + "input_layernorm.weight": (E,),
                p + "post_attention_layernorm.weight": (E,),
            }
        )
        if hf["architectures"][0] == "Qwen3ForCausalLM":
            shapes.update({p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
    return shapes


def write_weights(out: Path, seed: int = 0) -> None:
    import ml_dtypes

    c = CONFIG
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(c)
    tensors = {}
    for name, shape in shapes.items():
        values = (
            np.ones(shape) if name.endswith("norm.weight") else rng.normal(0.0, 0.5 if "embed" in name else 0.08, shape)
        )
        tensors[name] = values.astype(ml_dtypes.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def main(out: str) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(path)
    config = dict(
        CONFIG,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<|eot_id|>"],
        pad_token_id=ids["<|end_of_text|>"],
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": [ids["<|eot_id|>"], ids["<|end_of_text|>"]]},
            indent=1,
        )
    )
    write_weights(path)
    (path / "README.md").write_text(
        "Capstan's embedded default: random weights (its output is gibberish), made by "
        "`python -m capstan.runtime.models.default_checkpoint`.\n"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent.parent / "default_model"))
