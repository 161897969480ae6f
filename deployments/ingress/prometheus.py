"""Prometheus metrics of the served path, through Ray Serve's metrics API (each node exports
them on its metrics port, prefixed `ray_`). Names mirror vLLM's with `specdec_` in place of
`vllm:`, so dashboards carry over; docs/architecture.md lists them."""

from __future__ import annotations

from ray.serve.metrics import Counter, Histogram

from specdec_core.loop.frontend import PreparedRequest

from .remote_engine import RequestTimings

# request metric (specdec_core.api.metrics) -> counter specdec_spec_decode_<name>, tagged by policy
COUNTED = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
# tokens a drafting step emits (accepted + 1): one bucket per value up to K = 32
ACCEPTANCE_BUCKETS = [float(length) for length in range(1, 34)]


class ServeMetrics:
    """The `MetricsSink` of a server replica (remote_engine.py)."""

    def __init__(self):
        policy = ("policy",)
        self.spec_decode = {
            name: Counter(f"specdec_spec_decode_{name}", description=f"speculative decoding: {name}", tag_keys=policy)
            for name in (*COUNTED, "draft_fallbacks")
        }
        self.accepted_per_pos = Counter(
            "specdec_spec_decode_num_accepted_tokens_per_pos",
            description="accepted draft tokens at each draft position (0-based)",
            tag_keys=("policy", "position"),
        )
        self.prefix_cache = {
            name: Counter(f"specdec_{name}", description=f"prompt tokens: {name} of the target's prefix cache")
            for name in ("prefix_cache_queries", "prefix_cache_hits")
        }
        self.run_ahead = {
            name: Counter(f"specdec_run_ahead_{name}", description=f"run-ahead drafting: {description}")
            for name, description in (
                ("used", "proposals drafted ahead and verified next"),
                ("discarded", "proposals drafted ahead and dropped (another verdict)"),
                ("draft_ms_hidden", "draft milliseconds spent while the target verified"),
                ("forwarded", "proposals used that the target scored from the draft worker, before the server asked"),
            )
        }
        self.preemptions = Counter(
            "specdec_preemptions",
            description="times the target worker took a request's KV blocks back, to recompute them later",
        )
        self.tokens = {
            kind: Counter(f"specdec_{kind}_tokens", description=f"{kind} tokens of finished requests")
            for kind in ("prompt", "generation")
        }
        self.errors = Counter(
            "specdec_request_errors",
            description="failed requests by protocol and status (HTTP code or gRPC status name)",
            tag_keys=("protocol", "status"),
        )

        def latency(name: str, description: str) -> Histogram:
            return Histogram(name, description=description, boundaries=LATENCY_BUCKETS_S, tag_keys=policy)

        self.time_to_first_token = latency("specdec_time_to_first_token_seconds", "request arrival to first token")
        self.inter_token_latency = latency(
            "specdec_inter_token_latency_seconds", "between a request's successive steps' tokens (as vLLM's)"
        )
        self.request_latency = latency("specdec_e2e_request_latency_seconds", "request arrival to its last token")
        self.acceptance_length = Histogram(
            "specdec_spec_decode_acceptance_length",
            description="tokens emitted per drafting step (accepted + 1)",
            boundaries=ACCEPTANCE_BUCKETS,
            tag_keys=policy,
        )

    def finished(self, request: PreparedRequest, metrics: dict, timings: RequestTimings) -> None:
        tags = {"policy": request.policy.name}
        for name in COUNTED:
            if metrics[f"spec_decode_{name}"] > 0:  # Ray counters reject increments of 0
                self.spec_decode[name].inc(metrics[f"spec_decode_{name}"], tags)
        if metrics["draft_fallback"]:
            self.spec_decode["draft_fallbacks"].inc(1, tags)
        for name, counter in self.prefix_cache.items():
            if metrics[name] > 0:
                counter.inc(metrics[name])
        for name, value in metrics.get("run_ahead", {}).items():
            if value > 0:
                self.run_ahead[name].inc(value)
        if metrics["preemptions"] > 0:
            self.preemptions.inc(metrics["preemptions"])
        for kind, key in (("prompt", "prompt_tokens"), ("generation", "completion_tokens")):
            if metrics[key] > 0:
                self.tokens[kind].inc(metrics[key])
        # steps that accepted at least j tokens: all drafting steps for j = 0, else position j-1's count
        at_least = [metrics["spec_decode_num_drafts"], *metrics["spec_decode_num_accepted_tokens_per_pos"], 0]
        for position, accepted in enumerate(at_least[1:-1]):
            if accepted > 0:
                self.accepted_per_pos.inc(accepted, {**tags, "position": str(position)})
        for num_accepted in range(len(at_least) - 1):
            for _ in range(at_least[num_accepted] - at_least[num_accepted + 1]):
                self.acceptance_length.observe(num_accepted + 1, tags)
        if timings.time_to_first_token_s is not None:
            self.time_to_first_token.observe(timings.time_to_first_token_s, tags)
        for gap in timings.inter_token_latencies_s:
            self.inter_token_latency.observe(gap, tags)
        self.request_latency.observe(timings.latency_s, tags)

    def failed(self, protocol: str, status: str) -> None:
        self.errors.inc(1, {"protocol": protocol, "status": status})
