"""The suffix trees suffix decoding drafts from (SuffixDecoding, Oliaro et al., NeurIPS 2025):
a tree per request over its prompt and output, and a global tree over the outputs of the last
requests, shared by the requests of one process (the in-process engine's, or the draft worker's
when served). The trees are Arctic Inference's C++ ones (`SuffixDecodingCache`, what vLLM and
SGLang import).

Every request reads and feeds the global tree of its scope (`suffix_scope`, "" by default): a
scope is a namespace, not a secret, so scopes keep cooperating tenants (or a bench's methods)
apart but do not protect one tenant from another that names its scope. A request that opts out
(`suffix_share: false`) drafts from its own tree alone: its text never enters a shared tree, and
others' never shape its drafts (so a seeded sampled request reproduces its tokens, which under
a shared tree depend on what the scope answered before).

The global trees of all scopes hold at most `max_requests` outputs and `max_tokens` output
tokens together, across scopes (so one scope's traffic evicts another's outputs); past either
bound the oldest output goes first (FIFO, as Arctic's cache evicts by requests). A request's own
tree lives as long as its drafter session: it is freed once the session is dropped
(`weakref.finalize`), so a worker's released or expired sessions need no hook here."""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict, deque
from typing import Any, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..api.errors import SpecdecError

INSTALL_HINT = "pip install 'specdec[suffix]' (Arctic Inference's suffix trees, built from source)"


def require_arctic() -> Any:
    """Arctic Inference's `SuffixDecodingCache` class; ValueError naming the install where it is missing."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        raise ValueError(f"suffix decoding needs arctic-inference: {INSTALL_HINT}") from None
    return SuffixDecodingCache


class SuffixCacheSettings(BaseModel):
    """The process's suffix trees (vLLM's `suffix_decoding_*` defaults)."""

    model_config = ConfigDict(extra="forbid")
    max_depth: int = Field(
        24, ge=2, le=1024, description="the trees' depth: the longest context suffix matched plus what it proposes"
    )
    max_requests: int = Field(10_000, ge=0, description="outputs the global trees hold; the oldest go first")
    max_tokens: int = Field(
        4_000_000, ge=0, description="output tokens the global trees hold (their memory grows with it)"
    )


class SuffixCache:
    """The suffix trees of one process: each scope's global tree and its active requests' own."""

    def __init__(self, settings: Optional[SuffixCacheSettings] = None):
        self.settings = settings or SuffixCacheSettings()
        self.scopes: dict[str, Any] = {}  # scope -> its SuffixDecodingCache (its requests' own trees too)
        self.held: OrderedDict[tuple[str, int], int] = OrderedDict()  # (scope, id) -> output tokens, oldest first
        self.held_tokens = 0
        self.open_requests = 0
        self.ids = itertools.count()
        self.lock = threading.Lock()  # the draft worker's sessions open, step and drop on different threads
        # requests whose handles went: a finalizer may run on any thread, inside this cache's own
        # calls too (a garbage collection), so it only queues them; each call frees them first
        self.closed: deque[tuple[Any, Optional[str], int]] = deque()

    def open(self, prompt_ids: Sequence[int], share: bool = True, scope: str = "") -> "SuffixRequest":
        """A request's trees: its own over `prompt_ids` and what it commits, and, where it
        `share`s, its scope's global tree, which its output enters as it is committed."""
        bounds = self.settings
        share = share and bounds.max_requests > 0 and bounds.max_tokens > 0
        prompt = list(prompt_ids)
        with self.lock:
            self.free_closed()
            request_id = next(self.ids)
            if not share:  # its own tree alone: Arctic's cache without a global tree
                trees = require_arctic()(bounds.max_depth, max_cached_requests=0)
            elif scope in self.scopes:
                trees = self.scopes[scope]
            else:
                trees = self.scopes[scope] = require_arctic()(bounds.max_depth, max_cached_requests=-1)
            trees.start_request(request_id, prompt)
            self.open_requests += 1
            if share:
                self.held[scope, request_id] = 0
                self.evict(keep=(scope, request_id))
        return SuffixRequest(self, trees, scope if share else None, request_id)

    def extend(self, request: "SuffixRequest", tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        with self.lock:
            self.free_closed()
            request.trees.add_active_response(request.request_id, tokens)
            key = (request.scope, request.request_id)
            if key in self.held:
                self.held[key] += len(tokens)
                self.held_tokens += len(tokens)
                self.evict(keep=key)

    def speculate(self, request: "SuffixRequest", context: Sequence[int], max_tokens: int, params: Any, tree: bool):
        """Arctic's draft (`token_ids`, `parents`, `probs`: each token's path probability, `score`)
        from the better of the request's own tree and its scope's global tree."""
        tail = list(context[-self.settings.max_depth :])
        with self.lock:
            self.free_closed()
            return request.trees.speculate(
                request.request_id,
                tail,
                max_spec_tokens=max_tokens,
                max_spec_factor=params.max_spec_factor,
                max_spec_offset=params.max_spec_offset,
                min_token_prob=params.min_token_prob,
                use_tree_spec=tree,
            )

    def free_closed(self) -> None:
        """Free the own trees of requests whose handles went; their outputs stay in their scope's
        global tree until evicted (the caller holds the lock)."""
        while self.closed:
            trees, scope, request_id = self.closed.popleft()
            trees.stop_request(request_id)
            self.open_requests -= 1
            if scope is not None:
                self.drop_if_empty(scope, trees)

    def evict(self, keep: tuple[str, int]) -> None:
        """The oldest outputs, other than `keep`'s, out of the global trees while over a bound
        (the newest alone may run past the token bound)."""
        bounds = self.settings
        while (len(self.held) > bounds.max_requests or self.held_tokens > bounds.max_tokens) and len(self.held) > 1:
            oldest = next(key for key in self.held if key != keep)
            self.held_tokens -= self.held.pop(oldest)
            scope, request_id = oldest
            trees = self.scopes[scope]
            trees.evict_cached_response(request_id)
            self.drop_if_empty(scope, trees)

    def drop_if_empty(self, scope: str, trees: Any) -> None:
        """Forget a scope whose trees hold no request and no output."""
        if self.scopes.get(scope) is trees and not trees.active_requests and not trees.cached_requests:
            del self.scopes[scope]

    def stats(self) -> dict[str, int]:
        """What the global trees hold (outputs, their tokens, scopes), and the open requests."""
        with self.lock:
            self.free_closed()
            return {
                "outputs": len(self.held),
                "tokens": self.held_tokens,
                "scopes": len(self.scopes),
                "open": self.open_requests,
            }


class SuffixRequest:
    """One request's handle on a SuffixCache (`scope` None: it shares nothing); its own tree is
    freed when the handle goes."""

    def __init__(self, cache: SuffixCache, trees: Any, scope: Optional[str], request_id: int):
        self.cache, self.trees, self.scope, self.request_id = cache, trees, scope, request_id
        self.close = weakref.finalize(self, cache.closed.append, (trees, scope, request_id))

    def extend(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.cache.extend(self, tokens)

    def speculate(self, context: Sequence[int], max_tokens: int, params: Any, tree: bool = False):
        return self.cache.speculate(self, context, max_tokens, params, tree)


def no_suffix_cache(name: str) -> SpecdecError:
    return SpecdecError(f"drafter {name!r} reads the process's suffix trees, and none was given", "drafter")
