"""The plugin's command-line flags and the `CompactionConfig` they build.

The flags are added to SGLang's own parser (an AFTER hook on `ServerArgs.add_cli_args`) and
read back after `ServerArgs.from_cli_args` (another AFTER hook), which stores the config on
the record as the underscore attribute `_compaction_config`. ServerArgs pickles its
underscore attributes to the scheduler process, where the radix-cache factory reads them.
Giving `--compaction-endpoint` also selects this plugin's radix-cache and attention backends
(`sglang_ext.server_args`); without it the record is left exactly as SGLang built it.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from typing import Any

from compactor.spec import CompactionSpec, QueryConfig
from compactor.spec_args import add_spec_args, spec_from_args, usage_error
from sglang_ext.channel import add_channel_args, check_channel, token_from_env

__all__ = [
    "ATTENTION_BACKEND",
    "CONFIG_ATTR",
    "CPU_INNER_BACKEND",
    "INNER_ATTR",
    "PLUGIN_SPEC",
    "RADIX_CACHE_BACKEND",
    "SPEC_PREFIX",
    "CompactionConfig",
    "add_cli_args",
    "config_from_namespace",
    "get_config",
]

RADIX_CACHE_BACKEND = "compaction"
ATTENTION_BACKEND = "compaction"
CONFIG_ATTR = "_compaction_config"
# The user's --attention-backend that `compaction` wraps (None: SGLang's default for the model,
# resolved in the scheduler); an underscore attribute of the record, so it reaches the scheduler.
INNER_ATTR = "_compaction_inner_attention"
# The backend `compaction` wraps on CPU when --attention-backend is unset (the engine this
# project serves on there; SGLang's own CPU default would be intel_amx).
CPU_INNER_BACKEND = "torch_native"
# The spec flags are `--compaction-<flag>` of compactor.spec's knobs (compactor.spec_args).
SPEC_PREFIX = "compaction-"
# The plugin's defaults. Reference queries: the sharing requests' questions with the model's
# own answers, chosen on questions the fit never saw (benchmarks/next_question.py, 3 needle +
# 2 prose documents; the README's "next question" table): adding repeat-prefill halves the
# unseen logppl gap of a first fit on 2 questions (0.118 -> 0.055) but lowers strict 16-token
# agreement (unseen 0.40 -> 0.27, fitted 0.70 -> 0.20); with the refits the questions bring
# (CompactionConfig.refit_at) the questions alone reach 0.059 at 8 and 0.035 at 32 (repeat-
# prefill added: 0.052 and 0.056) with the better agreement. A prefix that arrives with no
# follow-ups falls back to repeat-prefill (CompactionSpec.for_follow_ups).
PLUGIN_SPEC = CompactionSpec(
    method="am-highest",
    ratio=0.1,
    queries=QueryConfig(sources=("follow-up",), follow_up_answer_tokens=32),
    on_policy=True,
)


@dataclass(frozen=True)
class CompactionConfig:
    """What the plugin needs in the scheduler; picklable.

    Attributes:
        endpoint: `inproc://` (compact in a worker process of this server) or `host:port`
            (the gRPC compaction service); `grpc://host:port` and `grpcs://host:port` work too.
        spec: what every compaction computes (method, budget, queries, ...); checked when
            SGLang parses its arguments (:func:`config_from_namespace`).
        min_prefix_tokens: a tree path shorter than this is never compacted.
        min_hits: how many requests must have shared a path before it is compacted.
        min_continuations: how many different continuations a path's questions must be
            before it is compacted: recent prompts that share it and go on for fewer than
            `min_prefix_tokens` tokens after it, a conversation's earlier turns counted once.
            3: a system prompt two chats share is not compacted alone, a document asked three
            different questions is (``sglang_ext.trigger``).
        timeout: seconds one compaction may take before it counts as failed.
        max_follow_ups: how many sharing requests' suffixes are sent as follow-up queries
            (first fit).
        refit_at: an installed prefix is fitted again when this many distinct questions
            have been asked on it (counted from the first fit's questions on, a
            conversation's earlier turns once), each step once, with those questions as
            follow-ups; the new fit replaces the installed one atomically (requests in flight
            finish on the old one). (8, 32) after a first fit on >= `min_continuations`: each
            refit brings 4x the evidence, and a document costs O(log questions) compactions.
            Empty: never refit.
        follow_up_tokens: each suffix is cut to this many tokens.
        boundary_margin: a compacted path stops this many tokens before the branch point
            it was found at (later requests may diverge a little earlier).
        align_tokens: and then goes down to a multiple of this many tokens, so replicas
            that found the same document at slightly different branch points (their
            questions share a first word or not) ask for the same prefix: one compaction
            in a shared service, not one per replica.
        max_retries / retry_backoff_s: a failed compaction is sent again (after new hits)
            at most this many times, the n-th time no sooner than backoff * 2**(n-1) s.
        failure_cooldown_s: after its retries are spent a path is not sent for this many
            seconds; then its failures are forgotten (it may be sent afresh).
        max_in_flight: compactions asked for and not yet installed (in flight, waiting or
            being written); a path found while this many are pending is not sent (it is
            found again at its next hit). Bounds the results held in the scheduler's memory.
        install_chunk_mb: at most this many MiB of a result are cast, checked and written
            into the KV pool per scheduler iteration (a large install is spread out instead
            of stalling every running request).
        install_step_ms: and at most about this many milliseconds of that work per
            iteration (one layer at least), whatever the bytes: on a CPU pool the per-layer
            cast and checks, not the copy, set the cost.
        tls / tls_ca / tls_cert / tls_key / token / token_file / allow_plaintext_token: gRPC
            channel options (``sglang_ext.channel``, checked at startup). `token` is set from
            ``$SGLANG_COMPACTION_TOKEN`` (never a flag) and masked in repr and as_dict;
            `token_file` is re-read by the compactor when the file changes.
    """

    endpoint: str
    spec: CompactionSpec = PLUGIN_SPEC
    min_prefix_tokens: int = 256
    min_hits: int = 2
    min_continuations: int = 3
    timeout: float = 120.0
    max_follow_ups: int = 8
    refit_at: tuple[int, ...] = (8, 32)
    follow_up_tokens: int = 128
    boundary_margin: int = 32
    align_tokens: int = 64
    max_retries: int = 2
    retry_backoff_s: float = 30.0
    failure_cooldown_s: float = 600.0
    max_in_flight: int = 2
    install_chunk_mb: int = 64
    install_step_ms: float = 2.0
    tls: bool = False
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    allow_plaintext_token: bool = False

    def __post_init__(self) -> None:
        if not self.endpoint.strip():
            raise ValueError(f"compaction endpoint must be non-empty, got {self.endpoint!r}")
        if not isinstance(self.spec, CompactionSpec):
            raise ValueError(f"spec must be a CompactionSpec, got {type(self.spec).__name__}")
        if self.min_prefix_tokens < 2:
            raise ValueError(
                f"--compaction-min-prefix-tokens must be >= 2, got {self.min_prefix_tokens}"
            )
        if self.min_hits < 1:
            raise ValueError(f"--compaction-min-hits must be >= 1, got {self.min_hits}")
        if self.min_continuations < 1:
            raise ValueError(
                f"--compaction-min-continuations must be >= 1, got {self.min_continuations}"
            )
        if self.timeout <= 0:
            raise ValueError(f"--compaction-timeout must be > 0, got {self.timeout}")
        if self.boundary_margin < 0:
            raise ValueError(
                f"--compaction-boundary-margin must be >= 0, got {self.boundary_margin}"
            )
        if self.align_tokens < 1:
            raise ValueError(f"--compaction-align-tokens must be >= 1, got {self.align_tokens}")
        if self.max_retries < 0 or self.retry_backoff_s < 0:
            raise ValueError(
                "retry limits must be max_retries >= 0 and retry_backoff_s >= 0, got "
                f"{self.max_retries} and {self.retry_backoff_s}"
            )
        if not self.failure_cooldown_s >= 0:
            raise ValueError(
                f"--compaction-failure-cooldown must be >= 0, got {self.failure_cooldown_s}"
            )
        if self.max_in_flight < 1:
            raise ValueError(f"--compaction-max-in-flight must be >= 1, got {self.max_in_flight}")
        if self.install_chunk_mb < 1:
            raise ValueError(
                f"--compaction-install-chunk-mb must be >= 1, got {self.install_chunk_mb}"
            )
        if not self.install_step_ms > 0:
            raise ValueError(
                f"--compaction-install-step-ms must be > 0, got {self.install_step_ms}"
            )
        steps = self.refit_at
        if any(not isinstance(n, int) or n < 2 for n in steps) or list(steps) != sorted(set(steps)):
            raise ValueError(
                f"--compaction-refit-at must be increasing question counts >= 2, got {steps}"
            )
        if self.max_follow_ups < 0 or self.follow_up_tokens < 1:
            raise ValueError(
                "follow-up limits must be max_follow_ups >= 0 and follow_up_tokens >= 1, got "
                f"{self.max_follow_ups} and {self.follow_up_tokens}"
            )

    @property
    def in_process(self) -> bool:
        return self.endpoint.startswith("inproc://")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"] = self.spec.to_dict()
        d["token"] = "***" if self.token else None
        return d


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the `--compaction-*` flags to SGLang's parser (mutates `parser`): the endpoint,
    one flag per spec knob (``compactor.spec_args``, defaults PLUGIN_SPEC), the serving
    limits and the channel options."""
    g = parser.add_argument_group("compaction (sglang_ext plugin)")
    g.add_argument(
        "--compaction-endpoint",
        default=None,
        help="Compaction service (host:port, grpc[s]://host:port) or inproc:// to compact "
        "inside this server. Setting it enables compacted shared prefixes; without it "
        "SGLang runs stock.",
    )
    add_spec_args(g, prefix=SPEC_PREFIX, defaults=PLUGIN_SPEC)
    g.add_argument(
        "--compaction-min-prefix-tokens",
        type=int,
        default=CompactionConfig.min_prefix_tokens,
        help="A shared path shorter than this is never compacted.",
    )
    g.add_argument(
        "--compaction-min-hits",
        type=int,
        default=CompactionConfig.min_hits,
        help="Requests that must have shared a path before it is compacted.",
    )
    g.add_argument(
        "--compaction-min-continuations",
        type=int,
        default=CompactionConfig.min_continuations,
        help="Different continuations a shared path needs before it is compacted: recent "
        "prompts that go on for fewer than --compaction-min-prefix-tokens tokens after it, a "
        "conversation's earlier turns counted once (a short system prompt is not compacted alone).",
    )
    g.add_argument(
        "--compaction-timeout",
        type=float,
        default=CompactionConfig.timeout,
        help="Seconds one compaction may take; then the prefix stays uncompacted.",
    )
    g.add_argument(
        "--compaction-max-follow-ups",
        type=int,
        default=CompactionConfig.max_follow_ups,
        help="Sharing requests' suffixes sent as follow-up queries (the follow-up source; "
        "a prefix with none falls back to repeat-prefill).",
    )
    g.add_argument(
        "--compaction-refit-at",
        type=_counts,
        default=CompactionConfig.refit_at,
        help="Refit an installed prefix when this many distinct questions have been asked "
        "on it (comma-separated, e.g. 8,32; 'none': never). The refit uses those questions "
        "as follow-ups and replaces the installed fit atomically.",
    )
    g.add_argument(
        "--compaction-follow-up-tokens",
        type=int,
        default=CompactionConfig.follow_up_tokens,
        help="Each follow-up suffix is cut to this many tokens.",
    )
    g.add_argument(
        "--compaction-boundary-margin",
        type=int,
        default=CompactionConfig.boundary_margin,
        help="Tokens before the shared path's branch point that stay uncompacted.",
    )
    g.add_argument(
        "--compaction-align-tokens",
        type=int,
        default=CompactionConfig.align_tokens,
        help="A compacted path's length is then cut down to a multiple of this, so "
        "replicas that share one service ask for the same prefix of a document.",
    )
    g.add_argument(
        "--compaction-max-retries",
        type=int,
        default=CompactionConfig.max_retries,
        help="Times a failed compaction is sent again (after new hits).",
    )
    g.add_argument(
        "--compaction-retry-backoff",
        type=float,
        default=CompactionConfig.retry_backoff_s,
        help="Seconds before the first retry; doubles each time.",
    )
    g.add_argument(
        "--compaction-failure-cooldown",
        type=float,
        default=CompactionConfig.failure_cooldown_s,
        help="Seconds a path whose retries are spent is not sent; then its failures are forgotten.",
    )
    g.add_argument(
        "--compaction-max-in-flight",
        type=int,
        default=CompactionConfig.max_in_flight,
        help="Compactions pending at once (asked for, not yet installed); paths found "
        "beyond it wait for their next hit.",
    )
    g.add_argument(
        "--compaction-install-chunk-mb",
        type=int,
        default=CompactionConfig.install_chunk_mb,
        help="MiB of a compacted prefix written into the KV pool per scheduler iteration.",
    )
    g.add_argument(
        "--compaction-install-step-ms",
        type=float,
        default=CompactionConfig.install_step_ms,
        help="Milliseconds of install work per scheduler iteration (one layer at least).",
    )
    add_channel_args(g)


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


def config_from_namespace(ns: argparse.Namespace) -> CompactionConfig | None:
    """The config the parsed flags describe, or None without `--compaction-endpoint`.

    Raises ValueError ``"--compaction-<flag>: <why>"`` for a bad spec: the checks of
    ``CompactionSpec.validate`` (the method is built) and the service's policy
    (``CompactJob.check_spec``: head budgets uniform/auto, bounded follow-up answers);
    ValueError naming the flag for a bad channel (``sglang_ext.channel.check_channel``:
    TLS files, a token in plaintext to a non-loopback host).
    """
    endpoint = getattr(ns, "compaction_endpoint", None)
    if not endpoint:
        return None
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
        allow_plaintext_token=ns.compaction_allow_plaintext_token,
    )
    check_channel(endpoint, **channel)
    return CompactionConfig(
        endpoint=endpoint,
        spec=spec,
        min_prefix_tokens=ns.compaction_min_prefix_tokens,
        min_hits=ns.compaction_min_hits,
        min_continuations=ns.compaction_min_continuations,
        timeout=ns.compaction_timeout,
        max_follow_ups=ns.compaction_max_follow_ups,
        refit_at=tuple(ns.compaction_refit_at),
        follow_up_tokens=ns.compaction_follow_up_tokens,
        boundary_margin=ns.compaction_boundary_margin,
        align_tokens=ns.compaction_align_tokens,
        max_retries=ns.compaction_max_retries,
        retry_backoff_s=ns.compaction_retry_backoff,
        failure_cooldown_s=ns.compaction_failure_cooldown,
        max_in_flight=ns.compaction_max_in_flight,
        install_chunk_mb=ns.compaction_install_chunk_mb,
        install_step_ms=ns.compaction_install_step_ms,
        **channel,
    )


def get_config(server_args: Any) -> CompactionConfig | None:
    """The config stored on a ServerArgs record (None: plugin inactive)."""
    cfg = getattr(server_args, CONFIG_ATTR, None)
    return cfg if isinstance(cfg, CompactionConfig) else None
