"""Structured outputs through the engine: whatever the model (here random weights), the output matches the
grammar: JSON that validates against its schema (nested objects, arrays, enums, bounded numbers, optional
fields, $ref), a regex, one of the choices; an invalid grammar is refused naming the field."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from golden import GOLDEN

from capstan.runtime.engine.llm import LLM
from capstan.runtime.sampling.grammar import StructuredOutput
from capstan.runtime.sampling.sampling_params import InvalidRequestError, SamplingParams

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_arrays_enums": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog", "fish"]},
            "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3},
            "owner": {
                "type": "object",
                "properties": {"name": NAME, "verified": {"type": "boolean"}},
                "required": ["name", "verified"],
                "additionalProperties": False,
            },
            "score": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["kind", "tags", "owner", "score"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": NAME},
        "required": ["id"],
        "additionalProperties": False,
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}, {"type": "null"}]}
        },
        "required": ["value"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def llm():
    return LLM(str(GOLDEN / "llama-s11"), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64)


def generate(llm, structured: StructuredOutput, n=1, temperature=0.0, max_tokens=300, prompt="Answer: "):
    params = SamplingParams(structured=structured, n=n, temperature=temperature, max_tokens=max_tokens, seed=3)
    out = llm.generate(prompt, params)[0]
    return [(o.text, o.finish_reason) for o in out.outputs]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_always_validates(llm, name):
    schema = SCHEMAS[name]
    for text, reason in generate(llm, StructuredOutput("json", schema), n=3, temperature=1.0):
        assert reason == "stop", text  # the grammar ended it: only EOS was left
        jsonschema.validate(json.loads(text), schema)


def test_any_json_object(llm):
    # A free-form object has no bound a random model must reach: like OpenAI's JSON mode, an output cut by
    # max_tokens says so (finish_reason "length"); every output that ended parses.
    outputs = generate(llm, StructuredOutput("json_object"), n=4, temperature=0.8, max_tokens=400)
    for text, reason in outputs:
        assert text.startswith("{") and reason in ("stop", "length")
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text


def test_regex_and_choice(llm):
    for text, reason in generate(llm, StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"), n=3, temperature=1.0):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text) and reason == "stop"
    choices = ["yes", "no", 'maybe "so"']
    texts = {text for text, _ in generate(llm, StructuredOutput("choice", choices), n=6, temperature=1.5)}
    assert texts <= set(choices)


def test_unconstrained_requests_in_the_same_batch_are_unchanged(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    alone = llm.generate("The same prompt", plain)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["The same prompt", "Answer: "],
        [plain, SamplingParams(structured=StructuredOutput("json", SCHEMAS["flat"]), max_tokens=100)],
    )
    assert mixed[0].outputs[0].token_ids == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["flat"])


@pytest.mark.parametrize("room", [None, 3])
def test_the_decode_pipeline_matches_one_step_at_a_time(llm, monkeypatch, room):
    """Batches with grammars decode several steps per engine step (forward, then sampling with masks computed
    meanwhile); tokens, logprobs and finish reasons are those of stepping one token at a time, also when a batch
    with rows free takes fewer steps (room=3: decode_steps_with_room)."""
    if room is not None:
        llm = LLM(
            str(GOLDEN / "llama-s11"),
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            decode_steps_with_room=room,
        )
    constrained = [
        StructuredOutput("json", SCHEMAS["refs"]),
        StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"),
        StructuredOutput("json_object"),
    ]
    params = [
        SamplingParams(structured=s, temperature=t, seed=7, max_tokens=60, logprobs=2)
        for s in constrained
        for t in (0.0, 1.0)
    ]
    params += [SamplingParams(temperature=t, seed=7, max_tokens=40, ignore_eos=True, logprobs=2) for t in (0.0, 1.0)]
    prompts = [f"Answer {i}: " for i in range(len(params))]
    one_step = LLM(
        str(GOLDEN / "llama-s11"), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, decode_steps=1
    )
    single = one_step.generate(prompts, params, use_tqdm=False)
    runs = []
    pipeline = llm.engine.multi_step._pipeline
    monkeypatch.setattr(llm.engine.multi_step, "_pipeline", lambda *a: runs.append(a[2]) or pipeline(*a))
    piped = llm.generate(prompts, params, use_tqdm=False)
    assert len(runs) >= 2  # the batch did decode through the pipeline
    assert room is None or room in runs  # a batch with rows free took the shorter pipeline
    for a, b in zip(single, piped, strict=True):
        (x,), (y,) = a.outputs, b.outputs
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        assert [next(iter(lp)) for lp in x.logprobs] == [next(iter(lp)) for lp in y.logprobs]
        for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
            assert [v.logprob for v in lx.values()] == pytest.approx([v.logprob for v in ly.values()], abs=1e-4)


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput("regex", "(unclosed", param="structured_outputs.regex"),
        StructuredOutput(
            "json",
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
            param="response_format.json_schema.schema",
        ),
        StructuredOutput("json", "{not json", param="guided_json"),
        StructuredOutput("grammar", "start: undefined_rule", param="structured_outputs.grammar"),
    ],
)
def test_an_invalid_grammar_is_refused_naming_the_field(llm, structured):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.validate(SamplingParams(structured=structured))
    assert e.value.param == structured.param and str(e.value).startswith(structured.param)
