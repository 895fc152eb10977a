"""The offline API as a vLLM user writes it: `from capstan import LLM, SamplingParams`, prompts in every form
vLLM takes, chat conversations, embeddings, the progress bar, and max_tokens 0 for scoring a prompt."""

import subprocess
import sys

import numpy as np
import pytest
from golden import GOLDEN

from capstan import LLM, SamplingParams

MODEL = str(GOLDEN / "qwen3-s13")  # has a chat template
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, warmup=False)


def test_every_prompt_form_gives_the_same_tokens(llm):
    ids = llm.get_tokenizer().encode("Hello there")
    forms = ["Hello there", {"prompt": "Hello there"}, {"prompt_token_ids": ids}, ids]
    outs = [llm.generate(form, GREEDY, use_tqdm=False) for form in forms]
    assert all(len(o) == 1 for o in outs)
    assert len({tuple(o[0].outputs[0].token_ids) for o in outs}) == 1
    mixed = llm.generate(forms, GREEDY, use_tqdm=False)  # one list of mixed forms, results in order
    assert [o.outputs[0].token_ids for o in mixed] == [outs[0][0].outputs[0].token_ids] * 4
    assert mixed[2].prompt_token_ids == ids


def test_llm_compiles_a_step_shape_only_when_a_batch_takes_it_and_warmup_true_compiles_them_first():
    """LLM() as vLLM's users call it costs no compilation up front (a 2-core machine's default model: ~22 s against
    ~137 s); warmup=True compiles every step shape first, as `capstan serve` does. (Shapes no other test uses, so
    jit's caches, shared by the process, start without them.)"""
    from capstan.runtime.engine.step import step_fn

    shape = dict(max_model_len=72, max_num_seqs=3, max_num_batched_tokens=40, page_size=8)
    before = step_fn._cache_size()
    llm = LLM(MODEL, **shape)
    assert step_fn._cache_size() == before
    llm.generate("Hello there", GREEDY, use_tqdm=False)
    taken = step_fn._cache_size()
    assert taken > before
    LLM(MODEL, warmup=True, **shape)
    assert step_fn._cache_size() > taken  # the shapes the one prompt did not take


def test_a_dict_without_a_prompt_is_refused_by_name(llm):
    with pytest.raises(TypeError, match=r"prompts\[1\].*'prompt' or 'prompt_token_ids'"):
        llm.generate(["fine", {"text": "no"}], use_tqdm=False)


def test_chat_takes_one_conversation_or_several(llm):
    conversation = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    one = llm.chat(conversation, GREEDY, use_tqdm=False)
    two = llm.chat([conversation, [{"role": "user", "content": "Bye"}]], GREEDY, use_tqdm=False)
    assert len(one) == 1 and len(two) == 2
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids
    rendered = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    assert one[0].prompt_token_ids == rendered


def test_progress_bar_is_on_by_default(llm, capsys):
    llm.generate(["a", "b"], GREEDY)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_max_tokens_zero_scores_the_prompt(llm):
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=0, prompt_logprobs=0, n=2), use_tqdm=False
    )[0]
    assert [(c.finish_reason, c.token_ids) for c in out.outputs] == [("length", []), ("length", [])]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    assert [next(iter(p)) for p in out.prompt_logprobs[1:]] == [6, 7, 8]
    llm.engine.pool.check_all_free()


def test_embed_gives_unit_vectors_in_prompt_order(llm):
    outs = llm.embed(["first", {"prompt_token_ids": [5, 6, 7] * 40}, "first"], use_tqdm=False)
    vectors = [np.asarray(o.outputs.embedding) for o in outs]
    assert [v.shape for v in vectors] == [(llm.engine.model.cfg.hidden_size,)] * 3
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    assert np.allclose(vectors[0], vectors[2], atol=1e-6) and not np.allclose(vectors[0], vectors[1], atol=1e-3)
    assert outs[1].prompt_token_ids == [5, 6, 7] * 40
    llm.engine.pool.check_all_free()


def test_import_capstan_operator_stays_without_jax():
    code = "import sys, capstan, capstan.operator; assert 'jax' not in sys.modules; print(capstan.__version__)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
