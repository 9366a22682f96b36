"""Structured output in the offline API, on the real default model: every sample parses and
validates (temperature 0.7, many seeds), free requests in the same batch are untouched, a grammar
that cannot finish ends with "length", and bad specs are refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from inferd.sampling.params import SamplingParams
from inferd.structured import StructuredOutputsParams
from tests.real_model import make_llm

PERSON = {
    "$defs": {
        "pet": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["cat", "dog", "fish"]},
                "age": {"type": "integer", "minimum": 0, "maximum": 20},
            },
            "required": ["kind"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "height": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "height", "pets", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}])


def test_json_schema_samples_all_validate(llm) -> None:
    params = SamplingParams(n=8, temperature=0.7, seed=7, max_tokens=80,
                            structured=StructuredOutputsParams(json=PERSON))  # fmt: skip
    [out] = llm.generate([chat(llm, "Describe a person as JSON.")], params, use_tqdm=False)
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)


def test_regex_choice_json_object_and_free_requests_in_one_batch(llm) -> None:
    free_prompts = [chat(llm, "Name a color."), "The capital of France is"]
    free = SamplingParams(temperature=0, max_tokens=8)
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free, use_tqdm=False)]

    regex = r"[A-Z][a-z]{1,6} [0-9]{2}"
    choices = ["red", "green", "blue"]
    prompts = [chat(llm, "Name and age?"), chat(llm, "Favourite color?"), chat(llm, "Any JSON."),
               *free_prompts]  # fmt: skip
    params = [
        SamplingParams(n=6, temperature=0.7, seed=1, max_tokens=12,
                       structured=StructuredOutputsParams(regex=regex)),
        SamplingParams(n=6, temperature=0.7, seed=2, max_tokens=4,
                       structured=StructuredOutputsParams(choice=choices)),
        SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=40,
                       structured=StructuredOutputsParams(json_object=True)),
        free,
        free,
    ]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs[0].outputs:
        assert re.fullmatch(regex, o.text), o.text
        assert o.finish_reason == "stop"
    assert {o.text for o in outs[1].outputs} <= set(choices)
    for o in outs[2].outputs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.finish_reason == "length" and o.text.startswith("{")
    assert [o.outputs[0].token_ids for o in outs[3:]] == alone


def test_grammar_that_cannot_finish_ends_with_length(llm) -> None:
    params = SamplingParams(temperature=0.7, seed=0, max_tokens=5,
                            structured=StructuredOutputsParams(regex="(ab){40}"))  # fmt: skip
    [out] = llm.generate([chat(llm, "Go.")], params, use_tqdm=False)
    o = out.outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 5
    assert re.fullmatch(r"(ab)*a?", o.text), o.text


def test_ebnf_grammar(llm) -> None:
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    params = SamplingParams(n=4, temperature=0.7, seed=4, max_tokens=6,
                            structured=StructuredOutputsParams(grammar=grammar))  # fmt: skip
    [out] = llm.generate([chat(llm, "Will it rain?")], params, use_tqdm=False)
    for o in out.outputs:
        assert re.fullmatch(r"yes|no|maybe [0-9]", o.text), o.text


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"json": {"type": "strin"}}, "strin"),
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json": {"$ref": "#/$defs/missing"}}, "missing"),
        ({"regex": "a(b"}, "regex"),
        ({"grammar": "root ::= ("}, "grammar"),
    ],
)
def test_bad_specs_are_refused_by_name(llm, spec, words) -> None:
    params = SamplingParams(max_tokens=4, structured=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate(["hi"], params, use_tqdm=False)
    llm.engine.check_no_leaks()


def test_spec_needs_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
