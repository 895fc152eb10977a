"""Tokenizer against transformers' own output, recorded in the golden checkpoints."""

import json
from pathlib import Path

import pytest

from capstan.runtime.tokenizer import Tokenizer

GOLDEN = Path(__file__).parent / "data" / "golden"
CHECKPOINTS = ["llama-s11", "qwen2-s12", "qwen3-s13", "gemma3-s14"]


def reference(name: str) -> dict:
    return json.loads((GOLDEN / name / "reference.json").read_text())


@pytest.fixture(params=CHECKPOINTS)
def checkpoint(request) -> tuple[Tokenizer, dict]:
    return Tokenizer.from_pretrained(GOLDEN / request.param), reference(request.param)


def test_encode_matches_transformers(checkpoint):
    tok, ref = checkpoint
    for case in ref["encode"]:
        assert tok.encode(case["text"]) == case["ids"]


def test_decode_round_trips(checkpoint):
    tok, ref = checkpoint
    for case in ref["encode"]:
        assert tok.decode(case["ids"]) == case["text"]
        assert tok.decode(tok.encode(case["text"], add_special_tokens=False)) == case["text"]


def test_chat_template_matches_transformers(checkpoint):
    tok, ref = checkpoint
    for case in ref["chat"]:
        assert tok.apply_chat_template(case["messages"]) == case["text"]
        assert tok.apply_chat_template(case["messages"], tokenize=True) == case["ids"]


def test_text_parts_render_like_a_string(checkpoint):
    tok, ref = checkpoint
    case = ref["chat"][0]
    content = case["messages"][0]["content"]
    parts = [{"type": "text", "text": content[:5]}, {"type": "text", "text": content[5:]}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == case["text"]


def test_special_token_ids():
    llama = Tokenizer.from_pretrained(GOLDEN / "llama-s11")
    assert (llama.bos_token_id, llama.eos_token_id, llama.pad_token_id) == (507, 511, 511)
    assert llama.eos_token_ids == frozenset({511})
    assert llama.vocab_size == 512
    assert llama.convert_ids_to_tokens([507, 511]) == ["<|begin_of_text|>", "<|eot_id|>"]
    qwen = Tokenizer.from_pretrained(GOLDEN / "qwen3-s13")
    assert qwen.bos_token_id is None and qwen.eos_token_ids == frozenset({511})
    assert qwen.id_to_piece(511) == "<|im_end|>"


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
)


def copy_checkpoint(name: str, dest: Path, drop: tuple[str, ...] = ()) -> Path:
    for f in TOKENIZER_FILES:
        if f not in drop:
            (dest / f).write_bytes((GOLDEN / name / f).read_bytes())
    return dest


def test_eos_ids_are_the_union_of_all_configs(tmp_path):
    path = copy_checkpoint("qwen3-s13", tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [511, 509]}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 510}))
    assert Tokenizer.from_pretrained(path).eos_token_ids == frozenset({509, 510, 511})


def test_template_from_tokenizer_config_and_named_list(tmp_path):
    path = copy_checkpoint("qwen3-s13", tmp_path, drop=("chat_template.jinja",))
    template = (GOLDEN / "qwen3-s13" / "chat_template.jinja").read_text()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    case = reference("qwen3-s13")["chat"][1]
    assert Tokenizer.from_pretrained(path).apply_chat_template(case["messages"]) == case["text"]


def test_template_features_transformers_provides(tmp_path):
    path = copy_checkpoint("qwen3-s13", tmp_path)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
        "{% if flavour == 'bad' %}{{ raise_exception('bad flavour') }}{% endif %}{{ strftime_now('%Y')[:2] }}"
    )
    tok = Tokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "ü<b>"}, {"role": "user", "content": "second"}]
    assert tok.apply_chat_template(messages, flavour="good") == '{"role": "user", "content": "ü<b>"}20'
    with pytest.raises(Exception, match="bad flavour"):
        tok.apply_chat_template(messages, flavour="bad")


def test_checkpoint_without_chat_template_says_so(tmp_path):
    path = copy_checkpoint("qwen3-s13", tmp_path, drop=("chat_template.jinja",))
    with pytest.raises(ValueError, match="has no chat template"):
        Tokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_add_bos_and_eos_flags_rebuild_special_tokens(tmp_path):
    path = copy_checkpoint("llama-s11", tmp_path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(add_bos_token=False, add_eos_token=True)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(path)
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False) + [511]
