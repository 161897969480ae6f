"""`specdec clients-check`: real client libraries, unmodified, against a running service, each
compared with what the target gives in process:

- the `openai` SDK: sync, async (concurrent), streaming with `stream_options.include_usage`,
  `extra_body` for the speculative setup, seeds;
- lm-evaluation-harness: `local-completions` and `local-chat-completions` on `specdec_gsm8k`
  (generate_until; greedy, so every answer must equal the target-only one, graded as the bench
  grades), and `local-completions` on `specdec_mc` (the log-likelihood path; its accuracy must
  equal the one from the target's own log-probs); tasks in lm_eval_tasks/;
- guidellm at fixed concurrencies (the load generator vLLM's project ships).

Every check is a `Check` row; `failed` says whether any failed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
GSM8K_MAX_TOKENS = 128  # specdec_gsm8k.yaml's max_gen_toks, the bench's default


@dataclass
class Check:
    part: str
    name: str
    result: str
    passed: bool


@dataclass
class ClientsCheck:
    url: str  # the service's HTTP address, without /v1
    tokenizer_dir: Path  # the target's tokenizer saved where the clients can load it offline
    engine: Any  # an in-process SpeculativeEngine over the same target: the reference
    api_key: Optional[str] = None
    checks: list[Check] = field(default_factory=list)
    references: dict[tuple[str, int], str] = field(default_factory=dict)  # (messages JSON, max_tokens): text

    def __post_init__(self):
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.model = httpx.get(f"{self.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]

    @property
    def failed(self) -> bool:
        return any(not check.passed for check in self.checks)

    def record(self, part: str, name: str, result: str, passed: bool) -> None:
        self.checks.append(Check(part, name, result, passed))

    def reference_text(self, messages: list[dict], max_tokens: int) -> str:
        """Target-only greedy in process (each asked once)."""
        from specdec_core import GenerationRequest

        key = (json.dumps(messages), max_tokens)
        if key not in self.references:
            sampling = {"max_tokens": max_tokens}
            request = GenerationRequest(messages=messages, drafter={"name": "none"}, sampling=sampling)
            self.references[key] = self.engine.complete(request).text
        return self.references[key]

    # ------------------------------------------------------------------ the openai SDK

    def openai_sdk(self) -> None:
        import openai

        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused", max_retries=0)
        messages = [{"role": "user", "content": "Name three colours."}]
        extra = {"policy": "greedy", "drafter": "pld", "num_draft_tokens": 8}
        whole = client.chat.completions.create(
            model=self.model, messages=messages, max_tokens=48, temperature=0, extra_body=extra
        )
        expected = self.reference_text(messages, 48)
        self.record(
            "openai",
            "chat, extra_body",
            f"{whole.usage.completion_tokens} tokens",
            whole.choices[0].message.content == expected,
        )
        prompt_tokens = len(self.engine.frontend.encode(_chat(messages)))
        stream = client.chat.completions.create(
            model=self.model,
            messages=messages,
            max_tokens=48,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        usage = chunks[-1].usage
        self.record(
            "openai",
            "stream, include_usage",
            f"usage {usage.prompt_tokens}+{usage.completion_tokens}",
            text == expected and not chunks[-1].choices and usage.prompt_tokens == prompt_tokens,
        )
        samples = [
            client.completions.create(
                model=self.model, prompt="Once upon a time", max_tokens=16, temperature=1.0, **seed
            )
            .choices[0]
            .text
            for seed in ({}, {}, {"seed": 5}, {"seed": 5})
        ]
        self.record(
            "openai", "T = 1: unseeded differ, seeded repeat", "", samples[0] != samples[1] and samples[2] == samples[3]
        )
        texts = asyncio.run(self._async_completions(8))
        self.record("openai", "async, 8 concurrent", f"{len(set(texts))} distinct", len(set(texts)) == 1)

    async def _async_completions(self, count: int) -> list[str]:
        import openai

        async with openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "unused") as client:
            replies = await asyncio.gather(
                *(
                    client.completions.create(model=self.model, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0)
                    for _ in range(count)
                )
            )
        return [reply.choices[0].text for reply in replies]

    # ------------------------------------------------------------------ lm-evaluation-harness

    def lm_eval(self, limit: int, gen_kwargs: dict, concurrency: int) -> dict:
        """Both model types on specdec_gsm8k, local-completions on specdec_mc; returns lm-eval's
        scores and samples per run."""
        import lm_eval
        from lm_eval.tasks import TaskManager

        tasks = TaskManager(include_path=str(TASKS_DIR))
        common = {"model": self.model, "max_retries": 1, "timeout": 600}
        if self.api_key:
            common["header"] = {"Authorization": f"Bearer {self.api_key}"}
        completions = {
            **common,
            "base_url": f"{self.url}/v1/completions",
            "tokenizer": str(self.tokenizer_dir),
            "tokenizer_backend": "huggingface",
            "num_concurrent": concurrency,
        }
        chat = {**common, "base_url": f"{self.url}/v1/chat/completions"}
        runs = {
            "local-completions gsm8k": ("local-completions", completions, "specdec_gsm8k", True),
            "local-chat-completions gsm8k": ("local-chat-completions", chat, "specdec_gsm8k", True),
            "local-completions mc": ("local-completions", completions, "specdec_mc", False),
        }
        results = {}
        for label, (model_type, args, task, chat_template) in runs.items():
            outcome = lm_eval.simple_evaluate(
                model=model_type,
                model_args=args,
                tasks=[task],
                task_manager=tasks,
                limit=limit,
                apply_chat_template=chat_template,
                gen_kwargs=gen_kwargs if chat_template else None,
                log_samples=True,
            )
            samples = sorted(outcome["samples"][task], key=lambda sample: sample["doc_id"])
            results[label] = {"scores": outcome["results"][task], "samples": samples}
            requests = sum(len(sample["arguments"]) for sample in samples)
            if task == "specdec_gsm8k":
                max_tokens = gen_kwargs.get("max_gen_toks", GSM8K_MAX_TOKENS)
                self._compare_gsm8k(label, samples, requests, outcome["results"][task]["accuracy,none"], max_tokens)
            else:
                self._compare_mc(label, samples, requests, outcome["results"][task]["acc,none"])
        return results

    def _compare_gsm8k(self, label: str, samples: list[dict], requests: int, accuracy: float, max_tokens: int) -> None:
        from specdec_core.tools.benchmarks.grading import gsm8k_correct

        questions = [[{"role": "user", "content": sample["doc"]["question"]}] for sample in samples]
        references = [self.reference_text(messages, max_tokens) for messages in questions]
        same = sum(sample["resps"][0][0] == reference for sample, reference in zip(samples, references))
        in_process = sum(gsm8k_correct(text, s["doc"]["reference"]) for text, s in zip(references, samples)) / len(
            samples
        )
        self.record(
            "lm-eval",
            label,
            f"{requests} requests, 0 errors; accuracy {accuracy:.3f} (in process {in_process:.3f}); "
            f"{same}/{len(samples)} answers equal target-only",
            same == len(samples),
        )

    def _compare_mc(self, label: str, samples: list[dict], requests: int, accuracy: float) -> None:
        import torch

        from specdec_core.tools.benchmarks.bench import score_continuation

        tokenizer, model = self.engine.frontend.tokenizer, self.engine.target_model
        worst, correct = 0.0, 0
        for sample in samples:
            served = [float(response[0][0]) for response in sample["resps"]]
            own = []
            for context, continuation in (argument[:2] for argument in sample["arguments"]):
                context_ids = tokenizer(context, add_special_tokens=False).input_ids
                whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
                nll, _ = score_continuation(model, whole[: len(context_ids)], whole[len(context_ids) :])
                own.append(-float(nll.sum()))
            worst = max(worst, max(abs(a - b) for a, b in zip(served, own)))
            correct += int(torch.tensor(own).argmax()) == sample["doc"]["label"]
        in_process = correct / len(samples)
        self.record(
            "lm-eval",
            label,
            f"{requests} requests, 0 errors; acc {accuracy:.3f} (in process {in_process:.3f}); "
            f"log-likelihoods within {worst:.1e}",
            abs(accuracy - in_process) < 1e-9 and worst < 1e-3,
        )

    # ------------------------------------------------------------------ guidellm

    def guidellm(
        self,
        concurrencies: list[int],
        requests: list[int],
        prompt_tokens: int,
        output_tokens: int,
        out: Path,
        extra_body: Optional[dict] = None,
    ) -> list[dict]:
        """guidellm's `run` at each concurrency (`requests` per level), its chat requests as it sends
        them (ignore_eos, streamed with usage) plus `extra_body` (its backend's `extras`); one row
        per level."""
        backend = {"kind": "openai_http", "target": self.url, "model": self.model, "extras": {"body": extra_body or {}}}
        if self.api_key:
            backend["api_key"] = self.api_key
        command = [
            sys.executable,
            "-m",
            "guidellm",
            "run",
            "--backend",
            json.dumps(backend),
            "--profile",
            "kind=concurrent,streams=1",
            "--override",
            "profile.streams",
            ",".join(map(str, concurrencies)),
            "--constraint",
            json.dumps({"kind": "max_requests", "count": requests}),
            "--data",
            f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
            "--tokenizer",
            f"kind=hf_auto,model={self.tokenizer_dir}",
            "--output",
            f"kind=json,path={out / 'guidellm.json'}",
            "--disable-console-interactive",
        ]
        subprocess.run(command, check=True, env={**os.environ, **OFFLINE})
        rows = []
        for benchmark in json.loads((out / "guidellm.json").read_text())["benchmarks"]:
            metrics = benchmark["metrics"]
            totals = metrics["request_totals"]
            row = {
                "concurrency": benchmark["config"]["strategy"]["streams"],
                "ok": totals["successful"],
                "errored": totals["errored"],
                "output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
                "mean_output_tokens": metrics["output_token_count"]["successful"]["mean"],
                "ttft_ms_median": metrics["time_to_first_token_ms"]["successful"]["median"],
                "itl_ms_median": metrics["inter_token_latency_ms"]["successful"]["median"],
            }
            rows.append(row)
            self.record(
                "guidellm",
                f"concurrency {row['concurrency']}",
                f"{row['ok']} ok, {row['errored']} errored, {row['output_tokens_per_s']:.1f} output tok/s, "
                f"TTFT {row['ttft_ms_median']:.0f} ms, ITL {row['itl_ms_median']:.1f} ms",
                row["errored"] == 0 and row["mean_output_tokens"] == output_tokens,
            )
        return rows


def _chat(messages: list[dict]):
    from specdec_core import GenerationRequest

    return GenerationRequest(messages=messages)
