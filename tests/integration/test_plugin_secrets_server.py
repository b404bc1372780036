"""A real CPU SGLang server with a compaction token file: the token is neither in the
unauthenticated GET /server_info (which echoes the launch command) nor in the server log."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from harness.launch import SGLangServer, free_port

pytestmark = pytest.mark.sglang

SECRET = "s3cret-compaction-token-7c41"


def test_token_is_not_echoed_by_server_info_or_the_log(
    prepared_model: Path, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    token_file.chmod(0o600)
    log = tmp_path / "server.log"
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens: compactions would fall back
    extra = ["--compaction-endpoint", endpoint, "--compaction-token-file", str(token_file)]
    with SGLangServer(prepared_model, log_path=log, max_total_tokens=4096, extra_args=extra) as srv:
        with urllib.request.urlopen(srv.url + "/server_info", timeout=30) as resp:
            body = resp.read().decode()
        info = json.loads(body)
        assert "--compaction-token-file" in info["launch_command"]
        assert SECRET not in body
        out = srv.generate("The capital of France is", max_new_tokens=4)
        assert out["meta_info"]["completion_tokens"] > 0
    text = log.read_text(errors="replace")
    assert "sglang_ext: compaction plugin active" in text
    assert SECRET not in text
