"""What a target needs measured once before some policies can use their defaults: EASD's entropy
threshold tau_H, the paper's calibration (the mean of the top 5% of the target's T = 1 entropies
over its own greedy answers to a validation set). Here the validation set is the first
`questions_per_category` Spec-Bench questions of every category (chat template, first turn).

A `TargetProfile` is measured once per model and cached as JSON in the specdec cache
(`profiles/`, beside the converted weights), keyed by content: the checkpoint's (never its path),
the spec's dtype and layers, the device type it runs on and the calibration settings. The
embedded target's default profile on the CPU ships with the package (data/profiles/, under the
name the cache would give it), so a first start need not measure it. The in-process engine
measures a profile on first need; a served target worker measures it at load and serves it
(`Target.Profile`)."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..api.request import GenerationRequest
from ..api.sampling import entropy_of_logits
from ..loop.frontend import Frontend
from ..models.loader import ModelSpec
from ..models.sources import cache_dir, source_identity
from ..policies.easd import calibrate_tau_h
from .cache_files import write_atomically
from .profile_types import CalibrationSettings, TargetProfile
from .questions import DEFAULT_QUESTIONS, first_turn, load_questions

# profiles measured once and shipped, named as in the cache: the embedded target's (fp32, on the
# CPU, default settings; about two minutes of a first start on two cores otherwise)
SHIPPED_PROFILES = Path(str(resources.files("specdec_core") / "data" / "profiles"))


@torch.inference_mode()
def greedy_entropies(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]):
    """The target's T = 1 entropy (nats) at every step of its own greedy answer to `prompt_ids`."""
    eos = sorted(eos_ids) or None
    output = model.generate(
        torch.tensor([prompt_ids], device=model.device),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=model.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=eos,
        pad_token_id=eos[0] if eos else 0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return entropy_of_logits(torch.cat(output.logits).float())


def calibration_prompts(frontend: "Frontend", settings: CalibrationSettings) -> list[list[int]]:
    questions = load_questions(DEFAULT_QUESTIONS, ["all"], settings.questions_per_category)
    return [frontend.encode(GenerationRequest(messages=first_turn(question))) for question in questions]


def measure_profile(
    model: torch.nn.Module,
    frontend: "Frontend",
    settings: CalibrationSettings,
    progress: Callable[[Any], Any] = iter,
) -> TargetProfile:
    entropies = torch.cat(
        [
            greedy_entropies(model, prompt_ids, settings.max_new_tokens, frontend.eos_ids)
            for prompt_ids in progress(calibration_prompts(frontend, settings))
        ]
    )
    return TargetProfile(
        easd_tau_h=round(calibrate_tau_h(entropies, settings.top_fraction), 6),
        num_entropies=entropies.numel(),
        settings=settings,
    )


def profile_path(spec: ModelSpec, settings: CalibrationSettings) -> Path:
    """Where the profile of `spec` is cached: named by the checkpoint's name and a hash of what the
    measurement depends on, so a changed checkpoint is measured anew and a copy of it (another
    clone, another directory) is not."""
    name, content = source_identity(spec.source)
    ignored = {"source", "device", "compile", "compile_layers", "cuda_graphs", "attention"}
    if spec.kv_cache_dtype == "auto":  # the key as before the field existed: shipped profiles stand
        ignored.add("kv_cache_dtype")
    key = json.dumps(
        [
            content,
            spec.model_dump(exclude=ignored),
            spec.torch_device.type,
            settings.model_dump(),
        ]
    )
    return cache_dir() / "profiles" / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"


def cached_profile(spec: ModelSpec, settings: CalibrationSettings) -> Optional[TargetProfile]:
    """The profile of `spec` from the cache, else the one shipped under the same name, else None."""
    path = profile_path(spec, settings)
    for candidate in (path, SHIPPED_PROFILES / path.name):
        if candidate.exists():
            return TargetProfile.model_validate_json(candidate.read_text())
    return None


def store_profile(spec: ModelSpec, profile: TargetProfile) -> None:
    write_atomically(profile_path(spec, profile.settings), profile.model_dump_json())


def load_profile(
    spec: ModelSpec,
    model: torch.nn.Module,
    frontend: "Frontend",
    settings: CalibrationSettings,
    progress: Callable[[Any], Any] = iter,
) -> TargetProfile:
    """The cached (or shipped) profile of `spec`, measured and cached when there is none."""
    profile = cached_profile(spec, settings)
    if profile is None:
        profile = measure_profile(model, frontend, settings, progress)
        store_profile(spec, profile)
    return profile


def calibration_progress(spec_name: str) -> Callable[[Any], Any]:
    from tqdm.auto import tqdm

    return lambda prompts: tqdm(prompts, desc=f"calibrating EASD tau_h for {spec_name}", unit="prompt")
