"""Per-head budgets free real memory: real CPU servers compact a shared document with budgets
that differ per layer and KV head (am-highest with `--compaction-head-budgets auto`, and
gvote, which picks its own), and the prefix holds at most 1.05 x the sum of the budgets plus
one page of SGLang's pool, read from the server's own metrics. Padding every head to the
longest one (the layout before packing) would have held `longest_head` slots."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.launch import SGLangServer, start_all
from harness.workload import QUICK_ANSWER_TOKENS, compaction_args, document, metric, prompt

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
TIMEOUT_S = 300
QUESTIONS = ["Who is the mayor of the town?", "Which colour is the mayor's boat?"]
INSTALLED = re.compile(
    r"installed compacted prefix .* slots=(\d+) .* entries=(\d+) longest_head=(\d+)"
)


@pytest.fixture(scope="module")
def model_with_curves(prepared_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's files (linked) plus am-highest's sensitivity curves, made by
    `compactor sensitivity` on a short document: what `--compaction-head-budgets auto` reads."""
    model = tmp_path_factory.mktemp("model")
    for f in prepared_model.iterdir():
        (model / f.name).symlink_to(f)
    subprocess.run(
        [sys.executable, "-m", "compactor", "sensitivity", "--model", str(model),
         "--method", "am-highest", "--tokens", "300", "--fractions", "0.05,0.1,0.3",
         "--answer-tokens", "4", "--no-progress"],
        check=True, timeout=600,
    )  # fmt: skip
    assert (model / "sensitivity.am-highest.json").is_file()
    return model


def test_per_head_budgets_hold_their_sum_in_the_pool(
    model_with_curves: Path, tmp_path: Path
) -> None:
    doc = document(24)  # ~400 tokens: short compactions on 2 busy cores
    cases = {
        "auto": ["--compaction-head-budgets", "auto"],
        "gvote": [],
    }
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, extra in cases.items():
            method = "gvote" if name == "gvote" else "am-highest"
            flags = [
                *compaction_args("inproc://", 0.1, method, min_hits=2, min_prefix_tokens=256,
                                 timeout_s=TIMEOUT_S, answer_tokens=QUICK_ANSWER_TOKENS),
                *extra, "--compaction-query-sources", "follow-up", "--enable-metrics",
            ]  # fmt: skip
            servers[name] = SGLangServer(model_with_curves, tmp_path / f"sglang-{name}.log",
                                         max_total_tokens=4096, extra_args=flags)  # fmt: skip
        start_all(stack, list(servers.values()))
        for srv in servers.values():
            for q in QUESTIONS:
                srv.generate(prompt(doc, q), max_new_tokens=4)
        found = {}
        for name, srv in servers.items():
            deadline = time.monotonic() + TIMEOUT_S
            while metric(srv, "sglang:compaction_installed_total") < 1:
                assert metric(srv, "sglang:compaction_fallbacks_total") == 0, srv.log_tail()
                assert time.monotonic() < deadline, srv.log_tail()
                time.sleep(2)
            logical = metric(srv, "sglang:compaction_logical_tokens")
            after = [srv.generate(prompt(doc, q), max_new_tokens=4) for q in QUESTIONS]
            for out in after:  # served from the compacted prefix
                assert out["meta_info"]["cached_tokens"] >= logical > 0, out["meta_info"]
            log = Path(srv.log_path).read_text(errors="replace")
            found[name] = (
                metric(srv, "sglang:compaction_physical_tokens"),
                metric(srv, "sglang:compaction_kept_entries"),
                INSTALLED.search(log),
            )
    cfg = __import__("json").loads((model_with_curves / "config.json").read_text())
    cells = cfg["num_hidden_layers"] * cfg["num_key_value_heads"]  # per slot
    page = 1  # SGLang's CPU pool: one slot per page
    for name, (physical, kept, line) in found.items():
        assert line is not None, name
        slots, entries, longest = (int(x) for x in line.groups())
        assert (slots, entries) == (physical, kept), name  # the log and the metrics agree
        # memory is the sum of the budgets (within 5% plus one page), read from the server
        assert physical * cells <= 1.05 * kept + page * cells, (name, physical, kept)
        # the budgets differ per head: padded to the longest head they would hold `longest`
        # slots of every layer and head
        assert longest > physical and longest * cells > 1.2 * kept, (name, longest, kept)
        print(f"\n{name}: {int(kept)} entries in {int(physical)} slots x {cells} cells "
              f"(padded to the longest head: {longest} slots)")  # fmt: skip
