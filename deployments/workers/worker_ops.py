"""The operations a worker carries out on its model, as typed messages: what a gRPC handler asks
of its service (servicers.py -> worker_service.py), and what rank 0 of a tensor-parallel group
sends to its other ranks (tensor_parallel.py), so that every rank runs the same operations in the
same order. They travel between ranks as JSON (nothing is pickled) and are checked on arrival."""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from specdec_core.api.request import ComponentSpec
from specdec_core.api.sampling import SamplingParams
from specdec_core.calibration.profile_types import CalibrationSettings
from specdec_core.models.loader import ModelSpec


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Release(Message):
    op: Literal["release"] = "release"
    session_id: str
    commit_tokens: list[int] = []  # a draft session's last commit (drafter.commit), where it has one


class OpenDraft(Message):
    """Open a draft session: its drafter (validated), prompt and sampling (seed resolved)."""

    op: Literal["open_draft"] = "open_draft"
    session_id: str
    prompt_ids: list[int]
    drafter: ComponentSpec
    sampling: SamplingParams
    with_logits: bool  # the server asks for the draft's rows (a policy that reads them)


class OpenTarget(Message):
    """Open a target session; `policy` carries the target-dependent parameters already filled in."""

    op: Literal["open_target"] = "open_target"
    session_id: str
    prompt_ids: list[int]
    policy: ComponentSpec
    sampling: SamplingParams
    heads_kind: Optional[str]  # the kind of the target's heads the drafter reads; None: none
    admitted: bool = True  # False: it waits for its pool's `Admit` before it holds any block
    stop_ids: Optional[list[int]] = (
        None  # set: it decides its verdicts (target/verdicts.py), these held back in min_tokens
    )


class Admit(Message):
    """A target session the pool admits: its prompt's cached blocks; the tokens to prefill."""

    op: Literal["admit"] = "admit"
    session_id: str


class DraftRow(Message):
    """A session's part of a draft step: commit what the verifier kept, then propose."""

    session_id: str
    max_tokens: int
    commit_tokens: list[int]
    batch_rows: int  # the sessions the target's last step held, which prices a block
    after_tokens: list[int] = []  # run-ahead: propose after these, as if committed


class TargetRow(Message):
    """A session's part of a target step: a prompt chunk to prefill, or the last step's commit
    (`commit_keep` tokens or a tree's `commit_path`) and then a block (or `tree`) to score."""

    session_id: str
    tokens: list[int]
    prefill: bool = False
    commit_keep: int = 0
    commit_path: list[int] = Field(default_factory=list)
    tree: str = ""


class DraftStep(Message):
    op: Literal["draft_step"] = "draft_step"
    rows: list[DraftRow]


class TargetStep(Message):
    op: Literal["target_step"] = "target_step"
    rows: list[TargetRow]


class Guess(Message):
    """Apply a session's last commit, then ask its heads for the nodes of `tree` after `root_token`."""

    op: Literal["guess"] = "guess"
    session_id: str
    commit_keep: int
    commit_path: list[int]
    root_token: int
    tree: str


class Preempt(Message):
    """Give a target session's blocks back to the pool, its committed positions' full blocks
    published first (pool_scheduler.py)."""

    op: Literal["preempt"] = "preempt"
    session_id: str


class Resume(Message):
    """A preempted target session runs again: apply the commit its waiting row brings, then
    recompute; the tokens to prefill (`TargetScorer.recompute`)."""

    op: Literal["resume"] = "resume"
    session_id: str
    commit_keep: int = 0
    commit_path: list[int] = Field(default_factory=list)


class MeasureProfile(Message):
    op: Literal["measure_profile"] = "measure_profile"
    spec: ModelSpec
    settings: CalibrationSettings


Operation = Annotated[
    Union[Release, OpenDraft, OpenTarget, Admit, DraftStep, TargetStep, Guess, Preempt, Resume, MeasureProfile],
    Field(discriminator="op"),
]
OPERATIONS = TypeAdapter(Operation)


def operation_from_json(data: bytes) -> Message:
    return OPERATIONS.validate_json(data)
