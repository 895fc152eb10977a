"""Named model shapes for benchmarks: Hugging Face configs of real models, built with random weights."""

from capstan.runtime.models.config import ModelConfig

_LLAMA_32_1B = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    rope_theta=500000.0,
    bos_token_id=128000,
    eos_token_id=128001,
)
_LLAMA_3_8B = dict(
    _LLAMA_32_1B,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    head_dim=128,
    tie_word_embeddings=False,
    rope_scaling=None,
)
_LLAMA_3_70B = dict(
    _LLAMA_3_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)
_QWEN3_06B = dict(
    architectures=["Qwen3ForCausalLM"],
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    eos_token_id=151645,
)
_TINY = dict(
    _LLAMA_32_1B,
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)

SHAPES = {
    "tiny": _TINY,
    "qwen3-0.6b": _QWEN3_06B,
    "llama-3.2-1b": _LLAMA_32_1B,
    "llama-3-8b": _LLAMA_3_8B,
    "llama-3-70b": _LLAMA_3_70B,
}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise SystemExit(f"--shape {name!r}: choose one of {', '.join(SHAPES)}")
    return ModelConfig.from_hf({k: v for k, v in SHAPES[name].items() if v is not None})
