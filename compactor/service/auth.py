"""Bearer-token authentication: a grpc.aio server interceptor (health checks are exempt)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

__all__ = ["TOKEN_HEADER", "TokenAuthInterceptor"]

TOKEN_HEADER = "authorization"
_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) calls without metadata ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token is empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(_EXEMPT_PREFIXES):
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        got_b = got.encode() if isinstance(got, str) else bytes(got)
        if hmac.compare_digest(got_b, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def unary(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid auth token")

    async def streaming(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid auth token")
        yield  # pragma: no cover

    des = handler.request_deserializer if handler else None
    ser = handler.response_serializer if handler else None
    req_s = bool(handler and handler.request_streaming)
    resp_s = bool(handler and handler.response_streaming)
    if req_s and resp_s:
        return grpc.stream_stream_rpc_method_handler(streaming, des, ser)
    if req_s:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    if resp_s:
        return grpc.unary_stream_rpc_method_handler(streaming, des, ser)
    return grpc.unary_unary_rpc_method_handler(unary, des, ser)
