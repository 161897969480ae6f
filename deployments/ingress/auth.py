"""Who may call what: the optional API key of the client-facing APIs (`Authorization: Bearer`
on HTTP, `authorization` metadata on gRPC) and the shared secret between the server and its
workers (`x-specdec-secret` metadata), so that no other local process can drive a worker."""

from __future__ import annotations

import hmac
from typing import Any, Callable, Optional

import grpc

SECRET_METADATA = "x-specdec-secret"


def bearer_matches(authorization: Optional[str], api_key: str) -> bool:
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode())


def metadata_value(metadata: Any, key: str) -> Optional[str]:
    for entry_key, value in metadata or ():
        if entry_key == key:
            return value
    return None


class RequireSecret(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call that does not carry the workers' secret."""

    def __init__(self, secret: str):
        self.secret = secret.encode()

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong worker secret")

        self.refusal = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation: Callable, handler_call_details: Any):
        given = metadata_value(handler_call_details.invocation_metadata, SECRET_METADATA) or ""
        if hmac.compare_digest(given.encode(), self.secret):
            return continuation(handler_call_details)
        return self.refusal


class SendSecret(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the workers' secret to every call on a (grpc.aio) channel."""

    def __init__(self, secret: str):
        self.secret = secret

    async def intercept_unary_unary(self, continuation: Callable, client_call_details: Any, request: Any):
        metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()), (SECRET_METADATA, self.secret))
        return await continuation(client_call_details._replace(metadata=metadata), request)
