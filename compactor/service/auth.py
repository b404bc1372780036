"""Bearer-token authentication: a grpc.aio server interceptor (health checks are exempt) and
`TokenFile`, a secret kept in a file and read again when it changes (the bearer token and the
result signing key, in the service and the SGLang plugin)."""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

__all__ = ["TOKEN_HEADER", "TokenAuthInterceptor", "TokenFile"]

TOKEN_HEADER = "authorization"
_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
logger = logging.getLogger(__name__)


class TokenFile:
    """A bearer token kept in a file; `read()` returns it, reading the file again only when
    its (mtime, size, inode) changed since the last read (one `stat` per call otherwise).

    A rotated file takes effect at the next call. While the file is missing, unreadable or
    empty after a good read, the last token read stays in use (a warning is logged);
    without one, `read()` raises.

    Raises (from `read`): OSError (missing or unreadable file), ValueError (empty file).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._token: str | None = None

    def read(self) -> str:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp != self._stamp or self._token is None:
                token = self.path.read_text().strip()
                if not token:
                    raise ValueError(f"auth token file {str(self.path)!r} is empty")
                self._token, self._stamp = token, stamp
        except (OSError, ValueError) as exc:
            if self._token is None:
                raise
            logger.warning("keeping the last token read: %s", exc)
        return self._token


def tenant_of(context: grpc.aio.ServicerContext) -> str:
    """Who is calling, for scoping results: "cn:<common name>" of a verified mTLS client
    certificate, else "" (every caller of the service is one tenant: the token, if any, is
    shared)."""
    names = context.auth_context().get("x509_common_name") or []
    return f"cn:{names[0].decode(errors='replace')}" if names else ""


def token_bytes(token: str | TokenFile | None) -> bytes | None:
    """The current secret as bytes (a TokenFile re-read when it changed); None without one
    (the bearer token, or the key results are signed with: `result_stream.sign`)."""
    if token is None:
        return None
    return (token.read() if isinstance(token, TokenFile) else token).encode()


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) calls without metadata ``authorization: Bearer <token>``.

    `token` is the token itself or a `TokenFile`, checked for changes on every call."""

    def __init__(self, token: str | TokenFile) -> None:
        if isinstance(token, TokenFile):
            token.read()  # fails now for a missing or empty file
        elif not token:
            raise ValueError("auth token is empty")
        self._token = token

    @property
    def _expected(self) -> bytes:
        return b"Bearer " + (token_bytes(self._token) or b"")

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
