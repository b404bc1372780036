"""End to end: a real SGLang server started with `--model-path org/name`, a Hugging Face Hub ID
found in the local hub cache (offline, as SGLang and transformers resolve it), compacts.

The plugin resolves the Hub ID to its cached snapshot before the weights load and
fingerprints it; the in-process compactor loads the same snapshot, so the fingerprints agree
and the compacted prefix installs. A disk weight update naming the Hub ID reloads the same
checkpoint (same fingerprint), so compaction goes on after it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from compactor.models import fingerprint
from harness.launch import SGLangServer
from harness.workload import (
    QUICK_ANSWER_TOKENS,
    compaction_args,
    document,
    metric,
    prompt,
    questions,
)
from tests.compactor._fixtures import make_hub_cache

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

REPO = "compactor-test/smollm2-135m"


def _installed(srv: SGLangServer, target: int, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(srv, "sglang:compaction_installed_total") < target:
        assert metric(srv, "sglang:compaction_fallbacks_total") == 0, srv.log_tail()
        assert time.monotonic() < deadline, srv.log_tail()
        time.sleep(2)


def test_server_started_from_a_cached_hub_id_compacts(prepared_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = make_hub_cache(cache, REPO, prepared_model)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    args = [
        *compaction_args(
            "inproc://",
            0.1,
            min_hits=2,
            min_prefix_tokens=256,
            timeout_s=400,
            answer_tokens=QUICK_ANSWER_TOKENS,
        ),
        "--enable-metrics",
    ]
    doc = document(24)  # ~400 tokens: a short compaction on 2 busy cores
    with SGLangServer(
        REPO, log_path=tmp_path / "server.log", max_total_tokens=4096, extra_args=args, env=env
    ) as srv:
        for q in questions()[:3]:
            assert srv.generate(prompt(doc, q), max_new_tokens=4)["output_ids"]
        _installed(srv, 1)
        assert metric(srv, "sglang:compaction_physical_tokens") > 0
        # the same checkpoint reloaded by its Hub ID: same fingerprint, compaction goes on
        out = srv.post("/update_weights_from_disk", {"model_path": REPO})
        assert out["success"], out
        for q in questions()[3:]:
            assert srv.generate(prompt(doc, q), max_new_tokens=4)["output_ids"]
        _installed(srv, 2)
        log = Path(srv.log_path).read_text(errors="replace")
    assert f"fingerprint={fingerprint(prepared_model)}" in log
    assert fingerprint(snapshot) == fingerprint(prepared_model)
