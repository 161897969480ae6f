"""Structured output under speculation (specdec_core/structured/): a tiny random target behind
SmolLM2's tokenizer, so nothing but the grammar shapes its output. Every output is valid, for
every drafter and every policy, lossy ones included; greedy output is the same whichever drafter
proposes; the grammar's state rolls back with rejected drafts; grammars compile once."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import torch

from specdec_core import GenerationRequest, ModelSpec, SpecdecError, SpeculativeEngine
from specdec_core.api.sampling import SamplingParams
from specdec_core.loop.stage_types import DraftBlock, TargetBlock
from specdec_core.models.loader import load_tokenizer
from specdec_core.structured.constraint_spec import StructuredOutput
from specdec_core.structured.grammar_state import GrammarState

from helpers.tiny_models import perturbed_copy, tiny_llama, tiny_profile

pytestmark = pytest.mark.needs_smollm2  # SmolLM2's tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]}},
            "required": ["kind"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "pet"],
    "additionalProperties": False,
}
JSON = {"json_schema": PERSON, "disable_any_whitespace": True}  # a random model would pad with spaces
LOSSY = [
    ("fly", {"theta": 0.0, "window": 0}, 0.0),
    ("easd", {}, 0.8),
    ("ears", {}, 0.8),
    ("typical", {}, 0.8),
    ("rejection", {}, 0.8),
]


@pytest.fixture(scope="module")
def engine():
    tokenizer = load_tokenizer(ModelSpec())
    target = tiny_llama(seed=3, vocab_size=len(tokenizer))
    return SpeculativeEngine(target, tokenizer, perturbed_copy(target, 0.002), profile=lambda *_: tiny_profile())


def complete(engine, constraint, drafter="pld", policy="greedy", params=None, temperature=0.0, seed=0, max_tokens=96):
    request = GenerationRequest(
        prompt="Tell me about a person as JSON: ",
        policy={"name": policy, "params": params or {}},
        drafter={"name": drafter},
        num_draft_tokens=6,
        sampling={"max_tokens": max_tokens, "temperature": temperature, "seed": seed, "structured_output": constraint},
    )
    return engine.complete(request)


def test_every_drafter_gives_the_same_valid_json_under_greedy(engine):
    outputs = {}
    for drafter in ("none", "pld", "model", "mla"):
        completion = complete(engine, JSON, drafter)
        assert completion.finish_reason == "stop", completion.text  # the grammar ended it: EOS
        jsonschema.validate(json.loads(completion.text), PERSON)
        outputs[drafter] = completion.token_ids
    assert len({tuple(tokens) for tokens in outputs.values()}) == 1


@pytest.mark.parametrize("drafter, temperature", [("model", 0.0), ("model", 0.8), ("mla", 0.8)])
def test_the_draft_model_drafts_inside_the_grammar(engine, monkeypatch, drafter, temperature):
    """Its proposals are drawn from its masked distribution, so the verifier never cuts them
    (a draft model blind to the grammar would be cut at its first forbidden token, acceptance 1)."""
    cuts = []
    within = GrammarState.within

    def counting_cuts(state, draft):
        kept = within(state, draft)
        cuts.append(draft.num_tokens - kept.num_tokens)
        return kept

    monkeypatch.setattr(GrammarState, "within", counting_cuts)
    completion = complete(engine, JSON, drafter, "rejection" if temperature else "greedy", {}, temperature)
    jsonschema.validate(json.loads(completion.text), PERSON)
    assert cuts and sum(cuts) == 0
    assert completion.metrics["mean_acceptance_length"] > 2.0


@pytest.mark.parametrize("policy, params, temperature", LOSSY)
def test_lossy_and_sampling_policies_keep_the_grammars_guarantee(engine, policy, params, temperature):
    for seed in range(3):
        for drafter in ("pld", "model"):
            completion = complete(engine, JSON, drafter, policy, params, temperature, seed)
            jsonschema.validate(json.loads(completion.text), PERSON)


@pytest.mark.parametrize(
    "constraint, matches",
    [
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)),
        ({"choice": ["yes", "no", "maybe so"]}, lambda text: text in ("yes", "no", "maybe so")),
        # a random model writes endless strings: the object's start shows the grammar, and a token
        # it forbids would have failed the commit (GrammarState.commit raises)
        ({"json_object": True}, lambda text: text.startswith("{")),
        ({"grammar": 'start: "(" NUM ("," NUM)? ")"\nNUM: /[0-9]{1,2}/'}, lambda t: re.fullmatch(r"\(\d+(,\d+)?\)", t)),
        ({"grammar": 'root ::= "x" [ab] "y"'}, lambda text: re.fullmatch(r"x[ab]y", text)),  # GBNF
    ],
)
def test_regex_choice_json_object_and_grammars(engine, constraint, matches):
    for drafter, temperature in (("model", 0.0), ("mla", 0.8)):
        completion = complete(engine, constraint, drafter, "rejection" if temperature else "greedy", {}, temperature)
        assert matches(completion.text), (constraint, completion.text)


def test_a_rejected_draft_leaves_the_grammar_where_the_commits_left_it(engine):
    state = engine.frontend.grammar_state(SamplingParams(structured_output=JSON), engine.frontend.defaults.drafter)
    encode = functools.partial(engine.frontend.tokenizer, add_special_tokens=False)
    state.commit(encode('{"name":"ab","age":').input_ids)
    before = state.allowed()
    digits, letter = encode("42").input_ids, encode("x").input_ids
    draft = DraftBlock(tokens=torch.tensor(digits + letter + digits))
    assert state.within(draft).token_ids == digits  # cut at the first token the grammar forbids
    masked = state.masked(TargetBlock(logits=torch.zeros(len(digits) + 1, state.vocab_size)), state.within(draft))
    assert masked.logits[0].isfinite().tolist() == before.tolist()
    assert torch.equal(state.allowed(), before)  # walked through the drafts and rolled back


def test_grammars_compile_once_and_bad_ones_are_a_clear_error(engine):
    complete(engine, {"regex": "[a-c]{4}"}, max_tokens=8)
    compiled = engine.frontend.grammars.compiled
    key = StructuredOutput(regex="[a-c]{4}").model_dump_json()
    first = compiled[key]
    for seed in range(1, 3):
        complete(engine, {"regex": "[a-c]{4}"}, seed=seed, max_tokens=8)
    assert compiled[key] is first  # each request copies the one compiled matcher
    for constraint in ({"regex": "(unclosed"}, {"grammar": "start: undefined_rule"}, {"json_schema": {"type": 5}}):
        with pytest.raises(SpecdecError, match="structured_output"):
            complete(engine, constraint, max_tokens=4)
    with pytest.raises(SpecdecError, match="chain drafters"):
        complete(engine, JSON, "model_tree", max_tokens=4)
    with pytest.raises(SpecdecError, match="min_tokens"):
        engine.complete(GenerationRequest(prompt="a", sampling={"min_tokens": 2, "structured_output": JSON}))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=["a"])


def test_the_structured_benchs_schemas_are_varied_valid_and_kept(engine):
    from specdec_core.tools.benchmarks.structured_bench import run_one, schema_for, summary

    cases = [schema_for(index) for index in range(50)]
    assert len({json.dumps(schema, sort_keys=True) for _, schema in cases}) == 50
    for _, schema in cases:
        jsonschema.Draft202012Validator.check_schema(schema)
    prompt, schema = cases[31]  # an array of objects beside a nested one
    runs = {drafter: run_one(engine, prompt, schema, {"name": drafter}, 0.0, 0, 160) for drafter in ("none", "model")}
    assert all(run["valid"] for run in runs.values())
    baseline = {"row": summary("none", 0.0, [runs["none"]], None), "runs": [runs["none"]]}
    row = summary("model", 0.0, [runs["model"]], baseline)
    assert row["valid"] == "1/1" and row["same as none"] == "1/1" and row["accept len"] > 1.0


def test_a_draft_after_a_forbidden_token_is_empty_and_leaves_the_grammar_as_it_was(engine):
    """Run-ahead can assume an unmasked lookup the grammar forbids: the draft model then drafts
    nothing after it, rather than failing its whole round."""
    state = engine.frontend.grammar_state(SamplingParams(structured_output=JSON), engine.frontend.defaults.drafter)
    before = state.allowed()
    forbidden = engine.frontend.tokenizer("x", add_special_tokens=False).input_ids
    logits, usable = state.masked_chain(torch.zeros(2, state.vocab_size), forbidden, [])
    assert usable == 0 and torch.equal(state.allowed(), before)
    logits, usable = state.masked_chain(torch.zeros(2, state.vocab_size), [], [])
    assert usable == 1 and logits[0].isfinite().tolist() == before.tolist()
