"""Validation helpers shared by the policy and drafter registries, and the errors a caller maps
to a status of its own."""

from __future__ import annotations

from typing import Any, Optional, Sequence, TypeVar

from pydantic import BaseModel, ValidationError

ParamsT = TypeVar("ParamsT", bound=BaseModel)


class SpecdecError(ValueError):
    """Invalid user input (request, policy, drafter): the message says what and why, `param`
    names the request field at fault where there is one."""

    param: Optional[str] = None

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        if param is not None:
            self.param = param


class GroupBroken(RuntimeError):
    """Another rank of a model's process group is gone (a tensor-parallel peer, a pipeline
    stage): the step cannot finish, and the worker is rebuilt (served: 503, not a bug)."""


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Every id within the vocabulary (a direct caller of a worker is checked the same way)."""
    if not all(0 <= token < vocab_size for token in token_ids):
        raise SpecdecError(f"{param}: token ids must lie in [0, {vocab_size})", param)


def format_validation_errors(errors: list[dict], root: str) -> str:
    """`loc: msg; ...` for pydantic (or FastAPI) error dicts; FastAPI's leading "body" is
    dropped and an empty location is shown as `root`."""
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc'] if part != 'body') or root}: {error['msg']}" for error in errors
    )


def validate_params(params_cls: type[ParamsT], params: Optional[dict[str, Any]], what: str) -> ParamsT:
    """`params_cls(**params)` with pydantic errors turned into one readable SpecdecError."""
    if params is not None and not isinstance(params, dict):
        raise SpecdecError(f"parameters for {what} must be an object, got {type(params).__name__}")
    try:
        return params_cls(**(params or {}))
    except ValidationError as error:
        details = format_validation_errors(error.errors(), "params")
        raise SpecdecError(f"bad parameters for {what}: {details}") from None
