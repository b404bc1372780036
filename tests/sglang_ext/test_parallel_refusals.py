"""`apply_to_server_args` refuses the parallel layouts and features the plugin cannot serve
with, naming the flag, and leaves the record untouched; TP with a service and DP replicas
are accepted (prefill/decode disaggregation: tests/sglang_ext/test_pd.py)."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_ext.adapter.server_args import CONFIG_ATTR, apply_to_server_args
from sglang_ext.config import RADIX_CACHE_BACKEND, CompactionConfig
from tests.sglang_ext._fixtures import server_args

SERVICE = CompactionConfig(endpoint="127.0.0.1:50051")
INPROC = CompactionConfig(endpoint="inproc://")


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"pp_size": 2}, "--pp-size 2"),
        (
            {"disaggregation_mode": "prefill"},
            "--disaggregation-mode 'prefill': .* without their beta",
        ),
        ({"enable_dp_attention": True, "dp_size": 2}, "--enable-dp-attention True"),
        ({"attn_dp_size": 2}, "--attn-dp-size 2"),
        ({"attn_cp_size": 2}, "--attn-cp-size 2"),
        ({"dcp_size": 2}, "--dcp-size 2"),
        ({"speculative_algorithm": "EAGLE"}, "--speculative-algorithm 'EAGLE'"),
        ({"speculative_algorithm": "NGRAM"}, "--speculative-algorithm 'NGRAM'"),
    ],
)
def test_refuses_layout(kw: dict[str, Any], flag: str) -> None:
    args = server_args(device="cpu", **kw)
    with pytest.raises(ValueError, match=f"does not support {flag}"):
        apply_to_server_args(args, SERVICE)
    assert not hasattr(args, CONFIG_ATTR) and args.radix_cache_backend is None


def test_refuses_in_process_compaction_with_tp() -> None:
    args = server_args(device="cpu", tp_size=2)
    with pytest.raises(ValueError, match="inproc:// would compact on each of --tp-size 2"):
        apply_to_server_args(args, INPROC)
    assert not hasattr(args, CONFIG_ATTR)


@pytest.mark.parametrize(
    ("kw", "cfg"),
    [
        ({"tp_size": 4}, SERVICE),  # one rank asks, every rank installs its heads
        ({"dp_size": 2}, SERVICE),  # replicas: own scheduler and cache each
        ({"dp_size": 2}, INPROC),
        ({"pp_size": 1, "disaggregation_mode": "null", "attn_dp_size": 1}, INPROC),  # defaults
    ],
)
def test_accepts_tp_and_dp_replicas(kw: dict[str, Any], cfg: CompactionConfig) -> None:
    args = server_args(device="cpu", **kw)
    apply_to_server_args(args, cfg)
    assert getattr(args, CONFIG_ATTR) is cfg and args.radix_cache_backend == RADIX_CACHE_BACKEND


def test_refuses_the_metadata_glue_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's opt-in metadata graph captures one preparation per batch size whatever the
    graph variant: a compacted batch would replay the stock graphs' preparation."""
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1")
    args = server_args(device="cpu")
    with pytest.raises(ValueError, match=r"SGLANG_ENABLE_METADATA_GLUE_GRAPH=1 .* unset it"):
        apply_to_server_args(args, SERVICE)
    assert not hasattr(args, CONFIG_ATTR)
    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "0")
    apply_to_server_args(args, SERVICE)
    assert getattr(args, CONFIG_ATTR) is SERVICE
