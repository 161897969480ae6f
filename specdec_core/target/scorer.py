"""Target scorer: chain verification of `[last committed, d_1..d_K]` in one forward, with a KV cache
holding exactly the committed tokens but the last one; rollback crops it. `forward_rows` runs many
sessions' verify blocks and prompt chunks in one forward (a ragged batch, batching.py), each row as
it would alone. A verify row may be a candidate tree (`score_tree`), whose accepted path
`commit_path` moves into place. With multi-token heads (heads/), the scorer feeds the final hidden
states of the positions it commits to the request's heads session, whose `guess` gives the next tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from ..api.errors import SpecdecError
from ..api.logprobs import score_prompt_tokens, token_log_probs
from ..api.sampling import SamplingParams, argmax_lists
from ..heads.contract import HeadGuesses, Heads, HeadsSession
from ..loop.stage_types import Prefilled, PromptScores, TargetBlock
from ..policies import AcceptancePolicy
from ..runtime.batching import forward_ragged
from ..runtime.kv_pool import PagedKV
from ..runtime.model_runner import runner_of
from ..runtime.ragged_attention import on_device
from ..trees.tree import Topology
from .aux_states import aux_states
from .verdicts import SessionVerdicts


class TargetScorer:
    """One request's target state (a `TargetSession`). `score` appends the scored tokens to the
    cache; `commit(n)` keeps the first n. The policy's target-side features (`target_features`,
    e.g. DropMatch's paths) are computed here, by the hidden states and LM head, from
    `sampling.generator("target")`, so they come out the same wherever the target runs."""

    def __init__(self, model: torch.nn.Module, heads: Optional[Mapping[str, Heads]] = None):
        self.model = model
        self.heads = heads or {}  # by kind (heads.loading.load_heads)
        self.cache = PagedKV()
        self.committed_len = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # prompt tokens looked up and found
        self.scored_tree: Optional[Topology] = None  # the tree the last score was, if one
        self.scored_hidden: Optional[torch.Tensor] = None  # [T, H] of the last score, with heads
        self.scored_tokens: Optional[torch.Tensor] = None  # [T] its tokens
        self.scored_features: Optional[torch.Tensor] = None  # [T, A * H] its kept states (aux_states.py)
        self.heads_session: Optional[HeadsSession] = None
        self.reads_aux_states = False  # its heads session reads the target's kept states
        self.prompt_parts: Optional[list[PromptScores]] = None  # per prefill chunk, while the prompt's are taken
        self.prompt_scores: Optional[PromptScores] = None  # the prompt's, when the request asks
        self.cached_ids: list[int] = []  # the tokens of the committed positions: what a recompute feeds
        self.scored_ids: list[int] = []  # the last score's tokens, of which `commit` keeps some
        self.heads_kind: Optional[str] = None
        self.preemptions = 0  # times its blocks were taken back (`preempt`) and recomputed
        self.verdicts: Optional[SessionVerdicts] = None  # where the target decides its verdicts (verdicts.py)

    def start(
        self,
        prompt_ids: Sequence[int],
        policy: AcceptancePolicy,
        sampling: SamplingParams,
        heads_kind: Optional[str] = None,
        admitted: bool = True,
    ) -> list[int]:
        """Begin a request (a new cache); returns the tokens to prefill (`take_prompt`), or none
        yet where it is not `admitted` to its pool. `heads_kind`: the kind of the target's heads
        the request's drafter reads (`guess`); only those run beside it, only then."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt must contain at least one token")
        self.policy, self.sampling, self.prompt_ids = policy, sampling, list(prompt_ids)
        self.cached_ids, self.preemptions, self.heads_kind = self.prompt_ids[:-1], 0, heads_kind
        asks, top = sampling.prompt_logprobs is not None, sampling.prompt_logprobs
        self.prompt_parts = [] if asks and len(prompt_ids) > 1 else None
        self.prompt_scores = PromptScores.concat([], top) if asks and len(prompt_ids) == 1 else None
        self.features_rng = sampling.generator("target")
        # blocks as its positions come (a fixed pool's sessions take what they hold, kv_room.py)
        self.cache = PagedKV(len(prompt_ids) + 1)
        self.committed_len = self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.scored_ids, self.heads_session = [], None
        self.scored_hidden = self.scored_tokens = self.scored_features = None
        # only an EAGLE-3 layer reads the kept states of the target's forward (aux_states.py)
        self.reads_aux_states = heads_kind == "eagle3"
        if heads_kind is not None:
            if heads_kind not in self.heads:
                raise ValueError(f"this target has no {heads_kind} heads (it has: {', '.join(self.heads) or 'none'})")
            self.heads_session = self.heads[heads_kind].session(self.model)
        return self.take_prompt() if admitted else []

    def take_prompt(self) -> list[int]:
        """The prompt's blocks another session computed (`reuse_cached`); the tokens left to prefill
        (`Row(prefill=True)`s): all but the last, which the first `score` feeds."""
        reused = self.reuse_cached()
        self.committed_len = self.prefix_cache_hits = reused or 0
        self.prefix_cache_queries = len(self.prompt_ids) - 1 if reused is not None else 0
        return self.prompt_ids[self.committed_len : -1]

    def reset(
        self,
        prompt_ids: Sequence[int],
        policy: AcceptancePolicy,
        sampling: SamplingParams,
        heads_kind: Optional[str] = None,
    ) -> Prefilled:
        """Start a request and prefill its prompt, `PREFILL_CHUNK` tokens per forward."""
        self.prefill(self.start(prompt_ids, policy, sampling, heads_kind))
        return self.prefilled()

    def prefill(self, tokens: Sequence[int]) -> None:
        """Feed `tokens` after the committed positions (a prompt's or a recompute's), a chunk a forward."""
        for begin in range(0, len(tokens), PREFILL_CHUNK):
            forward_rows([Row(self, tokens[begin : begin + PREFILL_CHUNK], prefill=True)])

    def prefilled(self) -> Prefilled:
        """After the prefill: the prompt's scores (if asked), its prefix cache use, who decides."""
        decides = self.verdicts is not None
        return Prefilled(self.prompt_scores, self.prefix_cache_queries, self.prefix_cache_hits, decides)

    def output_ids(self) -> list[int]:
        """The tokens generated so far as the loop holds them while it verifies the last score."""
        return (self.cached_ids[len(self.prompt_ids) - 1 :] + self.scored_ids[:1])[1:]  # the committed, the root

    def score_prefill(self, hidden: torch.Tensor) -> None:
        """A prompt chunk's final hidden states `[1, T, H]` (the positions after the committed
        ones): when the request asks, the log-probs of the prompt tokens they predict."""
        if self.prompt_parts is not None:
            start = self.committed_len + 1
            next_tokens = torch.tensor(self.prompt_ids[start : start + hidden.shape[1]], device=hidden.device)
            logits = self.model.lm_head(hidden)[0]  # [T, V]
            self.prompt_parts.append(score_prompt_tokens(logits, next_tokens, self.sampling.prompt_logprobs))
            if start + hidden.shape[1] == len(self.prompt_ids):  # the last chunk: kept through a preemption
                self.prompt_scores = PromptScores.concat(self.prompt_parts, self.sampling.prompt_logprobs)
                self.prompt_parts = None

    def score(self, tokens: Sequence[int]) -> TargetBlock:
        """Logits `[T, V]` (fp32) of the T tokens after the committed prefix, with the policy's features."""
        return forward_rows([Row(self, tokens)])[0]

    def score_tree(self, tokens: Sequence[int], tree: Topology) -> TargetBlock:
        """Logits `[N + 1, V]` (fp32) of a tree: `tokens` are its root, then its nodes in its order."""
        if len(tokens) != tree.num_nodes + 1:
            raise ValueError(f"tree {tree.name!r} has {tree.num_nodes} nodes; got {len(tokens) - 1} node tokens")
        return forward_rows([Row(self, tokens, tree=tree)])[0]

    def finish(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        tree: Optional[Topology],
        features: Optional[torch.Tensor] = None,
    ) -> TargetBlock:
        """This row's block from its tokens `[T]`, final hidden states `[T, H]`, logits `[T, V]`
        (fp32; a tree's: logits only) and kept states `[T, A * H]` (if the target keeps any)."""
        block = TargetBlock(logits=logits)
        if self.heads_session is not None:
            self.scored_hidden, self.scored_tokens, self.scored_features = hidden, tokens, features
        if tree is not None:
            return block
        if self.policy.needs_hidden:
            block.hidden, block.lm_head = hidden, self.model.lm_head
        draft_tokens = tokens[1:]
        if self.sampling.logprobs is not None:
            block.token_log_probs = token_log_probs(block.logits[:-1], draft_tokens)
        block.features = self.policy.target_features(block, draft_tokens, self.sampling, self.features_rng)
        return block

    def commit(self, num_keep: int) -> None:
        """Keep the first `num_keep` scored tokens; the rest are rolled back on the next call."""
        self.committed_len += num_keep
        self.cached_ids += self.scored_ids[:num_keep]
        self.cache.crop(self.committed_len)
        self.advance_heads(slice(0, num_keep))

    def commit_path(self, nodes: Sequence[int]) -> None:
        """After `score_tree`: keep the root and the accepted path, `nodes` (tree node indices,
        root 0 first); their cache entries move into place and the other nodes' are dropped
        (unless the session was preempted since: its recompute computes them)."""
        if self.cache.length > self.committed_len:
            self.cache.keep_at(self.committed_len, [self.committed_len + node for node in nodes])
        self.committed_len += len(nodes)
        self.cached_ids += [self.scored_ids[node] for node in nodes]
        self.advance_heads(list(nodes))

    def check_commit(self, keep: int, path: Sequence[int]) -> None:
        """A caller's commit of the last score (a worker checks every one it receives): at most the
        tokens scored, or a root-first path of the tree scored."""
        if not 0 <= keep <= len(self.scored_ids):
            raise SpecdecError(f"commit_keep must lie in [0, {len(self.scored_ids)}] (the tokens last scored)")
        if not path:
            return
        parents = self.scored_tree.parents.tolist() if self.scored_tree is not None else []
        on_tree = path[0] == 0 and all(
            0 < node < len(parents) and parents[node] == parent for parent, node in zip(path, path[1:])
        )
        if keep or not parents or not on_tree:
            raise SpecdecError("commit_path must be a root-first path of the tree last scored")

    def commit_scored(self, keep: int, path: Sequence[int]) -> None:
        """Commit the last score once: its first `keep` tokens, or its tree's `path`."""
        if keep:
            self.commit(keep)
        if path:
            self.commit_path(path)
        self.scored_ids, self.scored_tree = [], None

    def advance_heads(self, rows) -> None:
        """With heads: the scored rows `rows` (a slice or node indices) are committed positions."""
        if self.heads_session is not None and self.scored_hidden is not None:
            features = self.scored_features[rows] if self.scored_features is not None else None
            self.heads_session.advance(self.scored_hidden[rows], self.scored_tokens[rows], features)
            self.scored_hidden = self.scored_tokens = self.scored_features = None  # each position enters once

    def preempt(self) -> None:
        """Give the pool back every block (another session needs them): the committed positions'
        full blocks are published first, so that `recompute` finds most of them cached."""
        self.cache.publish(self.cached_ids)
        self.cache.drop()
        self.preemptions += 1

    def recompute(self) -> list[int]:
        """After `preempt`: a new cache, what the prefix cache still holds, and the tokens to prefill
        (all again for the heads, and for a prompt's scores not all taken)."""
        self.cache = PagedKV()
        self.prompt_parts = [] if self.prompt_parts is not None else None
        if self.heads_kind is not None:
            self.heads_session = self.heads[self.heads_kind].session(self.model)
        self.committed_len = self.reuse_cached() or 0
        return self.cached_ids[self.committed_len :]

    def reuse_cached(self) -> Optional[int]:
        """The committed positions' cached blocks, taken: how many (None: scores or heads need every forward)."""
        if self.prompt_parts is not None or self.heads_kind is not None:
            return None
        return self.cache.reuse(runner_of(self.model.model).kv_pool(), self.cached_ids)

    def guess(self, root_token: int, tree: str) -> Optional[HeadGuesses]:
        """The heads' node tokens of tree `tree` after `root_token` (the last committed token);
        None before any position is committed."""
        if self.heads_session is None:
            raise ValueError("this session was not started with heads (heads_kind)")
        return self.heads_session.guess(root_token, tree)


PREFILL_CHUNK = 512  # prompt tokens per forward: a long prompt never holds a step for its whole length


@dataclass
class Row:
    """A session's part of a forward: a verify block `[last committed, d_1..d_K]`, or a prompt chunk."""

    scorer: TargetScorer
    tokens: Sequence[int]
    prefill: bool = False
    tree: Optional[Topology] = None  # the candidate tree its tokens form (root first)


@torch.inference_mode()
def forward_rows(rows: Sequence[Row]) -> list[Optional[TargetBlock]]:
    """One forward over every row (sessions of one model): each verify row's block, None for a prefill row."""
    for row in rows:
        row.scorer.cache.crop(row.scorer.committed_len)
        if not row.prefill:
            row.scorer.scored_ids, row.scorer.scored_tree = list(row.tokens), row.tree
    model = rows[0].scorer.model
    hidden, _ = forward_ragged(
        model, [row.scorer.cache for row in rows], [row.tokens for row in rows], [row.tree for row in rows]
    )
    # the step's per-row work in a few ops: split views, one LM head call, the tokens as one tensor
    parts = hidden[0].split([len(row.tokens) for row in rows])  # [T_i, H] each
    reading = any(row.scorer.reads_aux_states for row in rows)
    features = aux_states(model, hidden.shape[1]) if reading else None  # [1, N, A * H]
    feature_parts = features[0].split([len(row.tokens) for row in rows]) if features is not None else None
    verifying = [index for index, row in enumerate(rows) if not row.prefill]
    blocks: list[Optional[TargetBlock]] = [None] * len(rows)
    if verifying:
        sizes = [len(rows[index].tokens) for index in verifying]
        scored = hidden[0] if len(verifying) == len(rows) else torch.cat([parts[index] for index in verifying])
        # [1, M, H] into the LM head: a row-parallel LM head (DeepSpeed's) splits dim 2
        all_logits = model.lm_head(scored[None])[0].float()  # [M, V]
        logits = all_logits.split(sizes)  # [T_i, V] each
        tokens = [token for index in verifying for token in rows[index].tokens]
        tokens = on_device(torch.tensor(tokens), hidden.device).split(sizes)  # [T_i] each
        # every row's argmax in one op and one read back, for the greedy requests' verdicts
        greedy = any(rows[index].scorer.sampling.greedy for index in verifying)
        argmax_ids = argmax_lists(all_logits, sizes) if greedy else [None] * len(sizes)
        for index, row_logits, row_tokens, row_argmax in zip(verifying, logits, tokens, argmax_ids):
            row = rows[index]
            row_features = feature_parts[index] if feature_parts is not None else None
            blocks[index] = row.scorer.finish(row_tokens, parts[index], row_logits, row.tree, row_features)
            blocks[index].batch_rows, blocks[index].argmax_ids = len(rows), row_argmax
            blocks[index].preemptions = row.scorer.preemptions
    for index, (row, part) in enumerate(zip(rows, parts)):
        if row.prefill:
            row.scorer.score_prefill(part[None])
            row.scorer.committed_len += len(row.tokens)
            row.scorer.cache.publish(row.scorer.cached_ids[: row.scorer.committed_len])
            if row.scorer.heads_session is not None:
                chunk = torch.tensor(row.tokens, dtype=torch.long, device=part.device)
                row_features = feature_parts[index] if feature_parts is not None else None
                row.scorer.heads_session.advance(part, chunk, row_features)
    return blocks
