"""Model parity with Hugging Face transformers (tests/data/golden), float32, through the paged KV cache."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from golden import CASES, GOLDEN, greedy_agreement_length, log_softmax, reference, reference_logits

from capstan.runtime.attention import INVALID_SLOT, AttentionMetadata, query_blocks
from capstan.runtime.kv.cache import KVCache
from capstan.runtime.models.config import ModelConfig, UnsupportedModelError
from capstan.runtime.models.loader import load_model

PAGE = 8  # small pages so that every prompt crosses page boundaries


@eqx.filter_jit
def _jit_forward(model, tokens, meta, kv):
    hidden, kv = model(tokens, meta, kv)
    return model.logits(hidden).array, kv


def _forward(model, tokens, meta, kv):
    with jax.default_matmul_precision("float32"):  # no TF32 on GPUs: parity is to 1e-4
        return _jit_forward(model, tokens, meta, kv)


def _run(model, kv, tokens, start, pages, bucket):
    """Feeds tokens at positions start.. of one sequence whose cache lives in `pages`; pads to `bucket`."""
    n = len(tokens)
    pos = np.arange(start, start + bucket, dtype=np.int32)
    slots = np.array([pages[p // PAGE] * PAGE + p % PAGE for p in pos[:n]] + [INVALID_SLOT] * (bucket - n), np.int32)
    toks = np.zeros(bucket, np.int32)
    toks[:n] = tokens
    pos[n:] = 0
    meta = AttentionMetadata(
        positions=jnp.asarray(pos),
        slot_mapping=jnp.asarray(slots),
        token_seq=jnp.zeros(bucket, jnp.int32),
        block_tables=jnp.asarray([pages], jnp.int32),
        seq_lens=jnp.asarray([start + n], jnp.int32),
        query_blocks=jnp.asarray(query_blocks([(0, start, n)], bucket, 1, model.cfg.queries_per_kv)),
    )
    logits, kv = _forward(model, jnp.asarray(toks), meta, kv)
    return np.asarray(logits)[:n], kv


@pytest.fixture(scope="module", params=CASES)
def case(request):
    return request.param, load_model(GOLDEN / request.param), reference(request.param)


def _fresh_cache(model, n_pages):
    cfg = model.cfg
    return KVCache.allocate(cfg.num_layers, n_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, jnp.float32)


def test_teacher_forced_logprobs_match_transformers(case):
    name, model, ref = case
    for i, (prompt, cont) in enumerate(zip(ref["prompts"], ref["greedy_continuations"], strict=True)):
        tokens = prompt + cont[:-1]
        pages = list(range(1, 1 + 160 // PAGE))[::-1]  # scattered, non-contiguous pages
        logits, _ = _run(model, _fresh_cache(model, 1 + len(pages)), tokens, 0, pages, 160)
        err = np.abs(log_softmax(logits) - log_softmax(reference_logits(name, i))).max()
        assert err < 1e-4, f"{name} prompt {i}: max |logprob diff| {err}"


def test_greedy_decoding_through_the_cache_matches_transformers(case):
    name, model, ref = case
    for i, (prompt, cont) in enumerate(zip(ref["prompts"], ref["greedy_continuations"], strict=True)):
        pages = list(range(1, 1 + 160 // PAGE))
        kv = _fresh_cache(model, 1 + len(pages))
        logits, kv = _run(model, kv, prompt, 0, pages, 160)
        out = [int(np.argmax(logits[-1]))]
        while len(out) < len(cont):
            logits, kv = _run(model, kv, [out[-1]], len(prompt) + len(out) - 1, pages, 1)
            out.append(int(np.argmax(logits[-1])))
        owed = greedy_agreement_length(ref, i)
        assert out[:owed] == cont[:owed], f"{name} prompt {i}"


def test_unsupported_architecture_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="architectures=.*GPT2LMHeadModel"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})


def test_unknown_rope_scaling_type_is_refused_by_name():
    hf = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        rope_theta=1e4,
        rope_scaling={"rope_type": "yarn"},
    )
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        ModelConfig.from_hf(hf)


def test_missing_field_is_named():
    with pytest.raises(UnsupportedModelError, match="hidden_size"):
        ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 2})


def test_sharded_checkpoint_with_index_loads_the_same_weights(tmp_path):
    """A checkpoint split into two safetensors shards with model.safetensors.index.json."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    source = GOLDEN / "llama-s11"
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded, single = load_model(tmp_path), load_model(source)
    np.testing.assert_array_equal(np.asarray(sharded.lm_head.array), np.asarray(single.lm_head.array))
    np.testing.assert_array_equal(
        np.asarray(sharded.layers[2].mlp.down_proj.array), np.asarray(single.layers[2].mlp.down_proj.array)
    )


def test_missing_tensor_is_named(tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    for f in (GOLDEN / "qwen2-s12").iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="model.layers.1.self_attn.q_proj.bias"):
        load_model(tmp_path)
