"""draft_rounds.py's chains: a greedy model drafter asks for its whole block as one forward and
`follow` more, each fed the last argmax on the device, and reads its tokens back once. Its blocks
equal those of the same drafter asking forward by forward, beside sessions that still go forward
by forward (a lookup's guesses to check, sampled drafts), step after step."""

from __future__ import annotations

import torch

from specdec_core.api.sampling import SamplingParams
from specdec_core.drafters import make_drafter
from specdec_core.drafters.draft_rounds import propose_together
from specdec_core.drafters.model import ModelDrafter

from helpers.tiny_models import repeating_prompt, tiny_llama


class ForwardByForward(ModelDrafter):
    """The `model` drafter as it drafts where it cannot chain: it asks for each forward alone."""

    guesses = True


def counting(proposal, asked: list[int]):
    """`proposal`, counting in `asked` the forwards it asks for."""
    scored = None
    try:
        while True:
            forward = proposal.send(scored)
            asked[0] += 1
            scored = yield forward
    except StopIteration as done:
        return done.value


def test_a_greedy_chain_asks_once_and_drafts_what_it_drafts_forward_by_forward():
    model = tiny_llama(seed=6)
    repeated = repeating_prompt(3, length=6)
    setups = [  # (drafter, prompt, sampling, block)
        ("model", repeating_prompt(1), SamplingParams(), 5),
        ("mla", repeated * 4, SamplingParams(), 6),
        ("model", repeating_prompt(2, length=9), SamplingParams(temperature=0.9, seed=3), 4),
        ("model", repeating_prompt(4, length=30), SamplingParams(), 3),
        ("model", [7], SamplingParams(), 1),
    ]

    def sessions(chained: bool):
        drafters = []
        for name, prompt, sampling, _ in setups:
            params = {"adaptive": False, **({"max_ngram": 2} if name == "mla" else {})}
            drafter = make_drafter(name, params, model)
            if name == "model" and not chained:
                drafter = ForwardByForward(model, drafter.params)
            drafter.reset(prompt, sampling)
            drafters.append(drafter)
        return drafters

    chains, references = sessions(chained=True), sessions(chained=False)
    for step in range(3):
        asked = [[0] for _ in setups]
        blocks = propose_together(
            model,
            [counting(drafter.drafting(block), count) for drafter, (*_, block), count in zip(chains, setups, asked)],
        )
        proposals = [drafter.drafting(block) for drafter, (*_, block) in zip(references, setups)]
        expected = propose_together(model, proposals)
        for got, want in zip(blocks, expected):
            assert got.ids == want.ids and torch.equal(got.logits, want.logits)
            assert (got.token_probs is None) == (want.token_probs is None)
            if want.token_probs is not None:
                assert torch.equal(got.token_probs, want.token_probs)
        assert [len(block.ids) for block in blocks] == [5, 6, 4, 3, 1]
        greedy_models = [count[0] for (name, _, sampling, _), count in zip(setups, asked) if name == "model"]
        assert greedy_models == [1, 4, 1, 1]  # the sampled session asks once a token
        for drafter_pair, block in zip(zip(chains, references), expected):
            committed = [*block.ids[: step + 1], 11 + step]  # some drafts kept, then a correction
            for drafter in drafter_pair:
                drafter.commit(committed)
