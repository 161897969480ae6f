"""Validation helpers shared by the policy and drafter registries."""

from __future__ import annotations

from typing import Any, Optional, TypeVar

from pydantic import BaseModel, ValidationError

ParamsT = TypeVar("ParamsT", bound=BaseModel)


class SpecdecError(ValueError):
    """Invalid user input (request, policy, drafter): the message says what and why."""


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
