"""What a client of the served path is told when a request fails, for HTTP and gRPC alike:
its own error (invalid), a target worker that is gone or late (unavailable, retry) or full
(overloaded, retry), or a bug (internal: only the request id reaches the client; the traceback
goes to the log)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Optional

from pydantic import ValidationError

from specdec_core.api.errors import SpecdecError, format_validation_errors

logger = logging.getLogger(__name__)


class WorkerUnavailable(RuntimeError):
    """The target worker is gone or late: the request cannot finish now, a retry may."""


class WorkerOverloaded(WorkerUnavailable):
    """The target worker has no room for another session now (admission.py): retry later."""


@dataclass
class Failure:
    kind: Literal["invalid", "unavailable", "overloaded", "internal"]
    message: str  # safe to show the client
    param: Optional[str] = None  # the request field at fault, for field errors


UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "ComponentSpec"}


def field_of(error: dict) -> Optional[str]:
    """The request field a pydantic error is about, as the client named it: a request's sampling
    settings are top-level fields in the OpenAI API."""
    if "param" in error.get("ctx", {}):
        return error["ctx"]["param"]
    parts = [str(part) for part in error["loc"] if part != "body"]
    if parts[:1] == ["sampling"]:
        parts = parts[1:]
    for index, part in enumerate(parts):  # a union's member tag ("str", "list[int]") ends the field path
        if part in UNION_TAGS or "[" in part:
            parts = parts[:index]
            break
    return ".".join(parts) or None


def describe(error: Exception, request_id: str) -> Failure:
    if isinstance(error, ValidationError):
        return Failure("invalid", format_validation_errors(error.errors(), "body"), field_of(error.errors()[0]))
    if isinstance(error, SpecdecError):
        return Failure("invalid", str(error), error.param)
    if isinstance(error, WorkerOverloaded):
        return Failure("overloaded", f"the service is at capacity; retry later (request id {request_id})")
    if isinstance(error, WorkerUnavailable):
        return Failure("unavailable", f"{error}; retry later (request id {request_id})")
    logger.error("request %s failed", request_id, exc_info=error)
    return Failure("internal", f"internal error (request id {request_id})")
