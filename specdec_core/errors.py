"""Validation helpers shared by the policy and drafter registries."""

from __future__ import annotations

from typing import Any, Optional, TypeVar

from pydantic import BaseModel, ValidationError

ParamsT = TypeVar("ParamsT", bound=BaseModel)


class SpecdecError(ValueError):
    """Invalid user input (request, policy, drafter): the message says what and why."""


def validate_params(
    params_cls: type[ParamsT], params: Optional[dict[str, Any]], what: str
) -> ParamsT:
    """`params_cls(**params)` with pydantic errors turned into one readable SpecdecError."""
    if params is not None and not isinstance(params, dict):
        raise SpecdecError(f"parameters for {what} must be an object, got {type(params).__name__}")
    try:
        return params_cls(**(params or {}))
    except ValidationError as error:
        details = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'params'}: {e['msg']}" for e in error.errors())
        raise SpecdecError(f"bad parameters for {what}: {details}") from None
