"""One request's EAGLE-3 layer (eagle3_layer.py) on its target session: the layer's KV follows the
target's commits, and `guess` drafts a candidate tree (a chain is a one-path tree) after them.

Positions: the target has committed positions 0..n-1 (its cache holds them) and the root token
r (position n) is the last committed token, not yet in any cache. The layer's input at position
t pairs a hidden state with token t + 1, so the layer's cache holds positions 0..n-2, each
entered once when its next token is committed, and the fc'ed features g_{n-1} wait (`pending`)
for r. A guess runs (g_{n-1}, r) at position n - 1, whose output drafts depth 1; a node of depth
D pairs its parent's output with its own token at position n - 1 + D and drafts its children.
A tree is expanded a depth at a time (a node's children depend on its token), each depth one
forward over the tree so far (a tree's nodes sorted by depth: those of depth <= D come first),
with the tree's mask; then the cache is cropped back to the committed positions. A chain takes
one forward of one token a depth, over the cache its depths before it left. A dynamic tree
(dynamic_tree.py, EAGLE-2's) grows the same way from the layer's own log-probabilities.

Vocabulary: H the hidden size, A * Ht the target features' width, n the positions committed at
once, M a tree's nodes."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..runtime.batching import run_ragged
from ..runtime.chained_steps import chains_in_one_graph, run_chain
from ..runtime.kv_pool import PagedKV
from ..trees.dynamic_tree import PREFIX, DynamicTree, grow
from ..trees.topologies import default_bank
from ..trees.tree import Path, Topology, listed_name
from .contract import HeadGuesses, root_probability


class Eagle3Session:
    def __init__(self, draft: nn.Module, model: nn.Module):
        self.draft, self.model = draft, model
        self.embed = draft.embed_tokens if draft.embed_tokens is not None else model.get_input_embeddings()
        self.cache = PagedKV()
        self.pending: Optional[torch.Tensor] = None  # [H] g of the last committed position
        self.last_hidden: Optional[torch.Tensor] = None  # [Ht] the target's final state there

    @torch.inference_mode()
    def advance(self, hidden: torch.Tensor, tokens: torch.Tensor, features: Optional[torch.Tensor]) -> None:
        """The next n committed positions: the target's final hidden states `[n, Ht]`, their
        tokens `[n]` and features `[n, A * Ht]`."""
        if not len(hidden):
            return
        self.last_hidden = hidden[-1]
        states = self.draft.fc(features)  # [n, H]
        if self.pending is not None:
            states, tokens = torch.cat([self.pending[None], states]), torch.cat([tokens[:1], tokens])
        if len(states) > 1:  # each position but the last meets its next token
            self.forward(tokens[1:], states[:-1])
        self.pending = states[-1]

    def forward(self, tokens: torch.Tensor, states: torch.Tensor, tree: Optional[Topology] = None) -> torch.Tensor:
        """The layer over `tokens` `[m]` paired with hidden `states` `[m, H]` after the cached
        positions (a chain, or a `tree` rooted at the first); its outputs `[m, H]`."""
        outputs, _ = run_ragged(
            self.draft, [self.cache], [len(tokens)], [tree], inputs_embeds=self.inputs(tokens, states)
        )
        return outputs[0]

    def inputs(self, tokens: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        """The layer's input `[1, m, 2H]`: each token's embedding beside the state it follows."""
        return torch.cat([self.embed(tokens), states], -1)[None]

    @torch.inference_mode()
    def guess(self, root_token: int, tree: str) -> Optional[HeadGuesses]:
        """The node tokens of tree `tree` after `root_token`, drafted depth by depth, and the
        layer's top-1 probabilities along the tree's top-1 path."""
        if self.pending is None:
            return None
        if tree.startswith(PREFIX):
            return self.guess_dynamic(root_token, DynamicTree.parse(tree))
        topology = default_bank().limited(tree, self.draft.num_heads)
        if topology.num_nodes == topology.max_depth:
            return self.guess_chain(root_token, topology)
        return self.guess_tree(root_token, topology)

    @torch.inference_mode()
    def guess_tree(self, root_token: int, topology: Topology) -> HeadGuesses:
        """The nodes of `topology` after `root_token`, a depth at a time."""
        device, committed = self.pending.device, self.cache.length
        tokens = torch.zeros(topology.num_nodes + 1, dtype=torch.long, device=device)  # [M + 1], root first
        tokens[0] = root_token
        states = self.pending.new_zeros(topology.num_nodes + 1, self.pending.shape[-1])  # [M + 1, H] each node's input
        states[0] = self.pending
        probs = states.new_zeros(topology.num_nodes + 1, dtype=torch.float32)  # [M + 1] each node's draft probability
        chain, top_probs = topology.top1_path, []
        for depth, (nodes, parents, ranks) in enumerate(topology.levels):
            nodes, parents, ranks = nodes.to(device), parents.to(device), ranks.to(device)
            size = int(nodes.min())  # the tree of depth < depth + 1: its root and first nodes
            partial = default_bank().limited(topology.name, depth) if depth else None
            try:
                outputs = self.forward(tokens[:size], states[:size], partial)  # [size, H]
            finally:
                self.cache.crop(committed)
            expanded = parents.unique()  # sorted: the nodes with children at this depth
            logits = self.draft.draft_logits(outputs[expanded])  # [E, Vd]
            top = logits.float().softmax(-1).topk(int(ranks.max()) + 1, dim=-1)
            rows = torch.searchsorted(expanded, parents)
            tokens[nodes], probs[nodes] = self.draft.target_ids(top.indices[rows, ranks]), top.values[rows, ranks]
            states[nodes] = outputs[parents]
            if len(top_probs) == depth and depth < len(chain) and chain[depth] in expanded.tolist():
                top_probs.append(top.values[expanded.tolist().index(chain[depth]), 0])
        path_probs = torch.stack(top_probs).float() if top_probs else torch.zeros(0, device=device)
        root_prob = root_probability(self.model, self.last_hidden, root_token)
        return HeadGuesses(topology, tokens[1:], probs[1:], path_probs, root_prob)

    @torch.inference_mode()
    def guess_chain(self, root_token: int, chain: Topology) -> HeadGuesses:
        """A chain after `root_token`: each depth one forward of one token over what the depths
        before it left in the cache (a causal chain's earlier outputs do not depend on later
        tokens, so this is the tree path's result in `chain.num_nodes` tokens, not 1 + 2 + ..),
        fed the last depth's top token and output on the device: nothing is read back until the
        caller reads the guesses. Where the layer replays graphs, every depth is one graph
        (runtime/chained_steps.py)."""
        committed = self.cache.length
        carried = {"tokens": torch.tensor([root_token], device=self.pending.device), "states": self.pending[None]}
        try:
            if chains_in_one_graph(self.draft, 1):
                tokens, probs = run_chain(self.draft, [self.cache], carried, self.chain_step, "eagle3", chain.num_nodes)
            else:
                depths = []
                for _ in range(chain.num_nodes):
                    carried, produced = self.chain_step(None, carried)
                    depths.append(produced)
                tokens, probs = (torch.stack(parts) for parts in zip(*depths))
        finally:
            self.cache.crop(committed)
        node_probs = probs[:, 0]  # [M] along the chain: also its top-1 path's
        root_prob = root_probability(self.model, self.last_hidden, root_token)
        return HeadGuesses(chain, tokens[:, 0], node_probs, node_probs, root_prob)

    def chain_step(self, step: Optional[dict], carried: dict) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
        """One depth of a chain (chained_steps.ChainStep): each row's token `[N]` and the state
        `[N, H]` it follows in, its output state and the layer's top token and probability out;
        the token and state carried to the next depth. `step`: a chained graph's layout (None: a
        forward of its own after the cache)."""
        tokens, states = carried["tokens"], carried["states"]
        if step is None:
            outputs = self.forward(tokens, states)  # [N, H]
        else:
            outputs = self.draft(inputs_embeds=self.inputs(tokens, states), **step).last_hidden_state[0]
        top = self.draft.draft_logits(outputs).float().softmax(-1).topk(1, dim=-1)  # [N, 1] each
        tokens = self.draft.target_ids(top.indices[:, 0])
        return {"tokens": tokens, "states": outputs}, (tokens, top.values[:, 0])

    def top(self, outputs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's top-k next tokens after outputs `[F, H]`: log-probs and target ids `[F, k]`."""
        log_probs, ids = self.draft.draft_logits(outputs).float().log_softmax(-1).topk(k, -1)
        return log_probs, self.draft.target_ids(ids)

    def guess_dynamic(self, root_token: int, shape: DynamicTree) -> HeadGuesses:
        """EAGLE-2's tree of `shape` after `root_token`: each expansion one forward over the
        nodes expanded so far and the frontier (each after its parent's output)."""
        device, committed = self.pending.device, self.cache.length
        root = torch.tensor([root_token], device=device)
        try:
            root_output = self.forward(root, self.pending[None])[0]  # [H]
        finally:
            self.cache.crop(committed)
        outputs: dict[Path, torch.Tensor] = {}  # each expanded node's output [H]

        def expand(frontier: list[Path], tokens: dict[Path, int]):
            paths = sorted({*outputs, *frontier}, key=lambda path: (len(path), path))
            node_tokens = torch.tensor([root_token, *(tokens[path] for path in paths)], device=device)
            parents = [outputs[path[:-1]] if len(path) > 1 else root_output for path in paths]
            states = torch.stack([self.pending, *parents])  # [1 + nodes, H]
            try:
                tree_outputs = self.forward(node_tokens, states, Topology.build(listed_name(paths), paths))
            finally:
                self.cache.crop(committed)
            outputs.update(zip(paths, tree_outputs[1:]))
            return self.top(torch.stack([outputs[path] for path in frontier]), shape.top_k)

        log_probs, ids = self.top(root_output[None], shape.top_k)
        paths, tokens, probs = grow(shape, (log_probs[0], ids[0]), expand)
        return HeadGuesses(
            default_bank().get(listed_name(paths)),
            torch.tensor(tokens, device=device),
            torch.tensor(probs, device=device),
            torch.zeros(0, device=device),  # no top-1 path probabilities: no scheduler reads them
            root_probability(self.model, self.last_hidden, root_token),
        )
