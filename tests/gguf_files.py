"""Writes a Hugging Face checkpoint folder (tests/data/golden) as a float32 GGUF file the way llama.cpp's
convert_hf_to_gguf.py does: its metadata keys, its tensor names, Q/K rows permuted for `llama`, Gemma norms + 1."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

GOLDEN_TOKENIZER_CASE = "llama-s11"  # its byte-level BPE, written with each split regex (tokenizer.ggml.pre)
GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GEMMA3_LAYER = LAYER | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs become adjacent rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    folder: Path, out: Path, architecture: str | None = None, pre: str = "gpt-2", q8_0: bool = False
) -> Path:
    """q8_0: the linear weights quantized to llama.cpp's Q8_0 by gguf-py (as `llama-quantize ... Q8_0` leaves
    them), everything else float32."""
    hf = json.loads((folder / "config.json").read_text())
    arch = architecture or GGUF_ARCH[hf["architectures"][0]]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    rope = hf["rope_parameters"]
    if arch == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_sliding_window(hf["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in hf["layer_types"]])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    _write_tokenizer(w, folder, hf, pre)
    tensors = load_file(str(folder / "model.safetensors"))
    layer_names = GEMMA3_LAYER if arch == "gemma3" else LAYER
    for name, t in tensors.items():
        if name.endswith("norm.weight") and arch == "gemma3":
            t = t + 1.0
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = permute_rows(t, heads if "q_proj" in name else kv_heads)
        t = np.ascontiguousarray(t, np.float32)
        if q8_0 and name.endswith("_proj.weight"):
            w.add_tensor(
                _gguf_name(name, layer_names),
                gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            w.add_tensor(_gguf_name(name, layer_names), t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_name(name: str, layer_names: dict[str, str]) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, i, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{layer_names[module]}.{kind}"


def _write_tokenizer(w: gguf.GGUFWriter, folder: Path, hf: dict, pre: str) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp stores it (the golden checkpoints use GPT-2's split: `pre`
    names another split for the regex tests)."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {a["content"]: a["id"] for a in tok["added_tokens"]}
    tokens: list[str | None] = [None] * (max([*vocab.values(), *special.values()]) + 1)
    for t, i in {**vocab, **special}.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    names = [t for t in tokens if t is not None]
    assert len(names) == len(tokens), "every id below the largest has a token"
    w.add_token_list(names)
    w.add_token_types(
        [gguf.TokenType.CONTROL if i in special.values() else gguf.TokenType.NORMAL for i in range(len(names))]
    )
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    if hf.get("bos_token_id") is not None:
        w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"] if isinstance(hf["eos_token_id"], int) else hf["eos_token_id"][0])
    single = (tok.get("post_processor") or {}).get("single") or [{}]
    w.add_add_bos_token("SpecialToken" in single[0])
    template = folder / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text())


SPM_PIECES = [
    "\u2581",
    *"abcdefghijklmnopqrstuvwxyzT,.",
    "\u2581t",
    "he",
    "\u2581the",
    "in",
    "\u2581a",
    "er",
    "on",
    "\u2581in",
    "ing",
    "\u2581th",
    "an",
    "re",
    "\u2581s",
    "at",
    "en",
    "\u2581o",
    "\u2581of",
    "\u2581an",
    "\u2581and",
    "ed",
    "\u2581w",
    "is",
    "\u2581is",
    "it",
    "\u2581it",
    "or",
    "\u2581T",
    "\u2581The",
    "ll",
    "\u2581\u2581",
    "\u2581\u2581\u2581\u2581",
]


def write_toy_spm_gguf(out: Path, add_space_prefix: bool = True) -> Path:
    """A vocab-only `llama` GGUF with a SentencePiece tokenizer (made-up scores, byte fallback), as Llama 2 and
    Gemma files store theirs."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL] * len(SPM_PIECES)
    )
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    w = gguf.GGUFWriter(str(out), "llama")
    for key, value in (
        ("block_count", 1),
        ("context_length", 64),
        ("embedding_length", 8),
        ("feed_forward_length", 8),
        ("attention.head_count", 1),
    ):
        w.add_uint32(f"llama.{key}", value)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
