"""compactor.describe_error: what the plugin logs of a service's error is one bounded line."""

from __future__ import annotations

import grpc

from compactor import describe_error
from compactor.client import ERROR_TEXT_CHARS


def test_a_grpc_error_is_one_escaped_bounded_line() -> None:
    details = "bad\nFAKE LOG LINE: all compactions succeeded\x1b[2J" + "x" * 1000
    err = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(),
                               grpc.aio.Metadata(), details=details)  # fmt: skip
    text = describe_error(err)
    assert text.startswith("AioRpcError(INTERNAL: bad\\nFAKE LOG LINE") and text.endswith("...)")
    assert "\n" not in text and "\x1b" not in text
    assert len(text) <= len("AioRpcError()...") + ERROR_TEXT_CHARS
    assert (
        describe_error(ValueError("checksum\r\nmismatch")) == "ValueError(checksum\\r\\nmismatch)"
    )
    assert describe_error(None) == "-"
