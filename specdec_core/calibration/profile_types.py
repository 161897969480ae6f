"""What a target's profile holds (target_profile.py measures it): EASD's calibrated entropy
threshold and the settings it was measured with. Apart from the measurement, so the policies that
take their defaults from a profile can name it without importing what measures it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CalibrationSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    questions_per_category: int = Field(3, ge=1, description="Spec-Bench questions per category (13 categories)")
    max_new_tokens: int = Field(64, ge=1, description="greedy tokens per answer")
    top_fraction: float = Field(0.05, gt=0.0, le=1.0, description="the paper's p: tau_H = mean of the top p")


class TargetProfile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    easd_tau_h: float = Field(description="EASD's calibrated entropy threshold (nats)")
    num_entropies: int = Field(description="target positions the threshold was taken over")
    settings: CalibrationSettings
