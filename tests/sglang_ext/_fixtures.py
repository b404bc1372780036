"""Helpers the plugin's tests share: a `ServerArgs` stand-in with SGLang's defaults
(`server_args`), the plugin's flags parsed onto it (`parse_flags`), and `register()` run as a
serving process does (`serving_registration`)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_ext.adapter.server_args import DEFAULT_CACHE_FEATURES
from sglang_ext.config import add_cli_args


def serving_registration(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`register()` as a serving process (started with --compaction-endpoint) runs it."""
    from sglang_ext.adapter import hooks

    monkeypatch.setenv(hooks.ACTIVE_ENV, "1")
    monkeypatch.setattr(hooks, "_registered", False)
    hooks.register()
    return hooks


def server_args(**kw: Any) -> Any:
    """The fields apply_to_server_args reads, as SGLang's ServerArgs has them by default."""
    base = dict(device=None, attention_backend=None, prefill_attention_backend=None,
                decode_attention_backend=None, radix_cache_backend=None, page_size=None,
                disable_radix_cache=False, disable_cuda_graph=False, cuda_graph_config=None,
                cuda_graph_backend_decode=None, cuda_graph_backend_prefill=None,
                radix_eviction_policy="lru",
                **{name: False for name, _, _ in DEFAULT_CACHE_FEATURES})  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def parse_flags(argv: list[str]) -> tuple[Any, argparse.Namespace]:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return server_args(device="cpu"), p.parse_args(argv)
