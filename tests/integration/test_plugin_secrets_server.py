"""A real CPU SGLang server and `compactor serve`, sharing a bearer token file and a result
signing key file: the token is neither in the unauthenticated GET /server_info (which echoes
the launch command) nor in either log; results are signed with the key; and a rotation of
the token file on both sides keeps compaction working with no restart (the plugin's client
once kept signing with the old token and refused every later result)."""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from pathlib import Path

import pytest

from harness.launch import CompactorService, SGLangServer, start_all
from harness.workload import (
    QUICK_ANSWER_TOKENS,
    compaction_args,
    document,
    prompt,
    wait_for_compactions,
)

pytestmark = pytest.mark.sglang

SECRET = "s3cret-compaction-token-7c41"
ROTATED = "r0tated-compaction-token-91be"
SIGNING = "s1gning-key-never-sent-2d5f"
QUESTIONS = ["Who is the mayor of the town?", "Which colour is the mayor's boat?"]


def _write(path: Path, text: str) -> None:
    """Rewrite a secret file with a new mtime (coarse file-system timestamps)."""
    old = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text + "\n")
    path.chmod(0o600)
    os.utime(path, ns=(old + 2_000_000_000, old + 2_000_000_000))


def test_token_is_kept_secret_and_a_rotation_keeps_compaction_on(
    plumbing_model: Path, tmp_path: Path
) -> None:
    token, key = tmp_path / "token", tmp_path / "signing-key"
    _write(token, SECRET)
    _write(key, SIGNING)
    logs = {name: tmp_path / f"{name}.log" for name in ("service", "server")}
    with contextlib.ExitStack() as stack:
        svc = CompactorService(plumbing_model, logs["service"], in_process=True,
                               extra_args=["--auth-token-file", str(token),
                                           "--signing-key-file", str(key)])  # fmt: skip
        start_all(stack, [svc])
        extra = [*compaction_args(svc.endpoint, 0.1, min_hits=2, min_prefix_tokens=256,
                                   answer_tokens=QUICK_ANSWER_TOKENS),
                 "--compaction-query-sources", "follow-up", "--enable-metrics",
                 "--compaction-token-file", str(token),
                 "--compaction-signing-key-file", str(key)]  # fmt: skip
        srv = SGLangServer(plumbing_model, logs["server"], max_total_tokens=4096, extra_args=extra)
        start_all(stack, [srv])
        with urllib.request.urlopen(srv.url + "/server_info", timeout=30) as resp:
            body = resp.read().decode()
        assert "--compaction-token-file" in json.loads(body)["launch_command"]
        assert SECRET not in body and SIGNING not in body
        for n, doc in enumerate((document(24, 0), document(24, 1)), 1):
            if n == 2:  # rotated on both sides, as a mounted secret is
                _write(token, ROTATED)
            for q in QUESTIONS:
                srv.generate(prompt(doc, q), max_new_tokens=4)
            counts = wait_for_compactions(srv, n, 300, progress=False)
            assert counts["installed_total"] == n and counts["fallbacks_total"] == 0, srv.log_tail()
    text = logs["server"].read_text(errors="replace") + logs["service"].read_text(errors="replace")
    assert "sglang_ext: compaction plugin active" in text
    assert "compaction token file changed: the new token is in use" in text
    assert not any(s in text for s in (SECRET, ROTATED, SIGNING))
