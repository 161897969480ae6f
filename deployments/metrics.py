"""Prometheus counters of the served path (Ray Serve's metrics), named as vLLM's spec-decode
counters so dashboards carry over, tagged by policy."""

from __future__ import annotations

from ray.serve.metrics import Counter

from specdec_core.frontend import PreparedRequest

# request metric (specdec_core.metrics) -> counter, spec_decode_<name>
COUNTED = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


class ServeMetrics:
    def __init__(self):
        self.counters = {
            name: Counter(f"spec_decode_{name}", description=f"speculative decoding: {name}", tag_keys=("policy",))
            for name in (*COUNTED, "draft_fallbacks")
        }

    def record(self, request: PreparedRequest, metrics: dict) -> None:
        """Add one finished request's metrics."""
        tags = {"policy": request.policy.name}
        for name in COUNTED:
            if metrics[f"spec_decode_{name}"] > 0:  # Ray counters reject increments of 0
                self.counters[name].inc(metrics[f"spec_decode_{name}"], tags)
        if metrics["draft_fallback"]:
            self.counters["draft_fallbacks"].inc(1, tags)
