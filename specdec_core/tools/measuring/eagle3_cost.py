"""What an EAGLE-3 layer costs beside its target: one draft step, a chain's and a dynamic tree's
guess, and the target's verify of one token, of a chain and of EAGLE-2's 60-token tree, for a
target of any shape (on a GPU: random weights of Llama-3.1-8B's) with a random EAGLE-3 layer of
the matching shape (the published heads': the target's hidden size, its MLP, a 32k-token draft
vocabulary). `specdec gpu-report` prints it last (the layer's hooks stay on the target)."""

from __future__ import annotations

from typing import Optional

import torch

from ...api.sampling import SamplingParams
from ...heads.eagle3_layer import Eagle3Draft
from ...policies import make_policy
from ...target.aux_states import keep_aux_states
from ...target.scorer import TargetScorer
from .device_clock import seconds_per_call

PUBLISHED_DRAFT_VOCAB = 32000


def random_eagle3(target: torch.nn.Module, seed: int = 0) -> Eagle3Draft:
    """A random EAGLE-3 layer shaped for `target`, on its device and in its dtype, its hooks on."""
    torch.manual_seed(seed)
    draft = Eagle3Draft.for_target(target.config, min(PUBLISHED_DRAFT_VOCAB, target.config.vocab_size))
    keep_aux_states(target, draft.aux_layers)
    weight = target.get_input_embeddings().weight
    return draft.to(weight.device, weight.dtype).eval().run_as(target)


def eagle3_costs(
    target: torch.nn.Module, layer: Optional[Eagle3Draft] = None, prompt_tokens: int = 256, repeats: int = 10
) -> list[dict]:
    """Milliseconds of each call after a `prompt_tokens` prompt (one session), of `layer` (one on
    the target already: its hooks in place) or else a random one."""
    scorer = TargetScorer(target, {"eagle3": layer if layer is not None else random_eagle3(target)})
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (prompt_tokens,), generator=generator).tolist()
    scorer.reset(prompt, make_policy("greedy"), SamplingParams(temperature=0.0), "eagle3")
    root = prompt[-1]
    tree = scorer.guess(root, "dynamic_k10_d8_n59")
    chain = scorer.guess(root, "chain_4").tokens.tolist()
    calls = {
        ("draft step", 1): lambda: scorer.guess(root, "chain_2@1"),
        ("chain guess, 4 steps", 4): lambda: scorer.guess(root, "chain_4"),
        ("dynamic tree guess (k 10, depth 8)", tree.tree.num_nodes): lambda: scorer.guess(root, "dynamic_k10_d8_n59"),
        ("target verify, 1 token", 1): lambda: scorer.score([root]),
        ("target verify, chain of 4", 5): lambda: scorer.score([root, *chain]),
        ("target verify, dynamic tree", tree.tree.num_nodes + 1): lambda: scorer.score_tree(
            [root, *tree.tokens.tolist()], tree.tree
        ),
    }
    return [
        {"call": call, "tokens": tokens, "ms": round(seconds_per_call(run, repeats) * 1e3, 2)}
        for (call, tokens), run in calls.items()
    ]
