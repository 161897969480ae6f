"""`specdec bench --endpoint URL --concurrency 1,4,16`: a running service under load. For each
method and each concurrency N, N clients stream their questions one after another (client i
takes questions i, i + N, ...; every level sends the same questions); reported per level:
aggregate tokens/s over the level's wall time, request latency p50/p95, time to first token
p50/p95, mean acceptance length, and whether each output equals the method's output at the
first level (same request, same tokens: batching must not change a request's output).

Every method sends the same prompts, one method after another: a service with its prefix cache
on prefills each prompt once, for the first method, so the later ones start faster. To compare
methods, serve with `prefix_caching: false`."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

from ...api.request import GenerationRequest


class StreamingClient(Protocol):
    def stream(self, request: GenerationRequest) -> Iterator[dict]:
        """Chunks `{"token_ids", "text", "speculative"}` as they arrive (metrics on the last)."""


@dataclass
class Sent:
    """One request's result under load."""

    token_ids: list[int]
    latency_s: float
    time_to_first_token_s: Optional[float]
    metrics: dict


def send(client: StreamingClient, request: GenerationRequest) -> Sent:
    start = time.perf_counter()
    first, token_ids, metrics = None, [], {}
    for chunk in client.stream(request):
        if chunk["token_ids"] and first is None:
            first = time.perf_counter() - start
        token_ids += chunk["token_ids"]
        metrics = chunk.get("speculative") or metrics
    return Sent(token_ids, time.perf_counter() - start, first, metrics)


def run_level(connect: Callable[[], StreamingClient], requests: list[GenerationRequest], concurrency: int):
    """All `requests` from `concurrency` clients; (results in request order, wall seconds)."""
    shares = [list(range(client, len(requests), concurrency)) for client in range(concurrency)]

    def client_run(indices: list[int]) -> list[tuple[int, Sent]]:
        client = connect()
        return [(index, send(client, requests[index])) for index in indices]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = [pair for share in pool.map(client_run, shares) for pair in share]
    seconds = time.perf_counter() - start
    return [sent for _, sent in sorted(done, key=lambda pair: pair[0])], seconds


def total(results: list, key: str) -> float:
    """A metric summed over the requests' responses (0 where a response has none)."""
    return sum(sent.metrics.get(key, 0) for sent in results)


def percentile(values: list[float], fraction: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def sweep(
    connect: Callable[[], StreamingClient],
    methods: dict[str, Callable[[list[int], int], GenerationRequest]],
    prompts: list[list[int]],
    levels: list[int],
    progress: Callable[[str], None] = lambda _: None,
) -> list[dict]:
    """One row per method and concurrency level. `methods`: name -> request for a prompt at a
    level; the outputs are compared with the same method's at the first level and with the first
    method's (target-only, where it comes first)."""
    rows, baseline = [], None
    for name, make_request in methods.items():
        first_outputs = None
        for concurrency in levels:
            requests = [make_request(prompt, concurrency) for prompt in prompts]
            progress(f"{name} at concurrency {concurrency}")
            results, seconds = run_level(connect, requests, concurrency)
            outputs = [sent.token_ids for sent in results]
            first_outputs = first_outputs or outputs
            baseline = baseline or outputs
            steps = total(results, "num_steps") or 1
            # where a step's time went, as the coordinator saw it: awaiting each worker, verifying
            split = {
                f"{part}_ms_per_step": round(total(results, f"{part}_ms_total") / steps, 2)
                for part in ("draft", "target", "verify")
            }
            ahead = [sent.metrics["run_ahead"] for sent in results if "run_ahead" in sent.metrics]
            ahead_proposals = sum(counts["used"] + counts["discarded"] for counts in ahead)
            ahead_used = sum(counts["used"] for counts in ahead)
            latencies = [sent.latency_s for sent in results]
            firsts = [sent.time_to_first_token_s for sent in results if sent.time_to_first_token_s is not None]
            drafts = total(results, "spec_decode_num_drafts")
            accepted = total(results, "spec_decode_num_accepted_tokens")
            rows.append(
                {
                    "method": name,
                    "concurrency": concurrency,
                    "requests": len(results),
                    "tokens_per_s": round(sum(len(output) for output in outputs) / seconds, 2),
                    "latency_p50_s": round(percentile(latencies, 0.5), 3),
                    "latency_p95_s": round(percentile(latencies, 0.95), 3),
                    "ttft_p50_s": round(percentile(firsts, 0.5), 3) if firsts else None,
                    "ttft_p95_s": round(percentile(firsts, 0.95), 3) if firsts else None,
                    "mean_accept_len": round(1 + accepted / drafts, 3) if drafts else None,
                    **split,
                    "identical_to_first_level": sum(a == b for a, b in zip(outputs, first_outputs)),
                    "identical_to_first_method": sum(a == b for a, b in zip(outputs, baseline)),
                    "ahead_used": round(ahead_used / ahead_proposals, 3) if ahead_proposals else None,
                    # of those used, the share the target scored from the draft worker's forward
                    "ahead_forwarded": round(sum(counts.get("forwarded", 0) for counts in ahead) / ahead_used, 3)
                    if ahead_used
                    else None,
                }
            )
    return rows
