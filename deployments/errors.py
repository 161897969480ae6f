"""What a client of the served path is told when a request fails, for HTTP and gRPC alike:
its own error (invalid), a target worker that is gone or late (unavailable, retry), or a bug
(internal: only the request id reaches the client; the traceback goes to the log)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Optional

from pydantic import ValidationError

from specdec_core.errors import SpecdecError, format_validation_errors

logger = logging.getLogger(__name__)


class WorkerUnavailable(RuntimeError):
    """The target worker is gone or late: the request cannot finish now, a retry may."""


@dataclass
class Failure:
    kind: Literal["invalid", "unavailable", "internal"]
    message: str  # safe to show the client
    param: Optional[str] = None  # the request field at fault, for field errors


def describe(error: Exception, request_id: str) -> Failure:
    if isinstance(error, ValidationError):
        first = ".".join(str(part) for part in error.errors()[0]["loc"]) or None
        return Failure("invalid", format_validation_errors(error.errors(), "body"), first)
    if isinstance(error, SpecdecError):
        return Failure("invalid", str(error))
    if isinstance(error, WorkerUnavailable):
        return Failure("unavailable", f"{error}; retry later (request id {request_id})")
    logger.error("request %s failed", request_id, exc_info=error)
    return Failure("internal", f"internal error (request id {request_id})")
