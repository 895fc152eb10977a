"""GGUF checkpoints: the golden Hugging Face checkpoints written as GGUF the way llama.cpp converts them load into
the same model, config and tokenizer as their folders; architectures we cannot serve are refused by name."""

import jax
import numpy as np
import pytest
from gguf_files import write_gguf
from golden import CASES, GOLDEN

from capstan.runtime.models.checkpoint_path import resolve_checkpoint
from capstan.runtime.models.config import UnsupportedModelError
from capstan.runtime.models.loader import load_model
from capstan.runtime.tokenizer import Tokenizer

TEXTS = ["Hello world!", "def f(x):\n    return x  # 42", "  spaces\n\n\ttabs 😀 中文 <|begin_of_text|>"]


@pytest.fixture(scope="module", params=CASES)
def converted(request, tmp_path_factory):
    folder = GOLDEN / request.param
    return folder, write_gguf(folder, tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf")


def test_gguf_loads_the_same_weights_and_config_as_the_folder(converted):
    folder, file = converted
    expected, got = load_model(folder, "float32"), load_model(file, "float32")
    for field in (
        "architecture",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "layer_types",
        "rope",
        "sliding_window",
        "attention_bias",
        "qk_norm",
        "activation",
        "attention_scale",
        "tie_word_embeddings",
        "rms_norm_eps",
    ):
        assert getattr(got.cfg, field) == pytest.approx(getattr(expected.cfg, field)), field
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-6)


def test_gguf_tokenizer_matches_the_folder_tokenizer(converted):
    folder, file = converted
    expected, got = Tokenizer.from_pretrained(folder), Tokenizer.from_pretrained(file)
    for text in TEXTS:
        assert got.encode(text) == expected.encode(text), text
        ids = expected.encode(text)
        assert got.decode(ids) == expected.decode(ids)
        assert got.decode(ids, skip_special_tokens=False) == expected.decode(ids, skip_special_tokens=False)
    chat = [{"role": "user", "content": "Hi"}]
    assert got.apply_chat_template(chat) == expected.apply_chat_template(chat)
    assert got.eos_token_id == expected.eos_token_id


def test_other_architectures_are_refused_by_name(tmp_path):
    file = write_gguf(GOLDEN / "llama-s11", tmp_path / "mamba.gguf", architecture="mamba")
    with pytest.raises(UnsupportedModelError, match="general.architecture='mamba' is not supported"):
        load_model(file)


def test_a_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(UnsupportedModelError, match="no such checkpoint folder or .gguf file"):
        resolve_checkpoint(tmp_path / "absent.gguf")


def test_a_later_read_loads_the_index_of_the_same_file(converted, tmp_path, monkeypatch):
    """The first read parses the file and leaves an index; the next process loads it instead (the same fields,
    tensor types, shapes and bytes); a file changed since, or a broken index, is parsed again."""
    import os

    import gguf

    from capstan.runtime.models import gguf_index
    from capstan.runtime.models.gguf_checkpoint import read_gguf

    _, file = converted
    monkeypatch.setattr(gguf_index, "GGUF_INDEXES", tmp_path / "indexes")

    def fresh_read():
        read_gguf.cache_clear()  # as a new process would
        return read_gguf(str(file))

    parsed, indexed = fresh_read(), fresh_read()
    assert isinstance(parsed, gguf.GGUFReader) and isinstance(indexed, gguf_index.GGUFIndex)
    assert {k: f.contents() for k, f in indexed.fields.items()} == {k: f.contents() for k, f in parsed.fields.items()}
    for a, b in zip(parsed.tensors, indexed.tensors, strict=True):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.data.dtype) == (
            b.name,
            b.tensor_type,
            b.shape.tolist(),
            b.data.dtype,
        )
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    stat = file.stat()
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert isinstance(fresh_read(), gguf.GGUFReader)  # changed: parsed again (and indexed again)
    for index in (tmp_path / "indexes").glob("*.json"):  # broken (an offset outside the file): parsed again
        index.write_text('{"fields": {}, "tensors": [{"offset": -1}]}')
    assert isinstance(fresh_read(), gguf.GGUFReader)
    read_gguf.cache_clear()
