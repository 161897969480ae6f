"""Suffix decoding (drafters/suffix.py over suffix_cache.py): greedy identity for `suffix`,
`suffix_tree` and suffix as mla's first level; the shared tree learns from earlier outputs, except
an opted-out request's or another scope's; eviction bounds it; trees keep Arctic's ranks."""

from __future__ import annotations

import gc

import pytest

from specdec_core import GenerationRequest
from specdec_core.api.sampling import SamplingParams
from specdec_core.drafters import DrafterError, SuffixCache, make_drafter, validate_drafter
from specdec_core.drafters.suffix import node_paths
from specdec_core.drafters.suffix_cache import SuffixCacheSettings

from helpers.tiny_models import repeating_prompt

FIRST_LEVEL = {"lookup": "suffix"}
SUFFIX_DRAFTERS = [("suffix", {}), ("suffix_tree", {}), ("mla", FIRST_LEVEL), ("mla_tree", FIRST_LEVEL)]


def request(prompt_ids, drafter="suffix", params=None, k=6, policy="greedy", **sampling):
    sampling.setdefault("max_tokens", 40)
    return GenerationRequest(
        prompt_ids=prompt_ids,
        policy={"name": policy},
        drafter={"name": drafter, "params": params or {}},
        num_draft_tokens=k,
        sampling=sampling,
    )


@pytest.mark.parametrize("drafter, params", SUFFIX_DRAFTERS)
@pytest.mark.parametrize("k", [1, 4, 15])
def test_greedy_suffix_decoding_is_token_identical_to_target_only(tiny_engine, drafter, params, k):
    for seed in range(3):
        prompt = repeating_prompt(seed)
        reference = tiny_engine.complete(request(prompt, "none"))
        speculative = tiny_engine.complete(request(prompt, drafter, {**params, "suffix_scope": f"identity-{k}"}, k=k))
        assert speculative.token_ids == reference.token_ids


def test_a_private_sampled_request_reproduces_its_tokens_under_a_seed(tiny_engine):
    """Drafts from a shared tree change as it fills (and a sampled request's tokens with them);
    one that shares nothing drafts alike each time."""
    prompt, private = repeating_prompt(4), {"suffix_share": False}
    runs = [
        tiny_engine.complete(request(prompt, "suffix_tree", private, policy="rejection", temperature=0.8, seed=3))
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 40
    assert runs[0].metrics["spec_decode_num_drafts"] > 0


def acceptance(engine, prompt, **params) -> float:
    return engine.complete(request(prompt, "suffix", params)).metrics["mean_acceptance_length"]


def test_the_shared_tree_drafts_from_earlier_outputs_but_not_an_opted_out_or_another_scopes(tiny_engine):
    """A prompt answered once before is drafted from that answer: the second run accepts more per
    step. An opted-out first run, or one in another scope, leaves nothing to draft from."""
    prompt = repeating_prompt(11, length=6)  # too short to draft much from itself
    first = acceptance(tiny_engine, prompt, suffix_scope="learns")
    again = acceptance(tiny_engine, prompt, suffix_scope="learns")
    assert again > first + 1.0
    assert acceptance(tiny_engine, prompt, suffix_scope="learns", suffix_share=False) == pytest.approx(first)
    assert acceptance(tiny_engine, prompt, suffix_scope="private", suffix_share=False) == pytest.approx(first)
    assert acceptance(tiny_engine, prompt, suffix_scope="private") == pytest.approx(first)
    assert acceptance(tiny_engine, prompt, suffix_scope="elsewhere") == pytest.approx(first)


def proposal_after(cache: SuffixCache, context: list[int], scope: str = "") -> list[int]:
    drafter = make_drafter("suffix", {"adaptive": False, "suffix_scope": scope}, suffixes=cache)
    drafter.reset(context[:1], SamplingParams())
    drafter.commit(context[1:])
    return drafter.propose(8).token_ids


def answered(cache: SuffixCache, output: list[int], scope: str = "") -> None:
    drafter = make_drafter("suffix", {"suffix_scope": scope}, suffixes=cache)
    drafter.reset([1], SamplingParams())
    drafter.commit(output)


def test_the_oldest_outputs_leave_the_shared_tree_past_its_bounds():
    """Each probe is a request too: it pushes out the oldest output left."""
    first, second, third = [100, 101, 102, 103, 104], [200, 201, 202, 203, 204], [300, 301, 302, 303, 304]
    by_requests = SuffixCache(SuffixCacheSettings(max_requests=3))
    for output in (first, second, third):
        answered(by_requests, output)
    assert proposal_after(by_requests, [7, 100, 101]) == []
    assert proposal_after(by_requests, [7, 300, 301]) == [302, 303]  # a 2-token match proposes 2 (max_spec_factor 1)
    assert by_requests.stats()["outputs"] == 3
    by_tokens = SuffixCache(SuffixCacheSettings(max_tokens=12))
    for output in (first, second, third):
        answered(by_tokens, output)
    assert proposal_after(by_tokens, [7, 100, 101]) == []
    assert proposal_after(by_tokens, [7, 300, 301]) == [302, 303]  # a 2-token match proposes 2 (max_spec_factor 1)
    assert by_tokens.stats()["tokens"] <= 12


def test_eviction_keeps_first_in_first_out_while_the_oldest_still_grows():
    """An old request still answering is spared while it grows, and stays the oldest."""
    cache = SuffixCache(SuffixCacheSettings(max_requests=3, max_tokens=10))
    a, b = cache.open([1]), cache.open([1])
    a.extend([10] * 6)
    b.extend([11] * 3)
    c = cache.open([1])
    a.extend([10] * 2)  # 11 tokens: the oldest other than a goes (b)
    assert [request_id for _, request_id in cache.held] == [a.request_id, c.request_id]
    cache.open([1])
    cache.open([1])  # four outputs: a, the oldest, goes
    assert [request_id for _, request_id in cache.held][:1] == [c.request_id]


def test_a_dropped_session_frees_its_own_tree_and_an_empty_scope_goes():
    cache = SuffixCache(SuffixCacheSettings(max_requests=1))
    drafter = make_drafter("suffix", {"suffix_scope": "a"}, suffixes=cache)
    drafter.reset([1, 2, 3], SamplingParams())
    assert cache.stats() == {"outputs": 1, "tokens": 0, "scopes": 1, "open": 1}
    del drafter
    gc.collect()
    assert cache.stats()["open"] == 0
    answered(cache, [5, 6], scope="b")  # evicts scope a's output: nothing is left of it
    assert set(cache.scopes) == {"b"}


def test_a_suffix_tree_keeps_arctics_nodes_with_their_ranks():
    """Continuations of [10, 11]: 12 twice (then 13 or 16), 14 once (then 15)."""
    cache = SuffixCache()
    for output in ([10, 11, 12, 13], [10, 11, 14, 15], [10, 11, 12, 16]):
        answered(cache, output)
    drafter = make_drafter("suffix_tree", {"adaptive": False, "max_spec_factor": 4}, suffixes=cache)
    drafter.reset([7, 10], SamplingParams())
    drafter.commit([11])
    block = drafter.propose(6)
    nodes = dict(zip(block.tree.paths, block.token_ids))
    assert nodes[(0,)] == 12 and nodes[(1,)] == 14 and nodes[(1, 0)] == 15
    assert {nodes[(0, 0)], nodes[(0, 1)]} == {13, 16}
    assert node_paths([-1, -1, 0, 0, 1]) == [(0,), (1,), (0, 0), (0, 1), (1, 0)]


def test_suffix_decoding_without_arctic_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_arctic(name, *args, **kwargs):
        if name.startswith("arctic_inference"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_arctic)
    for drafter, params in SUFFIX_DRAFTERS:
        with pytest.raises(DrafterError, match="arctic-inference"):
            validate_drafter(drafter, params)
    validate_drafter("mla")  # prompt lookup's first level needs none


def test_the_code_edit_set_asks_back_each_humaneval_function_with_one_edit():
    import ast

    from specdec_core.calibration.questions import load_questions

    questions = load_questions("code_edit", ["all"], 1000)
    renames = [q for q in questions if q["category"] == "code_edit_rename"]
    docstrings = [q for q in questions if q["category"] == "code_edit_docstring"]
    assert len(renames) == 164 and len(docstrings) >= 150
    for question in renames[:20] + docstrings[:20]:
        code = question["turns"][0].split("```python\n")[1].rstrip("`")
        name = question["turns"][0].split("`")[3 if question in renames else 1]
        function = next(node for node in ast.parse(code).body if getattr(node, "name", None) == name)
        if question in docstrings:
            assert ast.get_docstring(function) is None and "docstring" in question["turns"][0]
        else:
            assert f"`{function.args.args[0].arg}`" in question["turns"][0]


def test_the_multiturn_set_ends_each_chat_with_a_request_to_redo_the_answer_before():
    from specdec_core.calibration.questions import EDIT_REQUEST, load_questions, question_messages

    questions = load_questions("multiturn", ["all"], 30)
    assert len(questions) == 30
    for question in questions:
        messages = question_messages(question)
        roles = [message["role"] for message in messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"] and len(roles) >= 3
        assert EDIT_REQUEST.search(messages[-1]["content"]) and all(m["content"].strip() for m in messages)


@pytest.mark.needs_smollm2  # the target's tokenizer
def test_suffix_cost_measures_a_filled_tree(tmp_path):
    import json

    from typer.testing import CliRunner

    from specdec_core.tools.cli_app import app

    out = tmp_path / "cost.json"
    args = ["suffix-cost", "--requests", "30", "--context", "256", "--steps", "20", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [row["drafter"] for row in rows] == ["suffix", "suffix_tree"]
    assert all(row["outputs"] == 30 and row["tokens"] > 0 and row["proposal_ms_p50"] > 0 for row in rows)


def test_the_bench_keeps_each_methods_suffix_trees_to_itself():
    """A bench asks every method the same questions: one method's answers in another's shared
    tree would draft that method's answers for it. Each method (and each load level) drafts from
    a scope of its own, tagged per run so a served run never reads the last run's."""
    from specdec_core.tools.benchmarks.bench import Runner, parse_specdec_method
    from specdec_core.tools.benchmarks.bench_records import BenchConfig

    config = BenchConfig("q", [], ["all"], 1, 8, 0.0, 0, 4, {})
    runner, other_run = Runner(None, config), Runner(None, config)

    def scope(method: str, level: str = "", run: Runner = runner) -> str:
        return run.request([1, 2], parse_specdec_method(method), level).drafter.params["suffix_scope"]

    scopes = [scope("specdec:greedy+suffix"), scope("specdec:greedy+suffix(max_spec_factor=2)")]
    scopes += [scope("specdec:greedy+mla(lookup=suffix)"), scope("specdec:greedy+suffix", "c8")]
    scopes += [scope("specdec:greedy+suffix", run=other_run)]
    assert len(set(scopes)) == 5 and scope("specdec:greedy+suffix") == scopes[0]
    assert "suffix_scope" not in runner.request([1, 2], parse_specdec_method("specdec:greedy+model")).drafter.params
