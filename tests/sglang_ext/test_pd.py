"""Prefill/decode disaggregation (`sglang_ext.adapter.pd`): the plugin is accepted on a decode
server with its own radix cache and a `cpu_tensor` or no retraction backup, and refused elsewhere with a
ValueError naming the flag (the record untouched); the flags it reads are SGLang's own; the
CPU prefill switch turns Mooncake's pinned-memory path off only on a CPU prefill server."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_ext.adapter import hooks
from sglang_ext.adapter.pd import check_disaggregation, cpu_prefill_switch
from sglang_ext.adapter.server_args import CONFIG_ATTR, apply_to_server_args
from sglang_ext.config import RADIX_CACHE_BACKEND, CompactionConfig
from tests.sglang_ext._fixtures import server_args

SERVICE = CompactionConfig(endpoint="127.0.0.1:50051")
# A decode server as the plugin serves on it.
DECODE = dict(
    disaggregation_mode="decode",
    disaggregation_decode_enable_radix_cache=True,
    disaggregation_decode_enable_offload_kvcache=False,
    disaggregation_decode_host_receive_threshold=1.0,
    disaggregation_decode_retraction_backup="none",
)


@pytest.mark.parametrize("backup", ["none", "cpu_tensor"])
def test_accepts_decode_with_its_radix_cache(backup: str) -> None:
    args = server_args(
        device="cpu", **{**DECODE, "disaggregation_decode_retraction_backup": backup}
    )
    apply_to_server_args(args, SERVICE)
    assert getattr(args, CONFIG_ATTR) is SERVICE and args.radix_cache_backend == RADIX_CACHE_BACKEND


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"disaggregation_mode": "prefill"},
         "--disaggregation-mode 'prefill': .* without their beta .* leave prefill stock"),
        ({"disaggregation_decode_enable_radix_cache": False,
          "disable_radix_cache": True},  # what SGLang resolves decode without it to
         "needs --disaggregation-decode-enable-radix-cache: .* no prefix to compact"),
        ({"enable_hierarchical_cache": True}, "does not support --enable-hierarchical-cache"),
        ({"disaggregation_decode_enable_offload_kvcache": True},
         "does not support --disaggregation-decode-enable-offload-kvcache"),
        ({"disaggregation_decode_host_receive_threshold": 0.5},
         "does not support --disaggregation-decode-host-receive-threshold 0.5"),
        ({"disaggregation_decode_retraction_backup": "host_pool"},
         "needs --disaggregation-decode-retraction-backup cpu_tensor or none, got 'host_pool'"),
        ({"disaggregation_decode_retraction_backup": None},
         "retraction-backup cpu_tensor or none, got None \\(unset, .* HiCache host memory"),
    ],
)  # fmt: skip
def test_refuses_pd_settings_naming_the_flag(kw: dict[str, Any], match: str) -> None:
    args = server_args(device="cpu", **{**DECODE, **kw})
    with pytest.raises(ValueError, match=match):
        apply_to_server_args(args, SERVICE)
    assert not hasattr(args, CONFIG_ATTR) and args.radix_cache_backend is None


def test_no_disaggregation_is_not_checked() -> None:
    check_disaggregation(server_args(device="cpu"))
    check_disaggregation(server_args(device="cpu", disaggregation_mode="null"))


def test_the_flags_read_are_sglangs_own() -> None:
    """SGLang's parser defines every flag the checks name, under the attribute they read."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args([
        "--model-path", "m", "--disaggregation-mode", "decode",
        "--disaggregation-decode-enable-radix-cache",
        "--disaggregation-decode-enable-offload-kvcache",
        "--disaggregation-decode-host-receive-threshold", "0.5",
        "--disaggregation-decode-retraction-backup", "none",
    ])  # fmt: skip
    assert (ns.disaggregation_mode, ns.disaggregation_decode_retraction_backup) == (
        "decode", "none")  # fmt: skip
    assert ns.disaggregation_decode_enable_radix_cache
    assert ns.disaggregation_decode_enable_offload_kvcache
    assert ns.disaggregation_decode_host_receive_threshold == 0.5
    with pytest.raises(ValueError, match="enable-offload-kvcache"):
        check_disaggregation(ns)


def _scheduler(mode: str, backend: str = "mooncake", device: str = "cpu") -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend

    return SimpleNamespace(disaggregation_mode=DisaggregationMode(mode),
                           transfer_backend=TransferBackend(backend), device=device)  # fmt: skip


@pytest.fixture
def sender(monkeypatch: pytest.MonkeyPatch) -> Any:
    """SGLang's MooncakeKVSender, its flag restored after the test."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    monkeypatch.setattr(MooncakeKVSender, "supports_host_tensor_indices", True)
    return MooncakeKVSender


def test_cpu_prefill_switch_turns_the_pinned_path_off(
    sender: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sglang_ext.adapter.pd"):
        assert cpu_prefill_switch(_scheduler("prefill"))
    assert sender.supports_host_tensor_indices is False
    (record,) = caplog.records
    assert "MooncakeKVSender.supports_host_tensor_indices True -> False" in record.message
    assert "torch.cuda.Event" in record.message
    assert not cpu_prefill_switch(_scheduler("prefill"))  # once: already off, no second line


@pytest.mark.parametrize(
    "scheduler_kw",
    [
        {"mode": "decode"},
        {"mode": "null"},
        {"mode": "prefill", "device": "cuda"},
        {"mode": "prefill", "device": "cuda:1"},
        {"mode": "prefill", "backend": "nixl"},
    ],
)
def test_cpu_prefill_switch_leaves_other_servers_alone(
    sender: Any, scheduler_kw: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="sglang_ext.adapter.pd"):
        assert not cpu_prefill_switch(_scheduler(**scheduler_kw))
    assert sender.supports_host_tensor_indices is True and not caplog.records


def test_switch_hook_is_installed_with_the_flags_and_never_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Installed in every process (a stock prefill server has no --compaction-endpoint); a
    failure is logged and the scheduler starts."""
    from sglang_ext.adapter import pd, surface

    assert (surface.INIT_DISAGGREGATION, hooks._init_disaggregation) in hooks.FLAG_HOOKS

    def broken(scheduler: Any) -> bool:
        raise RuntimeError("boom")

    monkeypatch.setattr(pd, "cpu_prefill_switch", broken)
    with caplog.at_level(logging.ERROR, logger="sglang_ext.adapter.hooks"):
        hooks._init_disaggregation(None, _scheduler("prefill"))
    assert "CPU prefill switch failed" in caplog.text


@pytest.mark.parametrize(("env", "overlap", "warned"), [
    (None, True, True), ("0", True, False), ("1", False, False),
])  # fmt: skip
def test_cpu_prefill_warns_of_the_early_send_event(
    sender: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    env: str | None,
    overlap: bool,
    warned: bool,
) -> None:
    """Under overlap scheduling SGLang's early send of prefill's cached prefix records a
    torch.cuda.Event: the switch names the setting that avoids it (it changes nothing)."""
    from sglang_ext.adapter.pd import EARLY_SEND_ENV

    if env is None:
        monkeypatch.delenv(EARLY_SEND_ENV, raising=False)
    else:
        monkeypatch.setenv(EARLY_SEND_ENV, env)
    scheduler = _scheduler("prefill")
    scheduler.enable_overlap = overlap
    with caplog.at_level(logging.WARNING, logger="sglang_ext.adapter.pd"):
        cpu_prefill_switch(scheduler)
    assert (f"set {EARLY_SEND_ENV}=0 or pass --disable-overlap-schedule" in caplog.text) is warned
