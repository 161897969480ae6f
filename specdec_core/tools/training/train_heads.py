"""Training Medusa-style heads (heads/medusa.py) for any causal LM by self-distillation: the target
greedily continues a set of prompts (ShareGPT's first turns by default), and head k learns to
predict, from the target's final hidden state at position t, the target's own token at t + 2 + k.
The target stays frozen (Medusa-1); by default the heads share its LM head, so only their
residual blocks train and the result is small.

Two stages, each resumable from the output directory: `distill` keeps the hidden states and
labels (`distilled.pt`), `train` keeps the heads, the optimizer and the step every
`checkpoint_every` steps (`train_state.pt`); a rerun with the same settings goes on from there.
The heads are written in Medusa's format (`MedusaHeads.save`), with `train_log.json`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm.auto import tqdm

from ...heads.medusa import MedusaHeads
from ...runtime.batching import forward_ragged
from ...runtime.kv_pool import PagedKV
from .training_state import STATE_FILE, resume_state, save_state, warmup_cosine

DISTILLED_FILE = "distilled.pt"
LOG_FILE = "train_log.json"
IGNORED = -100  # a label past the end of its continuation


class DistillSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    continuation_tokens: int = Field(128, ge=2, description="greedy tokens the target adds to each prompt")
    batch_size: int = Field(16, ge=1, description="prompts continued together")


class TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    num_heads: int = Field(4, ge=1, le=16)
    num_layers: int = Field(1, ge=1, le=4)
    own_lm_head: bool = Field(False, description="each head its own vocabulary projection; else the target's")
    steps: int = Field(600, ge=1)
    batch_positions: int = Field(256, ge=1, description="hidden states per step")
    learning_rate: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    head_decay: float = Field(0.8, gt=0, le=1, description="head k's loss weight is head_decay**k (Medusa's)")
    holdout: float = Field(0.05, ge=0, lt=1, description="share of the sequences kept out for evaluation")
    checkpoint_every: int = Field(50, ge=1)
    seed: int = 0


@torch.inference_mode()
def greedy_continuations(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], settings: DistillSettings, eos_ids: set[int] = frozenset()
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per prompt, the target's greedy continuation (stopped after an EOS) and the final hidden
    states `[n, H]` that predicted each of its n tokens (the prompt's last position first)."""
    lm_head = model.get_output_embeddings()
    hidden_rows: list[torch.Tensor] = []
    continuations: list[list[int]] = []
    bar = tqdm(total=len(prompts), desc="distilling (greedy continuations)", unit="prompt")
    for begin in range(0, len(prompts), settings.batch_size):
        batch = [list(prompt) for prompt in prompts[begin : begin + settings.batch_size]]
        caches = [PagedKV(len(prompt) + settings.continuation_tokens + 1) for prompt in batch]
        states: list[list[torch.Tensor]] = [[] for _ in batch]
        tokens: list[list[int]] = [[] for _ in batch]
        hidden, offsets = forward_ragged(model, caches, batch)
        last = hidden[0, [end - 1 for end in offsets[1:]]]
        live = list(range(len(batch)))
        for _ in range(settings.continuation_tokens):
            next_tokens = lm_head(last[None])[0].argmax(-1).tolist()
            for row, state, token in zip(live, last, next_tokens):
                states[row].append(state.float().cpu())
                tokens[row].append(token)
            live = [row for row in live if tokens[row][-1] not in eos_ids]
            if not live or len(tokens[live[0]]) == settings.continuation_tokens:
                break
            hidden, _ = forward_ragged(model, [caches[row] for row in live], [[tokens[row][-1]] for row in live])
            last = hidden[0]
        hidden_rows.extend(torch.stack(state) for state in states)
        continuations.extend(tokens)
        bar.update(len(batch))
    bar.close()
    return hidden_rows, continuations


def head_labels(continuation: Sequence[int], num_heads: int) -> torch.Tensor:
    """`[n, num_heads]`: at the state that predicted token i, head k's label is token i + 1 + k."""
    padded = list(continuation) + [IGNORED] * num_heads
    return torch.tensor([[padded[i + 1 + k] for k in range(num_heads)] for i in range(len(continuation))])


def distill(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    settings: DistillSettings,
    out_dir: Path,
    eos_ids: set[int] = frozenset(),
) -> dict:
    """The distilled data (`hidden`, `continuations`), from `out_dir` when made with these settings."""
    path = out_dir / DISTILLED_FILE
    key = {"settings": settings.model_dump(), "num_prompts": len(prompts)}
    if path.exists():
        data = torch.load(path, weights_only=True)
        if data["key"] == json.dumps(key):
            return data
    hidden, continuations = greedy_continuations(model, prompts, settings, eos_ids)
    data = {"key": json.dumps(key), "hidden": hidden, "continuations": continuations}
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


def heads_loss(
    heads: MedusaHeads, lm_head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, decay: float
) -> tuple[torch.Tensor, list[float], list[float]]:
    """The weighted cross-entropy over the heads, and each head's own loss and top-1 accuracy."""
    # the frozen LM head's plain matmul: its inference kernel (kernels/linear.py) has no backward
    logits = heads(hidden, lambda states: torch.nn.functional.linear(states, lm_head.weight))  # [num_heads, B, V]
    total = hidden.new_zeros(())
    losses, accuracies = [], []
    for head in range(heads.num_heads):
        valid = labels[:, head] != IGNORED
        loss = torch.nn.functional.cross_entropy(logits[head][valid], labels[valid, head])
        total = total + decay**head * loss
        losses.append(loss.item())
        accuracies.append(float((logits[head][valid].argmax(-1) == labels[valid, head]).float().mean()))
    return total, losses, accuracies


@torch.no_grad()
def evaluate(heads, lm_head, hidden, labels, decay, batch: int = 512) -> dict:
    """Each head's mean loss and top-1 accuracy over `hidden`."""
    weights, losses, accuracies = [], [], []
    for begin in range(0, len(hidden), batch):
        rows = slice(begin, begin + batch)
        _, loss, accuracy = heads_loss(heads, lm_head, hidden[rows], labels[rows], decay)
        counts = (labels[rows] != IGNORED).sum(0).tolist()
        weights.append(counts)
        losses.append([value * count for value, count in zip(loss, counts)])
        accuracies.append([value * count for value, count in zip(accuracy, counts)])
    totals = [max(sum(column), 1) for column in zip(*weights)]
    return {
        "loss": [round(sum(column) / total, 4) for column, total in zip(zip(*losses), totals)],
        "top1_accuracy": [round(sum(column) / total, 4) for column, total in zip(zip(*accuracies), totals)],
    }


def train(
    target: torch.nn.Module, data: dict, settings: TrainSettings, out_dir: Path, base_model: str = ""
) -> tuple[MedusaHeads, dict]:
    """Train heads on distilled data; resumes from `out_dir`'s state when its settings match.
    Returns the heads (written to `out_dir`) and the log."""
    lm_head = target.get_output_embeddings()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    generator = torch.Generator().manual_seed(settings.seed)
    order = torch.randperm(len(data["hidden"]), generator=generator).tolist()
    num_held = int(len(order) * settings.holdout)
    held, kept = order[:num_held], order[num_held:]

    def stacked(sequences: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.cat([data["hidden"][index] for index in sequences])
        labels = torch.cat([head_labels(data["continuations"][index], settings.num_heads) for index in sequences])
        return hidden.to(lm_head.weight.dtype), labels

    train_hidden, train_labels = stacked(kept)
    eval_hidden, eval_labels = stacked(held) if held else (train_hidden, train_labels)  # no holdout: fit
    torch.manual_seed(settings.seed)
    config = target.config
    heads = MedusaHeads(
        config.hidden_size, config.vocab_size, settings.num_heads, settings.num_layers, settings.own_lm_head
    )
    if settings.own_lm_head:  # Medusa starts each projection from the target's
        for head in heads.heads:
            head[-1].weight.data.copy_(lm_head.weight.float())
    heads.to(lm_head.weight.dtype)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=settings.learning_rate, weight_decay=0.0)

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings.warmup_steps, settings.steps))
    parts = {"heads": heads, "optimizer": optimizer, "schedule": schedule}
    state_path = out_dir / STATE_FILE
    log = {
        "settings": settings.model_dump(),
        "train_positions": len(train_hidden),
        "eval_positions": len(eval_hidden) if held else 0,  # 0: before/after are on the training positions
    }
    step, elapsed, log = resume_state(state_path, settings.model_dump(), parts, generator) or (0, 0.0, log)
    if "before" not in log:
        log["before"] = evaluate(heads, lm_head, eval_hidden, eval_labels, settings.head_decay)
    bar = tqdm(total=settings.steps, initial=step, desc="training heads", unit="step")
    started = time.perf_counter() - elapsed
    while step < settings.steps:
        picks = torch.randint(len(train_hidden), (settings.batch_positions,), generator=generator)
        loss, losses, _ = heads_loss(heads, lm_head, train_hidden[picks], train_labels[picks], settings.head_decay)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{loss.item():.3f}", head0=f"{losses[0]:.3f}")
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            log["train_loss"] = round(loss.item(), 4)
            elapsed = time.perf_counter() - started
            save_state(state_path, settings.model_dump(), parts, generator, step, elapsed, log)
    bar.close()
    log["after"] = evaluate(heads, lm_head, eval_hidden, eval_labels, settings.head_decay)
    log["train_seconds"] = round(time.perf_counter() - started, 1)
    heads.save(out_dir, base_model, dtype=torch.float16 if not settings.own_lm_head else torch.float32)
    (out_dir / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
    return heads, log


def train_heads(
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    out_dir: Path,
    distill_settings: Optional[DistillSettings] = None,
    train_settings: Optional[TrainSettings] = None,
    eos_ids: set[int] = frozenset(),
    base_model: str = "",
) -> tuple[MedusaHeads, dict]:
    """Both stages: distill the target's continuations of `prompts`, then train heads on them."""
    distill_settings = distill_settings or DistillSettings()
    data = distill(target, prompts, distill_settings, out_dir, eos_ids)
    return train(target, data, train_settings or TrainSettings(), out_dir, base_model)
