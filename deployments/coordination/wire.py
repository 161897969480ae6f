"""Conversions between torch/pydantic objects and protobuf messages (no pickle anywhere)."""

from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np
import torch

from protos import specdec_pb2 as pb
from specdec_core.api.errors import SpecdecError
from specdec_core.api.request import ComponentSpec
from specdec_core.api.sampling import SamplingParams
from specdec_core.loop.stage_types import PromptScores, Verdict

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "bool": np.bool_}


def tensor_to_proto(tensor: torch.Tensor) -> pb.Tensor:
    """bf16 (a GPU target's logits) travels as its two bytes an entry (numpy has no bf16), half
    of float32's: a sampled request's rows are whole, [K + 1, V] a step."""
    tensor = tensor.detach().cpu().contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return pb.Tensor(dtype=dtype, shape=list(tensor.shape), data=tensor.numpy().tobytes())


def tensor_from_proto(message: pb.Tensor) -> torch.Tensor:
    """The tensor sent; bf16 arrives as float32 (exactly: every bf16 is a float32), which the
    host's policies compute in."""
    bf16 = message.dtype == "bfloat16"
    if message.dtype not in _NUMPY_DTYPES and not bf16:
        raise ValueError(f"unsupported tensor dtype on the wire: {message.dtype!r}")
    numpy_dtype = np.int16 if bf16 else _NUMPY_DTYPES[message.dtype]
    tensor = torch.from_numpy(np.frombuffer(message.data, dtype=numpy_dtype).reshape(tuple(message.shape)).copy())
    return tensor.view(torch.bfloat16).float() if bf16 else tensor


def as_sent(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 tensor received and sent on (a draft's rows, relayed to the target) in the dtype it
    came in: bf16 where every entry is one (`tensor_from_proto` widened it), so relaying costs no
    more bytes than receiving."""
    narrow = tensor.to(torch.bfloat16)
    return narrow if tensor.dtype == torch.float32 and torch.equal(narrow.float(), tensor) else tensor


def wire_tensor(message: Any, field: str) -> Optional[torch.Tensor]:
    """The tensor a caller sent in `message`'s `field` (None where unset): one that does not decode
    is the caller's error, named by its field."""
    if not message.HasField(field):
        return None
    try:
        return tensor_from_proto(getattr(message, field))
    except ValueError as error:
        raise SpecdecError(f"{field}: {error}") from None


def verdict_to_proto(verdict: Verdict) -> pb.ScoreVerdict:
    return pb.ScoreVerdict(num_accepted=verdict.num_accepted, next_token=verdict.next_token, path=verdict.path or [])


def verdict_from_proto(message: pb.ScoreVerdict, num_drafts: int) -> Verdict:
    """A chain's verdict (of `num_drafts` drafts), or a tree's path's."""
    if not 0 <= message.num_accepted <= num_drafts or (message.path and len(message.path) != message.num_accepted + 1):
        raise RuntimeError(f"the target sent a verdict of {message.num_accepted} drafts kept of {num_drafts}")
    if message.path:
        return Verdict.of_path(list(message.path), message.next_token)
    accepted = torch.arange(num_drafts) < message.num_accepted  # [K] the accepted prefix
    return Verdict(message.num_accepted, message.next_token, {"accepted": accepted})


def sampling_to_proto(sampling: SamplingParams) -> pb.Sampling:
    fields = sampling.model_dump(exclude_none=True, exclude={"structured_output"})
    if sampling.structured_output is not None:
        fields["structured_output_json"] = sampling.structured_output.model_dump_json()
    return pb.Sampling(**fields)


def sampling_from_proto(message: pb.Sampling) -> SamplingParams:
    """Validated like any request (pydantic's ValidationError on a bad field); unset optional
    fields take SamplingParams' defaults."""
    optional = ("max_tokens", "seed", "logprobs", "skip_special_tokens", "prompt_logprobs", "repetition_penalty")
    return SamplingParams(
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        min_p=message.min_p,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        logit_bias=dict(message.logit_bias),
        structured_output=json.loads(message.structured_output_json) if message.structured_output_json else None,
        min_tokens=message.min_tokens,
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        include_stop_str_in_output=message.include_stop_str_in_output,
        ignore_eos=message.ignore_eos,
        **{name: getattr(message, name) for name in optional if message.HasField(name)},
    )


def prompt_scores_to_proto(scores: PromptScores) -> pb.PromptScores:
    return pb.PromptScores(
        token_log_probs=tensor_to_proto(scores.token_log_probs),
        top_ids=tensor_to_proto(scores.top_ids),
        top_log_probs=tensor_to_proto(scores.top_log_probs),
    )


def prompt_scores_from_proto(message: pb.PromptScores) -> PromptScores:
    return PromptScores(
        tensor_from_proto(message.token_log_probs),
        tensor_from_proto(message.top_ids),
        tensor_from_proto(message.top_log_probs),
    )


def component_to_proto(spec: ComponentSpec) -> pb.Component:
    return pb.Component(name=spec.name, params_json=json.dumps(spec.params))


def component_from_proto(message: pb.Component) -> ComponentSpec:
    return ComponentSpec(name=message.name, params=json.loads(message.params_json or "{}"))
