"""SGLang settings of its default cache that `--compaction-endpoint` refuses, parsed by
SGLang 0.5.23's own parser into its own ServerArgs (CPU, no model loaded), then handed to
`apply_to_server_args` as the AFTER hook on `ServerArgs.from_cli_args` does."""

from __future__ import annotations

from typing import Any

import pytest

from sglang_ext.adapter.server_args import CONFIG_ATTR, DEFAULT_CACHE_FEATURES, apply_to_server_args
from sglang_ext.config import RADIX_CACHE_BACKEND, CompactionConfig


@pytest.fixture(scope="module")
def sglang_parser() -> Any:
    """SGLang 0.5.23's own launch_server parser with the plugin's flags."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from sglang_ext.config import add_cli_args

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    add_cli_args(parser)
    return parser


def _sglang_server_args(parser: Any, *argv: str) -> tuple[Any, CompactionConfig]:
    """ServerArgs built by SGLang's own `from_cli_args` (CPU, no model loaded) and the
    plugin's config, from one command line."""
    from sglang.srt.server_args import ServerArgs

    from sglang_ext.config import config_from_namespace

    ns = parser.parse_args(["--model-path", "m", "--device", "cpu",
                            "--compaction-endpoint", "inproc://", *argv])  # fmt: skip
    cfg = config_from_namespace(ns)
    assert cfg is not None
    return ServerArgs.from_cli_args(ns), cfg


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
        (["--enable-hicache"], "--enable-hierarchical-cache"),  # SGLang's alias
        (["--enable-lmcache", "--lmcache-config-file", "lmc.yaml"], "--enable-lmcache"),
        (["--hicache-storage-backend", "file"], "--hicache-storage-backend"),
        (["--enable-flexkv"], "--enable-flexkv"),
        (["--enable-unified-cache-external-linker"], "--enable-unified-cache-external-linker"),
        (["--enable-session-radix-cache"], "--enable-session-radix-cache"),
        (["--enable-streaming-session"], "--enable-streaming-session"),
        (["--enable-int8-mamba-checkpoint"], "--enable-int8-mamba-checkpoint"),
        (["--radix-eviction-policy", "lfu"], "--radix-eviction-policy 'lfu'"),
        (["--radix-eviction-policy", "slru"], "--radix-eviction-policy 'slru'"),
        (["--radix-eviction-policy", "tlru"], "--radix-eviction-policy 'tlru'"),
    ],
)
def test_real_sglang_flags_are_refused(sglang_parser: Any, argv: list[str], flag: str) -> None:
    """SGLang's parser and ServerArgs, then the plugin's AFTER-hook work on them."""
    args, cfg = _sglang_server_args(sglang_parser, *argv)
    with pytest.raises(ValueError, match=f"^--compaction-endpoint does not support {flag}"):
        apply_to_server_args(args, cfg)
    assert not hasattr(args, CONFIG_ATTR)


def test_real_sglang_defaults_are_accepted(sglang_parser: Any) -> None:
    """SGLang's defaults pass, and every refused setting is a real flag of a real field."""
    args, cfg = _sglang_server_args(sglang_parser)
    for name, flag, _ in [
        *DEFAULT_CACHE_FEATURES,
        ("radix_eviction_policy", "--radix-eviction-policy", ""),
    ]:
        assert sglang_parser._option_string_actions[flag].dest == name
        assert hasattr(args, name), name
    apply_to_server_args(args, cfg)
    assert args.radix_cache_backend == RADIX_CACHE_BACKEND and getattr(args, CONFIG_ATTR) is cfg
    args, cfg = _sglang_server_args(sglang_parser, "--radix-eviction-policy", "priority")
    apply_to_server_args(args, cfg)
    assert args.radix_eviction_policy == "priority"
