"""Structured output through xgrammar: a random-weight model can only comply through the masks."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import PROMPTS
from metrale.cluster.params import GrammarSpec, RequestError, SamplingParams
from metrale.deploy.llm import LLM

SCHEMAS = {
    "enum": {"enum": ["red", "green", "blue"]},
    "object": {"type": "object", "additionalProperties": False,
               "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "ok": {"type": "boolean"}},
               "required": ["name", "age", "ok"]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "minItems": 2, "maxItems": 4},
    "nested": {"type": "object", "additionalProperties": False, "required": ["tags", "level"],
               "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                       "minItems": 1, "maxItems": 3},
                              "level": {"enum": [1, 2, 3]}}},
}


@pytest.fixture(scope="module")
def engines(checkpoint):
    model_dir = checkpoint("qwen3_5")
    return {m: LLM(model_dir, device="cpu", speculative_method=m, adaptive_drafts=False)
            for m in ("none", "mtp")}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schemas_hold_with_and_without_speculation(engines, name):
    schema = SCHEMAS[name]
    spec = GrammarSpec("json_schema", json.dumps(schema))
    greedy = {}
    for method, llm in engines.items():
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_tokens=100, temperature=temperature, seed=7, grammar=spec)
            for out in llm.generate(PROMPTS[:3], params):
                assert out.finish_reason == "stop", out.text
                jsonschema.validate(json.loads(out.text), schema)
                assert ", " not in out.text and ": " not in out.text    # compact JSON
                if temperature == 0.0:
                    greedy.setdefault(method, []).append(out.token_ids)
    assert greedy["mtp"] == greedy["none"]
    stats = engines["mtp"].scheduler.stats
    assert stats.rounds > 0
    print(f"{name}: MTP acceptance with constraints {stats.as_dict()}")


def test_json_object_regex_and_ebnf(engines):
    llm = engines["mtp"]
    obj = llm.generate(["x"], SamplingParams(max_tokens=60, temperature=1.0, seed=1,
                                             grammar=GrammarSpec("json_object")))[0]
    assert obj.text.startswith("{")      # free-form strings may run past max_tokens
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    date = llm.generate(["x"], SamplingParams(max_tokens=30, temperature=1.0, seed=2,
                                              grammar=GrammarSpec("regex", r"\d{4}-\d{2}-\d{2}")))[0]
    assert __import__("re").fullmatch(r"\d{4}-\d{2}-\d{2}", date.text), date.text
    ebnf = 'root ::= "yes" | "no" | "maybe"'
    ans = llm.generate(["x"], SamplingParams(max_tokens=10, temperature=1.0, seed=3,
                                             grammar=GrammarSpec("ebnf", ebnf)))[0]
    assert ans.text in ("yes", "no", "maybe")


@pytest.mark.parametrize("spec, message", [
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec("json_schema", json.dumps({"type": "nonsense"})), "invalid json schema"),
    (GrammarSpec("regex", "(unclosed"), "invalid regex"),
    (GrammarSpec("ebnf", "root ::= "), "invalid ebnf"),
])
def test_invalid_grammars_are_refused_alone(engines, spec, message):
    llm = engines["none"]
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=4, grammar=spec),
                                     SamplingParams(max_tokens=4, temperature=0)])
    assert message in outs[0].error and outs[0].error.startswith("response_format")
    assert outs[1].error is None and len(outs[1].token_ids) == 4
    with pytest.raises(RequestError, match="not one of json_object"):
        GrammarSpec("yaml")


@pytest.mark.parametrize("method", ["dflash", "ngram", "self"])
def test_every_proposer_keeps_the_schema(checkpoint, dflash_drafter, engines, method):
    schema, model_dir = SCHEMAS["nested"], checkpoint("qwen3_5")
    llm = LLM(model_dir, device="cpu", speculative_method=method, adaptive_drafts=False,
              drafter=dflash_drafter("qwen3_5") if method == "dflash" else None)
    spec = GrammarSpec("json_schema", json.dumps(schema))
    for temperature in (0.0, 1.0):
        outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=100, temperature=temperature,
                                                         seed=9, grammar=spec))
        for out in outs:
            jsonschema.validate(json.loads(out.text), schema)
        if temperature == 0.0:
            plain = engines["none"].generate(PROMPTS[:2], SamplingParams(
                max_tokens=100, temperature=0.0, seed=9, grammar=spec))
            assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.scheduler.stats.drafts_proposed > 0
