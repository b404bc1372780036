"""The plugin's command-line flags and the `CompactionConfig` they build.

`add_cli_args(parser)` adds the flags to an argparse parser (the adapter's hook gives it
SGLang's own) and `config_from_namespace` reads them back (None without
`--compaction-endpoint`). How the config reaches SGLang's scheduler, and what it selects
there, is the adapter's (`sglang_ext.adapter.server_args`).
"""

from __future__ import annotations

import argparse
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any

from compactor import (
    CompactionSpec,
    QueryConfig,
    add_field_args,
    add_spec_args,
    field_values,
    spec_from_args,
    usage_error,
)
from sglang_ext.channel import add_channel_args, check_channel, token_from_env

__all__ = [
    "ATTENTION_BACKEND",
    "CPU_INNER_BACKEND",
    "PLUGIN_SPEC",
    "RADIX_CACHE_BACKEND",
    "SPEC_PREFIX",
    "CompactionConfig",
    "add_cli_args",
    "config_from_namespace",
]

RADIX_CACHE_BACKEND = "compaction"
ATTENTION_BACKEND = "compaction"
# The backend `compaction` wraps on CPU when --attention-backend is unset (the engine this
# project serves on there; SGLang's own CPU default would be intel_amx).
CPU_INNER_BACKEND = "torch_native"
# The spec flags are `--compaction-<flag>` of compactor.spec's knobs (compactor.spec.cli_args).
SPEC_PREFIX = "compaction-"
# The plugin's defaults. Reference queries: the sharing requests' questions with the model's
# own answers, chosen on questions the fit never saw (benchmarks/server/next_question.py, 3 needle +
# 2 prose documents; the "next question" table of docs/results.md): adding repeat-prefill halves the
# unseen logppl gap of a first fit on 2 questions (0.118 -> 0.055) but lowers strict 16-token
# agreement (unseen 0.40 -> 0.27, fitted 0.70 -> 0.20); with the refits the questions bring
# (CompactionConfig.refit_at) the questions alone reach 0.059 at 8 and 0.035 at 32 (repeat-
# prefill added: 0.052 and 0.056) with the better agreement. A prefix that arrives with no
# follow-ups falls back to the spec's default source, repeat-turn (CompactionSpec.for_follow_ups).
# Method and policy: chosen on the RULER-style dev seeds (benchmarks/offline/ruler.py --base
# plugin; the "defaults" table of docs/results.md). Needle retention at 10x, fitted also to other
# questions about the context / query-agnostic: am-highest on-policy (the default before) 0.57 /
# 0.00; kvzip on-policy 0.71 / 0.14; kvzip off-policy (8192 queries per head, the spec's default
# then; 16384 since: compactor.spec.compaction) 0.86 / 0.86. Held-out: see the table.
PLUGIN_SPEC = CompactionSpec(
    method="kvzip",
    ratio=0.1,
    queries=QueryConfig(sources=("follow-up",), follow_up_answer_tokens=32),
)


def _counts(text: str) -> tuple[int, ...]:
    """`--compaction-refit-at`: "8,32" -> (8, 32); "none" or "" -> ()."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated question counts like 8,32 or 'none', got {text!r}"
        ) from None


def _flag(flag: str, help: str, kind: str = "int", **extra: Any) -> dict[str, Any]:
    """Field metadata making the flag ``--compaction-<flag>`` (``compactor.spec.cli_args.
    add_field_args``: argparse's own metavar, no default in the help). Optional: `parse`
    (text -> value), `at_least` / `above` (the bound `__post_init__` checks) and `limits`
    (the group named in that error)."""
    return {
        "flag": flag,
        "help": help,
        "kind": kind,
        "metavar": None,
        "show_default": False,
        **extra,
    }


def _setting(default: Any, flag: str, help: str, kind: str = "int", **extra: Any) -> Any:
    """A serving setting: a field with an immutable default and :func:`_flag` metadata."""
    return field(default=default, metadata=_flag(flag, help, kind, **extra))


@dataclass(frozen=True)
class CompactionConfig:
    """What the plugin needs in the scheduler; picklable.

    Each serving setting is one field: its flag ``--compaction-<flag>``, default, help text
    and bound live in the field (`_setting`); `add_cli_args` generates the flags, and
    `config_from_namespace` reads them back, from these fields. `spec` (what every
    compaction computes; checked when SGLang parses its arguments) has one flag per knob
    (``compactor.spec.cli_args``). The gRPC channel options `tls` .. `insecure`
    are flags of ``sglang_ext.channel`` (checked at startup there); `token` is set from
    ``$SGLANG_COMPACTION_TOKEN`` (never a flag) and masked in repr and as_dict, and
    `token_file` is re-read by the compactor when the file changes.
    """

    endpoint: str = field(
        metadata=_flag(
            "endpoint",
            "Compaction service (host:port, grpc[s]://host:port) or inproc:// to compact "
            "inside this server. Setting it enables compacted shared prefixes; without it "
            "SGLang runs stock.",
            "str",
        )
    )
    spec: CompactionSpec = PLUGIN_SPEC
    min_prefix_tokens: int = _setting(
        256,
        "min-prefix-tokens",
        "A shared path shorter than this is never compacted.",
        at_least=2,
    )
    min_hits: int = _setting(
        2,
        "min-hits",
        "Requests that must have shared a path before it is compacted.",
        at_least=1,
    )
    # 3: a system prompt two chats share is not compacted alone, a document asked three
    # different questions is (sglang_ext.trigger).
    min_continuations: int = _setting(
        3,
        "min-continuations",
        "Different continuations a shared path needs before it is compacted: recent "
        "prompts that go on for fewer than --compaction-min-prefix-tokens tokens after it, a "
        "conversation's earlier turns counted once (a short system prompt is not compacted alone).",
        at_least=1,
    )
    timeout: float = _setting(
        120.0,
        "timeout",
        "Seconds one compaction may take; then the prefix stays uncompacted.",
        "float",
        above=0,
    )
    max_follow_ups: int = _setting(
        8,
        "max-follow-ups",
        "Sharing requests' suffixes sent as follow-up queries (the follow-up source; "
        "a prefix with none falls back to repeat-turn).",
        at_least=0,
        limits="follow-up",
    )
    # Counted from the first fit's questions on, each step once; the refit replaces the
    # installed fit atomically (requests in flight finish on the old one). (8, 32) after a
    # first fit on >= min_continuations: each refit brings 4x the evidence, and a document
    # costs O(log questions) compactions.
    refit_at: tuple[int, ...] = _setting(
        (8, 32),
        "refit-at",
        "Refit an installed prefix when this many distinct questions have been asked "
        "on it (comma-separated, e.g. 8,32; 'none': never). The refit uses those questions "
        "as follow-ups and replaces the installed fit atomically.",
        "counts",
        parse=_counts,
    )
    follow_up_tokens: int = _setting(
        128,
        "follow-up-tokens",
        "Each follow-up suffix is cut to this many tokens.",
        at_least=1,
        limits="follow-up",
    )
    # Later requests may diverge a little before the branch point the path was found at.
    boundary_margin: int = _setting(
        32,
        "boundary-margin",
        "Tokens before the shared path's branch point that stay uncompacted.",
        at_least=0,
    )
    # Replicas that found the same document at slightly different branch points (their
    # questions share a first word or not) ask a shared service for one compaction.
    align_tokens: int = _setting(
        64,
        "align-tokens",
        "A compacted path's length is then cut down to a multiple of this, so "
        "replicas that share one service ask for the same prefix of a document.",
        at_least=1,
    )
    # The n-th retry goes no sooner than retry_backoff_s * 2**(n-1) s.
    max_retries: int = _setting(
        2,
        "max-retries",
        "Times a failed compaction is sent again (after new hits).",
        at_least=0,
        limits="retry",
    )
    retry_backoff_s: float = _setting(
        30.0,
        "retry-backoff",
        "Seconds before the first retry; doubles each time.",
        "float",
        at_least=0,
        limits="retry",
    )
    failure_cooldown_s: float = _setting(
        600.0,
        "failure-cooldown",
        "Seconds a path whose retries are spent is not sent; then its failures are forgotten.",
        "float",
        at_least=0,
    )
    # Bounds the results held in the scheduler's memory (in flight, waiting or being written).
    max_in_flight: int = _setting(
        2,
        "max-in-flight",
        "Compactions pending at once (asked for, not yet installed); paths found "
        "beyond it wait for their next hit.",
        at_least=1,
    )
    # A large install is spread out instead of stalling every running request.
    install_chunk_mb: int = _setting(
        64,
        "install-chunk-mb",
        "MiB of a compacted prefix written into the KV pool per busy scheduler iteration "
        "(an idle scheduler writes it whole).",
        at_least=1,
    )
    # Whatever the bytes: on a CPU pool the per-layer cast and checks, not the copy, set the cost.
    install_step_ms: float = _setting(
        2.0,
        "install-step-ms",
        "Milliseconds of install work per busy scheduler iteration (one layer at least; "
        "an idle scheduler writes the install whole).",
        "float",
        above=0,
    )
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    insecure: bool = False
    signing_key_file: str | None = None

    def __post_init__(self) -> None:
        if not self.endpoint.strip():
            raise ValueError(f"compaction endpoint must be non-empty, got {self.endpoint!r}")
        if not isinstance(self.spec, CompactionSpec):
            raise ValueError(f"spec must be a CompactionSpec, got {type(self.spec).__name__}")
        if isinstance(self.refit_at, list):  # JSON, a caller's list -> a tuple
            object.__setattr__(self, "refit_at", tuple(self.refit_at))
        for f in fields(self):
            _check_bound(f, getattr(self, f.name))
        steps = self.refit_at
        if any(not isinstance(n, int) or n < 2 for n in steps) or list(steps) != sorted(set(steps)):
            raise ValueError(
                f"--compaction-refit-at must be increasing question counts >= 2, got {steps}"
            )

    @property
    def in_process(self) -> bool:
        return self.endpoint.startswith("inproc://")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"] = self.spec.to_dict()
        d["token"] = "***" if self.token else None
        return d


def _check_bound(f: Field[Any], value: Any) -> None:
    """ValueError ``"--compaction-<flag> must be >= N, got V"`` for a value outside the
    field's `at_least` / `above` bound (NaN is outside every bound)."""
    meta = f.metadata
    for key, op in (("at_least", ">="), ("above", ">")):
        if key not in meta:
            continue
        bound = meta[key]
        if not (value >= bound if op == ">=" else value > bound):
            group = f"{meta['limits']} limits: " if "limits" in meta else ""
            flag = f"--{SPEC_PREFIX}{meta['flag']}"
            raise ValueError(f"{group}{flag} must be {op} {bound}, got {value}")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the `--compaction-*` flags to SGLang's parser (mutates `parser`): the endpoint,
    one flag per spec knob (``compactor.spec.cli_args``, defaults PLUGIN_SPEC), the serving
    settings (generated from CompactionConfig's fields) and the channel options."""
    g = parser.add_argument_group("compaction (sglang_ext plugin)")
    add_field_args(g, CompactionConfig, SPEC_PREFIX, fields=["endpoint"])
    add_spec_args(g, prefix=SPEC_PREFIX, defaults=PLUGIN_SPEC)
    add_field_args(g, CompactionConfig, SPEC_PREFIX, exclude=["endpoint"])
    add_channel_args(g)


def config_from_namespace(ns: argparse.Namespace) -> CompactionConfig | None:
    """The config the parsed flags describe, or None without `--compaction-endpoint`.

    Raises ValueError ``"--compaction-<flag>: <why>"`` for a bad spec: the checks of
    ``CompactionSpec.validate`` (the method is built) and the service's policy
    (``CompactJob.check_spec``: head budgets uniform/auto, bounded follow-up answers);
    ValueError naming the flag for a bad channel (``sglang_ext.channel.check_channel``:
    TLS files, a token in plaintext to a non-loopback host).
    """
    if not getattr(ns, "compaction_endpoint", None):
        return None
    settings = field_values(ns, CompactionConfig, SPEC_PREFIX)
    endpoint = settings["endpoint"]
    from compactor import CompactJob

    try:
        spec = spec_from_args(ns, SPEC_PREFIX)
        CompactJob.check_spec(spec)
    except ValueError as exc:
        raise ValueError(usage_error(exc, ns, SPEC_PREFIX).with_flag()) from None
    token_file = ns.compaction_token_file
    channel: dict[str, Any] = dict(
        tls=ns.compaction_tls or endpoint.startswith("grpcs://"),
        tls_ca=ns.compaction_tls_ca,
        tls_cert=ns.compaction_tls_cert,
        tls_key=ns.compaction_tls_key,
        token=token_from_env(token_file),
        token_file=token_file,
        insecure=ns.compaction_insecure,
        signing_key_file=ns.compaction_signing_key_file,
    )
    check_channel(endpoint, **channel)
    return CompactionConfig(spec=spec, **settings, **channel)
