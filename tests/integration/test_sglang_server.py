"""The real SGLang server on CPU with the prepared model and our plugin installed (loaded,
no --compaction-endpoint: off), and SGLang with the plugin not loaded at all (stock)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.launch import SGLangServer, stock_plugins
from sglang_ext.adapter.hooks import ANNOUNCEMENT, FLAG_HOOKS

pytestmark = pytest.mark.sglang

DOC = " ".join(
    f"Section {i}: the lighthouse keeper logged {i * 7} ships and {i * 3} storms."
    for i in range(40)
)


@pytest.fixture(scope="module")
def server(
    prepared_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    with SGLangServer(prepared_model, log_path=log, max_total_tokens=4096) as srv:
        yield srv


def test_generate_answers(server: SGLangServer) -> None:
    out = server.generate("The capital of France is", max_new_tokens=8)
    assert "paris" in out["text"].lower()
    assert out["meta_info"]["completion_tokens"] > 0


def test_shared_prefix_is_served_from_the_radix_cache(server: SGLangServer) -> None:
    first = server.generate(DOC + "\nQuestion: how many ships in section 3?\nAnswer:")
    second = server.generate(DOC + "\nQuestion: how many storms in section 5?\nAnswer:")
    prompt_tokens = second["meta_info"]["prompt_tokens"]
    cached = second["meta_info"]["cached_tokens"]
    assert first["meta_info"]["prompt_tokens"] > 400
    # the whole shared document is reused, the differing question is not
    assert prompt_tokens - 20 < cached < prompt_tokens, (cached, prompt_tokens)


def test_plugin_is_loaded_by_sglang(server: SGLangServer) -> None:
    log = Path(server.log_path).read_text(errors="replace")
    assert "Failed to load plugin compaction" not in log
    assert "Failed to execute general plugin: compaction" not in log
    assert ANNOUNCEMENT in log


def test_off_means_off_in_every_process(server: SGLangServer) -> None:
    """Without --compaction-endpoint, each SGLang process (server, scheduler, detokenizer)
    registers the flag hooks and no per-request or per-forward hook: the announcement lists
    what SGLang's HookRegistry holds of ours in that process."""
    log = Path(server.log_path).read_text(errors="replace")
    lines = re.findall(re.escape(ANNOUNCEMENT) + r" \((.*)\)", log)
    assert len(lines) >= 2, log[-3000:]  # the main process and the scheduler at least
    flags_only = ", ".join(sorted(".".join(t.split(".")[-2:]) for t, _ in FLAG_HOOKS))
    assert all(ln == f"off: no --compaction-endpoint; hooks: {flags_only}" for ln in lines), lines
    assert "wraps" not in log and "Tree cache initialized" in log


def test_stock_sglang_does_not_load_the_plugin() -> None:
    """`SGLangServer(plugin=False)`'s allow-list keeps our plugin out: SGLang then knows none of
    its flags (the same environment the stock servers of the demo and benchmarks get)."""
    env = {"SGLANG_PLUGINS": stock_plugins()}
    cmd = [sys.executable, "-m", "sglang.launch_server", "--help"]
    helps = {
        name: subprocess.run(cmd, env={**os.environ, **extra}, capture_output=True,
                             text=True, timeout=300).stdout
        for name, extra in (("stock", env), ("plugin", {}))
    }  # fmt: skip
    assert "--compaction-endpoint" in helps["plugin"]
    assert "--compaction-endpoint" not in helps["stock"] and "--model-path" in helps["stock"]
