"""Training an EAGLE-3 layer (heads/eagle3_layer.py) for any causal LM by self-distillation, as the EAGLE-3
authors train theirs. Each sequence is a prompt and an answer: the target's own greedy
continuation (train_heads.py's `greedy_continuations`: one decode step per token), or a given
answer such as ShareGPT's own, read teacher-forced (EAGLE-1's fixed data: one forward per
sequence, so far more data per hour). One forward over each sequence keeps the target's states at
the layer's three depths (aux_states.py) and its own next token at each position, the labels:
the token greedy verification accepts there. The layer learns them with EAGLE-3's training-time
test: `ttt_steps` draft steps, step j fed its own outputs of step
j - 1 (and the true tokens), attending as a drafted chain does (the target's positions up to its
anchor, and its own earlier steps at that anchor), step j's loss weighted `step_decay`**j.

Vocabulary: n a sequence's positions, A = n - 1 anchors (the positions a draft starts from), H
the hidden size, Vd the draft vocabulary: the `draft_vocab` tokens the answers' labels use most,
the LM head starting from the target's rows of them; a label outside it is left out of the loss.
Step j at anchor a reads token a + j + 1 at position a + j and predicts the target's next token
after position a + j + 1; only predictions of the answer's tokens count, and the target's next
token after a sequence's last position, a label like the others.

Resumable as train_heads.py (`distilled_eagle3.pt`, then `train_state.pt` every
`checkpoint_every` steps); writes the EAGLE authors' format (heads/eagle3_checkpoint.py's save_eagle3) and
`train_log.json` with each step's top-1 accuracy on held-out sequences (the acceptance of draft
position j + 1 when the positions before it were accepted)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm.auto import tqdm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ...heads.eagle3_checkpoint import save_eagle3
from ...heads.eagle3_layer import Eagle3Draft, default_aux_layers
from ...runtime.batching import forward_ragged
from ...runtime.kv_pool import PagedKV
from ...target.aux_states import aux_states, keep_aux_states
from .train_heads import LOG_FILE, DistillSettings, greedy_continuations
from .training_state import STATE_FILE, resume_state, save_state, warmup_cosine

DISTILLED_FILE = "distilled_eagle3.pt"


class Eagle3TrainSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ttt_steps: int = Field(3, ge=1, le=8, description="draft steps per position (speculators' 3; the authors' 7)")
    step_decay: float = Field(0.8, gt=0, le=1, description="step j's loss weight is step_decay**j (the authors')")
    draft_vocab: int = Field(8192, ge=16, description="the draft's vocabulary: the most used tokens")
    steps: int = Field(600, ge=1)
    sequences_per_step: int = Field(4, ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    holdout: float = Field(0.05, ge=0, lt=1, description="share of the sequences kept out for evaluation")
    checkpoint_every: int = Field(50, ge=1)
    seed: int = 0


@torch.inference_mode()
def distill_eagle3(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    settings: DistillSettings,
    out_dir: Path,
    eos_ids=(),
    answers: Optional[Sequence[Sequence[int]]] = None,
) -> dict:
    """Per prompt: its tokens and answer (`tokens`, `prompt_lengths`), the target's kept states
    `[n, A * H]` (fp16) and its next token after each position (`labels` `[n]`) over them. The
    answers are the target's greedy continuations, or `answers`' first `continuation_tokens`.
    From `out_dir` when made with these settings and data."""
    path = out_dir / DISTILLED_FILE
    given = None if answers is None else json.dumps([[int(token) for token in answer] for answer in answers])
    digest = given and hashlib.sha256(given.encode()).hexdigest()
    key = json.dumps({"settings": settings.model_dump(), "num_prompts": len(prompts), "answers": digest})
    if path.exists() and (data := torch.load(path, weights_only=True))["key"] == key:
        return data
    if answers is None:
        _, continuations = greedy_continuations(model, prompts, settings, set(eos_ids))
    else:
        continuations = [list(answer)[: settings.continuation_tokens] for answer in answers]
    keep_aux_states(model, default_aux_layers(model.config.num_hidden_layers))
    lm_head = model.get_output_embeddings()
    sequences = [list(prompt) + list(continuation) for prompt, continuation in zip(prompts, continuations)]
    states, labels = [], []
    for sequence in tqdm(sequences, desc="distilling (the target's states)", unit="sequence"):
        hidden, _ = forward_ragged(model, [PagedKV()], [sequence])
        states.append(aux_states(model, hidden.shape[1])[0].half().cpu())
        labels.append(lm_head(hidden[0]).argmax(-1).int().cpu())
    prompt_lengths = [len(prompt) for prompt in prompts]
    data = {"key": key, "tokens": sequences, "prompt_lengths": prompt_lengths, "states": states, "labels": labels}
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    return data


def new_layer(target: torch.nn.Module, data: dict, settings: Eagle3TrainSettings) -> tuple[Eagle3Draft, torch.Tensor]:
    """A fresh layer shaped for `target` and the draft vocabulary `used` `[Vd]` (ascending target
    ids): the labels' most used tokens over the answers, its LM head the target's rows of them."""
    config = target.config
    counts = torch.zeros(config.vocab_size)
    for labels, start in zip(data["labels"], data["prompt_lengths"]):
        counts += torch.bincount(labels[start - 1 :].long(), minlength=config.vocab_size)
    used = counts.topk(min(settings.draft_vocab, config.vocab_size)).indices.sort().values  # [Vd]
    draft = Eagle3Draft.for_target(config, len(used))
    draft.d2t.copy_(used - torch.arange(len(used)))
    draft.lm_head.weight.data.copy_(target.get_output_embeddings().weight.detach().float()[used])
    return draft, used


def ttt_logits(draft: Eagle3Draft, embed: torch.nn.Module, states: torch.Tensor, tokens: torch.Tensor, steps: int):
    """Each step's draft logits `[A, Vd]` over one sequence: `states` `[n, A * H]`, `tokens` `[n]`."""
    layer, n = draft.layers[0], len(tokens)
    anchors = torch.arange(n - 1)  # [A]
    hidden = draft.fc(states[:-1].float())  # [A, H] step 0 reads the target's states
    keys, values, logits = [], [], []
    causal = anchors[None] <= anchors[:, None]  # [A, A] the target's positions up to the anchor
    for step in range(steps):
        embeds = embed(tokens[(anchors + step + 1).clamp(max=n - 1)]).float()  # [A, H]
        normed = layer.hidden_norm(hidden)
        residual = normed if layer.norm_before_residual else hidden
        inputs = torch.cat([layer.input_layernorm(embeds), normed], -1)[None]  # [1, A, 2H]
        attention = layer.self_attn
        shape = (1, n - 1, -1, attention.head_dim)
        query, key, value = (
            proj(inputs).view(shape).transpose(1, 2) for proj in (attention.q_proj, attention.k_proj, attention.v_proj)
        )
        cos, sin = draft.rotary_emb(inputs, (anchors + step)[None])
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        keys.append(key)
        values.append(value)
        # step j sees step 0 up to its anchor and steps 1..j at its anchor (a drafted chain's nodes)
        mask = torch.cat([causal, *[torch.eye(n - 1, dtype=torch.bool)] * step], 1)  # [A, (step + 1) A]
        attended = torch.nn.functional.scaled_dot_product_attention(
            query, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, scale=attention.scaling, enable_gqa=True
        )  # [1, heads, A, head_dim]
        hidden = residual + attention.o_proj(attended.transpose(1, 2).reshape(n - 1, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))  # [A, H]
        logits.append(draft.draft_logits(hidden))
    return logits


def ttt_loss(
    draft, embed, states, tokens, labels, prompt_length, to_draft, settings
) -> tuple[torch.Tensor, list, list]:
    """The weighted loss of one sequence, and each step's (correct, counted) top-1 predictions."""
    n = len(tokens)
    total, correct, counted = states.new_zeros((), dtype=torch.float32), [], []
    for step, logits in enumerate(ttt_logits(draft, embed, states, tokens, settings.ttt_steps)):
        predicted_at = torch.arange(n - 1) + step + 1  # [A] the position whose next token step j predicts
        wanted = to_draft[labels[predicted_at.clamp(max=n - 1)].long()]  # [A] draft ids, -1 outside its vocabulary
        valid = (predicted_at < n) & (predicted_at + 1 >= prompt_length) & (wanted >= 0)
        if valid.any():
            total = total + settings.step_decay**step * torch.nn.functional.cross_entropy(logits[valid], wanted[valid])
        correct.append(int((logits[valid].argmax(-1) == wanted[valid]).sum()))
        counted.append(int(valid.sum()))
    return total, correct, counted


def train_eagle3(
    target: torch.nn.Module, data: dict, settings: Eagle3TrainSettings, out_dir: Path, base_model: str = ""
) -> tuple[Eagle3Draft, dict]:
    """Train a layer on distilled data; resumes from `out_dir`'s state when its settings match."""
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    embed = target.get_input_embeddings()
    generator = torch.Generator().manual_seed(settings.seed)
    order = torch.randperm(len(data["tokens"]), generator=generator).tolist()
    held, kept = order[: int(len(order) * settings.holdout)], order[int(len(order) * settings.holdout) :]
    torch.manual_seed(settings.seed)
    draft, used = new_layer(target, data, settings)
    to_draft = torch.full((target.config.vocab_size,), -1, dtype=torch.long)
    to_draft[used] = torch.arange(len(used))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(settings.warmup_steps, settings.steps))
    parts = {"draft": draft, "optimizer": optimizer, "schedule": schedule}

    def sequence(index: int):
        tokens, labels = torch.tensor(data["tokens"][index]), data["labels"][index]
        return data["states"][index], tokens, labels, data["prompt_lengths"][index]

    @torch.no_grad()
    def evaluate(indices: list[int]) -> list[float]:
        sums = [[0, 0] for _ in range(settings.ttt_steps)]
        for index in indices:
            _, correct, counted = ttt_loss(draft, embed, *sequence(index), to_draft, settings)
            for step, (hits, count) in enumerate(zip(correct, counted)):
                sums[step][0] += hits
                sums[step][1] += count
        return [round(hits / max(count, 1), 4) for hits, count in sums]

    state_path = out_dir / STATE_FILE
    log = {"settings": settings.model_dump(), "train_sequences": len(kept), "eval_sequences": len(held)}
    step, elapsed, log = resume_state(state_path, settings.model_dump(), parts, generator) or (0, 0.0, log)
    evaluated = held or kept[:16]  # no holdout: a few training sequences
    log.setdefault("accuracy_before", evaluate(evaluated))
    bar = tqdm(total=settings.steps, initial=step, desc="training the EAGLE-3 layer", unit="step")
    started = time.perf_counter() - elapsed
    while step < settings.steps:
        picks = torch.randint(len(kept), (settings.sequences_per_step,), generator=generator).tolist()
        loss = sum(ttt_loss(draft, embed, *sequence(kept[pick]), to_draft, settings)[0] for pick in picks)
        optimizer.zero_grad()
        (loss / len(picks)).backward()
        optimizer.step()
        schedule.step()
        step += 1
        bar.update()
        bar.set_postfix(loss=f"{loss.item() / len(picks):.3f}")
        if step % settings.checkpoint_every == 0 or step == settings.steps:
            log["train_loss"] = round(loss.item() / len(picks), 4)
            elapsed = time.perf_counter() - started
            save_state(state_path, settings.model_dump(), parts, generator, step, elapsed, log)
    bar.close()
    log["accuracy_after"] = evaluate(evaluated)
    log["train_seconds"] = round(time.perf_counter() - started, 1)
    save_eagle3(draft, out_dir, base_model)
    (out_dir / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
    return draft, log


def train_eagle3_heads(
    target: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    out_dir: Path,
    distill_settings: Optional[DistillSettings] = None,
    train_settings: Optional[Eagle3TrainSettings] = None,
    eos_ids=(),
    base_model: str = "",
    answers: Optional[Sequence[Sequence[int]]] = None,
) -> tuple[Eagle3Draft, dict]:
    """Both stages: distill the target's states and labels over the prompts and their answers
    (its own continuations, or `answers`), then train the layer."""
    data = distill_eagle3(target, prompts, distill_settings or DistillSettings(), out_dir, eos_ids, answers)
    return train_eagle3(target, data, train_settings or Eagle3TrainSettings(), out_dir, base_model)
