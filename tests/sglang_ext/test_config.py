"""`apply_to_server_args`: which attention backend `--compaction-endpoint` selects, and what
it refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sglang_ext.adapter.server_args import (
    CHANGES_ATTR,
    CONFIG_ATTR,
    INNER_ATTR,
    apply_to_server_args,
    log_changes,
)
from sglang_ext.config import ATTENTION_BACKEND, RADIX_CACHE_BACKEND, CompactionConfig
from tests.sglang_ext._fixtures import server_args

CFG = CompactionConfig(endpoint="inproc://")


@pytest.mark.parametrize(
    ("device", "attention", "inner"),
    [
        ("cpu", None, "torch_native"),
        ("cpu", "torch_native", "torch_native"),
        ("cpu", ATTENTION_BACKEND, "torch_native"),  # asked for by name: wraps the default
        ("cuda", None, None),  # SGLang's default for the model, resolved in the scheduler
        ("cuda:1", None, None),
        ("cuda", "triton", "triton"),
        ("cuda", "flashinfer", "flashinfer"),
        ("cuda", "fa3", "fa3"),
        ("cuda", "torch_native", "torch_native"),
        ("xpu", None, None),
    ],
)
def test_wraps_the_users_backend(device: str, attention: str | None, inner: str | None) -> None:
    args = server_args(device=device, attention_backend=attention)
    apply_to_server_args(args, CFG)
    assert args.attention_backend == ATTENTION_BACKEND and getattr(args, INNER_ATTR) == inner
    assert args.radix_cache_backend == RADIX_CACHE_BACKEND and getattr(args, CONFIG_ATTR) is CFG
    assert args.disable_cuda_graph is False  # plain batches keep the inner backend's graphs
    apply_to_server_args(args, CFG)  # a record set up already keeps its inner backend
    assert args.attention_backend == ATTENTION_BACKEND and getattr(args, INNER_ATTR) == inner


@pytest.mark.parametrize(("cuda", "cpu_engine", "inner"), [
    (True, "0", None), (True, "1", "torch_native"), (False, "0", "torch_native"),
])  # fmt: skip
def test_unset_device_resolves_like_sglang(
    cuda: bool, cpu_engine: str, inner: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", cpu_engine)
    args = server_args()
    apply_to_server_args(args, CFG)
    assert args.attention_backend == ATTENTION_BACKEND and getattr(args, INNER_ATTR) == inner


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (
            {"device": "cuda", "prefill_attention_backend": "fa3"},
            "--prefill-attention-backend 'fa3'",
        ),
        (
            {"device": "cuda", "decode_attention_backend": "triton"},
            "--decode-attention-backend 'triton'",
        ),
        ({"device": "cuda", "page_size": 16}, "page_size 1 only, got 16"),
        ({"disable_radix_cache": True}, "--disable-radix-cache"),
    ],
)
def test_rejects_incompatible_args(kw: dict[str, Any], match: str) -> None:
    args = server_args(**kw)
    with pytest.raises(ValueError, match=match):
        apply_to_server_args(args, CFG)
    assert not hasattr(args, CONFIG_ATTR) and not hasattr(args, INNER_ATTR)  # nothing applied


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"enable_hierarchical_cache": True}, "does not support --enable-hierarchical-cache: "),
        ({"enable_lmcache": True}, "does not support --enable-lmcache: "),
        ({"enable_flexkv": True}, "does not support --enable-flexkv: "),
        ({"enable_unified_cache_external_linker": True},
         "does not support --enable-unified-cache-external-linker: "),
        ({"enable_session_radix_cache": True}, "does not support --enable-session-radix-cache: "),
        ({"enable_streaming_session": True}, "does not support --enable-streaming-session: "),
        ({"enable_int8_mamba_checkpoint": True},
         "does not support --enable-int8-mamba-checkpoint: "),
        ({"radix_eviction_policy": "lfu"}, r"does not support --radix-eviction-policy 'lfu' \(a compacted prefix keeps no hit"),
        ({"radix_eviction_policy": "slru"}, r"does not support --radix-eviction-policy 'slru' .*never be protected"),
        ({"radix_eviction_policy": "tlru"}, r"does not support --radix-eviction-policy 'tlru' .*UnifiedRadixCache"),
        ({"radix_eviction_policy": "custom"}, r"does not support --radix-eviction-policy 'custom' .*does not implement"),
    ],
)  # fmt: skip
def test_rejects_default_cache_features(kw: dict[str, Any], match: str) -> None:
    """What SGLang's default cache does and the plugin's cache, which replaces it, would not."""
    args = server_args(device="cpu", **kw)
    with pytest.raises(ValueError, match=f"^--compaction-endpoint {match}"):
        apply_to_server_args(args, CFG)
    assert not hasattr(args, CONFIG_ATTR) and args.radix_cache_backend is None  # nothing applied


@pytest.mark.parametrize("policy", ["lru", "priority", "LRU"])
def test_eviction_policies_the_cache_honours_are_kept(policy: str) -> None:
    args = server_args(device="cpu", radix_eviction_policy=policy)
    apply_to_server_args(args, CFG)
    assert args.radix_eviction_policy == policy and args.radix_cache_backend == RADIX_CACHE_BACKEND


def test_cuda_graphs_asked_for_are_kept() -> None:
    args = server_args(device="cuda", cuda_graph_backend_decode="full")
    apply_to_server_args(args, CFG)
    assert args.attention_backend == ATTENTION_BACKEND and not args.disable_cuda_graph
    assert args.cuda_graph_backend_decode == "full"


def test_register_backends_adds_the_attention_backend() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES

    from sglang_ext.adapter.factory import register_backends
    from sglang_ext.adapter.hooks import verify_serving

    register_backends(verify_serving)
    register_backends(verify_serving)  # idempotent
    assert ATTENTION_BACKEND in ATTENTION_BACKENDS
    assert ATTENTION_BACKEND_CHOICES.count(ATTENTION_BACKEND) == 1
    assert "compaction-triton" not in ATTENTION_BACKENDS  # the wrapper serves CUDA too


def _parse(*argv: str) -> Any:
    import argparse

    from sglang_ext.config import add_cli_args, config_from_namespace

    p = argparse.ArgumentParser()
    add_cli_args(p)
    return config_from_namespace(p.parse_args(["--compaction-endpoint", "127.0.0.1:1", *argv]))


def test_plugin_flags_default_to_the_plugin_spec() -> None:
    from sglang_ext.config import PLUGIN_SPEC

    cfg = _parse()
    assert cfg is not None and cfg.spec == PLUGIN_SPEC
    # chosen on the RULER-style dev items (sglang_ext.config, docs/results.md)
    assert (cfg.spec.method, cfg.spec.ratio, cfg.spec.tokens) == ("kvzip", 0.1, None)
    assert cfg.spec.queries.sources == ("follow-up",)
    assert cfg.spec.on_policy is False and cfg.spec.queries.follow_up_answer_tokens == 32
    assert cfg.spec.queries.max_queries_per_head == 16384


def test_query_option_flags_parse_and_validate() -> None:
    cfg = _parse("--no-compaction-on-policy", "--compaction-follow-up-answer-tokens", "0")
    assert cfg is not None and cfg.spec.on_policy is False
    assert cfg.spec.queries.follow_up_answer_tokens == 0
    with pytest.raises(ValueError, match=r"^--compaction-follow-up-answer-tokens: .*got -1"):
        _parse("--compaction-follow-up-answer-tokens", "-1")
    with pytest.raises(
        ValueError,
        match=r"^--compaction-follow-up-answer-tokens: .* = 999 is over this server's limit 256",
    ):
        _parse("--compaction-follow-up-answer-tokens", "999")


def test_every_spec_knob_has_a_plugin_flag() -> None:
    cfg = _parse(
        "--compaction-method", "am-omp-fast", "--compaction-param", "k=2",
        "--compaction-tokens", "64", "--compaction-query-sources", "repeat-prefill,random",
        "--compaction-max-queries", "100", "--compaction-self-study-tokens", "8",
        "--compaction-self-study-prompt", "Summarize.", "--compaction-self-study-temperature",
        "0.5", "--compaction-random-queries", "16", "--compaction-query-seed", "7",
        "--compaction-keep-sink-tokens", "2", "--compaction-chunk-size", "512",
        "--compaction-head-budgets", "auto",
    )  # fmt: skip
    assert cfg is not None
    s = cfg.spec
    assert (s.method, s.method_params, s.ratio, s.tokens) == ("am-omp-fast", {"k": 2}, None, 64)
    q = s.queries
    assert q.sources == ("repeat-prefill", "random") and q.max_queries_per_head == 100
    assert (q.self_study_tokens, q.self_study_prompts, q.temperature) == (8, ("Summarize.",), 0.5)
    assert (q.random_count, q.seed, q.follow_up_answer_tokens) == (16, 7, 32)
    assert (s.keep_sink_tokens, s.chunk_size, s.head_budgets) == (2, 512, "auto")


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--compaction-method", "nosuch"], "^--compaction-method: unknown method 'nosuch'; available: "),
        (["--compaction-ratio", "1.5"], r"^--compaction-ratio: ratio must be in \(0, 1\], got 1.5"),
        (["--compaction-tokens", "0"], "^--compaction-tokens: tokens must be an int >= 1, got 0"),
        (["--compaction-query-sources", "nope"], "^--compaction-query-sources: unknown query source"),
        (["--compaction-param", "bogus=1"], r"^--compaction-param: .*no parameter\(s\) \['bogus'\]"),
        (["--compaction-param", "oops"], "^--compaction-param: a method parameter must be KEY=JSON, got 'oops'"),
        (["--compaction-head-budgets", "/x.json"], "^--compaction-head-budgets: head_budgets must be one of"),
    ],
)  # fmt: skip
def test_bad_spec_fails_at_startup_naming_the_flag(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _parse(*argv)


def test_startup_hook_validates_the_spec(capsys: Any) -> None:
    """The AFTER hook on ServerArgs.from_cli_args is where a bad spec stops the server: one
    line naming the flag, exit code 2 (no traceback)."""
    import argparse

    from sglang_ext.adapter.hooks import _from_cli_args
    from sglang_ext.config import add_cli_args

    p = argparse.ArgumentParser()
    add_cli_args(p)
    ns = p.parse_args(["--compaction-endpoint", "inproc://", "--compaction-ratio", "2"])
    args = server_args(device="cpu")
    with pytest.raises(SystemExit) as exit_:
        _from_cli_args(args, type(args), ns)
    assert exit_.value.code == 2 and not hasattr(args, CONFIG_ATTR)
    err = capsys.readouterr().err
    assert ": error: --compaction-ratio: ratio must be in" in err and err.count("\n") == 1
    ns = p.parse_args(["--compaction-endpoint", "inproc://", "--compaction-tokens", "9"])
    _from_cli_args(args, type(args), ns)
    assert getattr(args, CONFIG_ATTR).spec.tokens == 9


def test_serving_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="--compaction-min-hits must be >= 1, got 0"):
        CompactionConfig(endpoint="h:1", min_hits=0)
    with pytest.raises(ValueError, match="spec must be a CompactionSpec"):
        CompactionConfig(endpoint="h:1", spec="am-highest")  # type: ignore[arg-type]


def test_every_plugin_flag_is_documented_with_help() -> None:
    """sglang_ext/README.md names every --compaction-* flag, and each has a help text."""
    import argparse
    import re
    from pathlib import Path

    from sglang_ext.config import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    flags = [
        a for a in parser._actions if any(o.startswith("--compaction") for o in a.option_strings)
    ]
    assert len(flags) > 20
    readme = (Path(__file__).resolve().parents[2] / "sglang_ext" / "README.md").read_text()
    documented = set(re.findall(r"--(?:\[no-\])?(compaction-[a-z-]+)", readme))
    missing = [a.option_strings[0] for a in flags if a.option_strings[0][2:] not in documented]
    assert not missing, f"flags missing from sglang_ext/README.md: {missing}"
    assert not [a.option_strings[0] for a in flags if not a.help]


def test_startup_hook_refuses_a_plaintext_remote_token(tmp_path: Any, capsys: Any) -> None:
    """The channel is checked where the spec is: a remote plaintext token stops startup."""
    import argparse

    from sglang_ext.adapter.hooks import _from_cli_args
    from sglang_ext.config import add_cli_args

    token = tmp_path / "token"
    token.write_text("t0ken\n")
    p = argparse.ArgumentParser()
    add_cli_args(p)
    argv = ["--compaction-endpoint", "svc:50051", "--compaction-token-file", str(token)]
    args = server_args(device="cpu")
    with pytest.raises(SystemExit, match="2"):
        _from_cli_args(args, type(args), p.parse_args(argv))
    assert not hasattr(args, CONFIG_ATTR) and "--compaction-insecure" in capsys.readouterr().err
    _from_cli_args(args, type(args), p.parse_args([*argv, "--compaction-insecure"]))
    cfg = getattr(args, CONFIG_ATTR)
    assert cfg.token_file == str(token) and cfg.token is None and "t0ken" not in repr(cfg)
    with pytest.raises(SystemExit):
        p.parse_args([*argv, "--compaction-token", "t0ken"])


def test_each_change_is_logged_with_old_and_new_value(caplog: pytest.LogCaptureFixture) -> None:
    args = server_args(device="cuda", attention_backend="flashinfer")
    with caplog.at_level("INFO", logger="sglang_ext.adapter.server_args"):
        apply_to_server_args(args, CFG)
        assert caplog.records == []  # no log handler exists yet when from_cli_args runs
        assert log_changes(args) == 2
        assert log_changes(args) == 0 and not hasattr(args, CHANGES_ATTR)  # logged once
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("INFO", f"sglang_ext: --radix-cache-backend unset -> {RADIX_CACHE_BACKEND} (the "
                 "plugin's cache, which serves requests from compacted prefixes)"),
        ("INFO", f"sglang_ext: --attention-backend flashinfer -> {ATTENTION_BACKEND} (wraps "
                 "flashinfer: stock kernels for batches without compacted prefixes)"),
    ]  # fmt: skip


def test_unchanged_settings_are_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    args = server_args(device="cpu", attention_backend=ATTENTION_BACKEND,
                       radix_cache_backend=RADIX_CACHE_BACKEND)  # fmt: skip
    apply_to_server_args(args, CFG)
    assert log_changes(args) == 0
    args = server_args(device="cuda")
    apply_to_server_args(args, CFG)
    with caplog.at_level("INFO", logger="sglang_ext.adapter.server_args"):
        assert log_changes(args) == 2
    msgs = [r.getMessage() for r in caplog.records]
    assert not any("CUDA graphs" in m for m in msgs), msgs
    assert msgs[1] == (
        f"sglang_ext: --attention-backend unset -> {ATTENTION_BACKEND} (wraps SGLang's default "
        "for the model: stock kernels for batches without compacted prefixes)"
    )


def test_configure_logger_hook_logs_the_changes(caplog: pytest.LogCaptureFixture) -> None:
    from sglang_ext.adapter.hooks import ANNOUNCEMENT, _announce

    args = server_args(device="cpu")
    apply_to_server_args(args, CFG)
    with caplog.at_level("INFO"):
        _announce(None, args, prefix="")
        _announce(None, args, prefix=" TP0")  # a later process: the changes are gone
    msgs = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith(ANNOUNCEMENT) for m in msgs) == 2
    assert [m for m in msgs if "->" in m] == [
        f"sglang_ext: --radix-cache-backend unset -> {RADIX_CACHE_BACKEND} (the plugin's cache, "
        "which serves requests from compacted prefixes)",
        f"sglang_ext: --attention-backend unset -> {ATTENTION_BACKEND} (wraps torch_native: "
        "stock kernels for batches without compacted prefixes)",
    ]
