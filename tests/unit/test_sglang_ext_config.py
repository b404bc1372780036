"""`apply_to_server_args`: which attention backend `--compaction-endpoint` selects, and what
it refuses."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sglang_ext.config import (
    ATTENTION_BACKEND,
    CONFIG_ATTR,
    RADIX_CACHE_BACKEND,
    TRITON_ATTENTION_BACKEND,
    CompactionConfig,
    apply_to_server_args,
)

CFG = CompactionConfig(endpoint="inproc://")


def server_args(**kw: Any) -> Any:
    """The fields apply_to_server_args reads, as SGLang's ServerArgs has them by default."""
    base = dict(device=None, attention_backend=None, prefill_attention_backend=None,
                decode_attention_backend=None, radix_cache_backend=None, page_size=None,
                disable_radix_cache=False, disable_cuda_graph=False, cuda_graph_config=None,
                cuda_graph_backend_decode=None, cuda_graph_backend_prefill=None)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("device", "attention", "want"),
    [
        ("cpu", None, ATTENTION_BACKEND),
        ("cpu", "torch_native", ATTENTION_BACKEND),
        ("cuda", None, TRITON_ATTENTION_BACKEND),
        ("cuda:1", None, TRITON_ATTENTION_BACKEND),
        ("cuda", "triton", TRITON_ATTENTION_BACKEND),
        ("cuda", TRITON_ATTENTION_BACKEND, TRITON_ATTENTION_BACKEND),
        ("cuda", "torch_native", ATTENTION_BACKEND),  # an explicit torch choice is kept
        ("xpu", None, ATTENTION_BACKEND),
    ],
)
def test_selects_backend_by_device(device: str, attention: str | None, want: str) -> None:
    args = server_args(device=device, attention_backend=attention)
    apply_to_server_args(args, CFG)
    assert args.attention_backend == want
    assert args.radix_cache_backend == RADIX_CACHE_BACKEND and getattr(args, CONFIG_ATTR) is CFG
    assert args.disable_cuda_graph is (want == TRITON_ATTENTION_BACKEND)


@pytest.mark.parametrize(("cuda", "cpu_engine", "want"), [
    (True, "0", TRITON_ATTENTION_BACKEND), (True, "1", ATTENTION_BACKEND),
    (False, "0", ATTENTION_BACKEND),
])  # fmt: skip
def test_unset_device_resolves_like_sglang(
    cuda: bool, cpu_engine: str, want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", cpu_engine)
    args = server_args()
    apply_to_server_args(args, CFG)
    assert args.attention_backend == want


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (
            {"device": "cuda", "attention_backend": "flashinfer"},
            "got --attention-backend 'flashinfer'",
        ),
        (
            {"device": "cpu", "attention_backend": "flashinfer"},
            "got --attention-backend 'flashinfer'",
        ),
        ({"device": "cpu", "attention_backend": "triton"}, "needs a CUDA device, got device 'cpu'"),
        ({"device": "cuda", "cuda_graph_backend_decode": "full"}, "without CUDA graphs.*'full'"),
        (
            {"device": "cuda", "prefill_attention_backend": "fa3"},
            "--prefill-attention-backend 'fa3'",
        ),
        ({"device": "cuda", "page_size": 16}, "page_size 1 only, got 16"),
    ],
)
def test_rejects_incompatible_args(kw: dict[str, Any], match: str) -> None:
    args = server_args(**kw)
    with pytest.raises(ValueError, match=match):
        apply_to_server_args(args, CFG)
    assert not hasattr(args, CONFIG_ATTR)  # nothing applied


def test_cuda_graph_disabled_explicitly_is_accepted() -> None:
    args = server_args(device="cuda", cuda_graph_backend_decode="disabled")
    apply_to_server_args(args, CFG)
    assert args.attention_backend == TRITON_ATTENTION_BACKEND and args.disable_cuda_graph


def test_register_backends_adds_both_attention_backends() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    from sglang_ext.factory import register_backends

    register_backends()
    register_backends()  # idempotent
    for name in (ATTENTION_BACKEND, TRITON_ATTENTION_BACKEND):
        assert name in ATTENTION_BACKENDS and ATTENTION_BACKEND_CHOICES.count(name) == 1


def test_query_option_flags_parse_and_validate() -> None:
    import argparse

    from sglang_ext.config import add_cli_args, config_from_namespace

    p = argparse.ArgumentParser()
    add_cli_args(p)
    cfg = config_from_namespace(p.parse_args(["--compaction-endpoint", "h:1"]))
    assert cfg is not None and cfg.on_policy is True and cfg.follow_up_answer_tokens == 32
    ns = p.parse_args(
        ["--compaction-endpoint", "h:1", "--no-compaction-on-policy",
         "--compaction-follow-up-answer-tokens", "0"]
    )  # fmt: skip
    cfg = config_from_namespace(ns)
    assert cfg is not None and cfg.on_policy is False and cfg.follow_up_answer_tokens == 0
    with pytest.raises(ValueError, match=r"answer-tokens must be in \[0, 256\], got -1"):
        CompactionConfig(endpoint="h:1", follow_up_answer_tokens=-1)
