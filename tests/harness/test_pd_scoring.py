"""`harness.pd.pd_teacher_forced` against a loopback HTTP stand-in for the PD router: a request
whose KV transfer SGLang reports failed is sent once more; any other error status stops the
scoring with the body the server sent. (Through a real router and PD pair:
`benchmarks/server/pd.py`'s `pd_logprobs` figures.)"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from harness.launch import HTTPStatusError
from harness.pd import PDRouter, pd_teacher_forced

PROMPT = [5, 6, 7]
ANSWER = [11, 12, 13, 14]
TRANSFER_FAILED = (
    "Decode transfer failed for request rank=0 with exception KVTransferError(bootstrap_room=1):"
    " Request 1 timed out after 90.0s in KVPoll.WaitingForInput"
)


class _Router(BaseHTTPRequestHandler):
    """Answers each greedy request as decode would: the answer's next two tokens, the second
    with log-prob -0.1 * its position. The first `fail` requests get a 500 with `reason`."""

    fail = 0
    reason = ""
    seen: ClassVar[list[int]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        j = len(body["input_ids"]) - len(PROMPT) + 1  # the answer token decode scores
        type(self).seen.append(j)
        if type(self).fail > 0:
            type(self).fail -= 1
            self._send(500, {"error": {"message": type(self).reason}})
            return
        first, second = ANSWER[j - 1], ANSWER[j]
        self._send(200, {"output_ids": [first, second], "meta_info": {
            "output_token_logprobs": [[-0.5, first, None]],
            "output_token_ids_logprobs": [None, [[-0.1 * j, second, None]]],
            "output_top_logprobs": [None, [[-0.1 * j, second, None]]],
        }})  # fmt: skip

    def _send(self, status: int, payload: dict[str, object]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _router(tmp_path: Path, fail: int, reason: str) -> Iterator[PDRouter]:
    _Router.fail, _Router.reason, _Router.seen = fail, reason, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield PDRouter("http://unused", 0, "http://unused", tmp_path / "router.log",
                       port=server.server_address[1], env={})  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()


def test_a_failed_kv_transfer_is_sent_once_more(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _router(tmp_path, fail=1, reason=TRANSFER_FAILED) as router:
        forced = pd_teacher_forced(router, PROMPT, ANSWER, parallel=1)
    assert forced.logprobs == [-0.5, pytest.approx(-0.1), pytest.approx(-0.2),
                               pytest.approx(-0.3)]  # fmt: skip
    assert forced.top1 == ANSWER
    assert _Router.seen == [1, 1, 2, 3]  # token 1's request twice, the others once
    assert "token 1 sent again" in capsys.readouterr().err


def test_a_second_transfer_failure_or_another_error_stops_with_the_servers_reason(
    tmp_path: Path,
) -> None:
    with (
        _router(tmp_path, fail=2, reason=TRANSFER_FAILED) as router,
        pytest.raises(HTTPStatusError, match="KVTransferError") as err,
    ):
        pd_teacher_forced(router, PROMPT, ANSWER, parallel=1)
    assert err.value.status == 500
    assert _Router.seen[:2] == [1, 1]  # sent once more, not a third time
    with (
        _router(tmp_path, fail=1, reason="out of memory") as router,
        pytest.raises(HTTPStatusError, match=r"500: .*out of memory"),
    ):
        pd_teacher_forced(router, PROMPT, ANSWER, parallel=1)
    assert _Router.seen.count(1) == 1  # not sent again
