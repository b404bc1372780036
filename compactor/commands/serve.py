"""`compactor serve`: run the gRPC compaction service (Ray workers by default).

Serve compactions over gRPC (health + reflection included). Binds 127.0.0.1 unless --host
says otherwise. Workers are Ray actors (local `ray.init()` unless --ray-address), or threads
in this process with --in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from pathlib import Path
from typing import Any

from compactor.endpoints import is_loopback
from compactor.spec import AUTO_CHUNK_TOKENS, DEFAULT_AUTO_RATIO, parse_chunk_tokens
from compactor.spec.limits import MAX_QUEUE, MAX_REQUESTS_PER_TENANT, WorkLimits

log = logging.getLogger("compactor.serve")


def chunk_tokens_arg(text: str) -> int | None:
    """--auto-chunk-tokens as an argparse type (the benchmarks' --chunk-tokens too)."""
    try:
        return parse_chunk_tokens(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


HELP = "run the gRPC compaction service"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default 127.0.0.1); any other than a loopback address needs TLS "
        "(--tls-cert/--tls-key) or --insecure",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without TLS: prompts and results travel in clear "
        "(only on a network where nobody else listens)",
    )
    p.add_argument("--port", type=int, default=50051, help="0 = any free port")
    p.add_argument(
        "--model",
        required=True,
        help="known model name (e.g. smollm2-135m), checkpoint directory, or Hugging Face Hub "
        "ID already in the local hub cache ($HF_HUB_CACHE / $HF_HOME; never downloaded)",
    )
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster")
    p.add_argument("--in-process", action="store_true", help="no Ray: workers are threads here")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="device of --in-process workers (Ray actors take a GPU when the cluster has one)",
    )
    p.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                   help=f"compactions that may wait for a worker (default {MAX_QUEUE}; "
                   "beyond: RESOURCE_EXHAUSTED)")  # fmt: skip
    p.add_argument(
        "--max-prefix-tokens",
        type=int,
        default=None,
        help="longest prefix accepted (default: the model's context length, config.json "
        "max_position_embeddings)",
    )
    p.add_argument("--max-message-mb", type=int, default=16)
    p.add_argument("--cache-mb", type=int, default=1024)
    p.add_argument(
        "--auto-ratio",
        type=float,
        default=DEFAULT_AUTO_RATIO,
        help=f"ratio used for budget 'auto' (default {DEFAULT_AUTO_RATIO})",
    )
    p.add_argument(
        "--auto-chunk-tokens",
        type=chunk_tokens_arg,
        default=AUTO_CHUNK_TOKENS,
        metavar="N|none",
        help="compact a longer prefix whose spec sets no chunk_size in KV chunks of N tokens "
        f"(default {AUTO_CHUNK_TOKENS}: the fit's cost per chunk stays bounded; 'none': "
        "always one chunk)",
    )
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--tls-client-ca", type=Path, help="require client certs signed by this CA")
    p.add_argument(
        "--auth-token-file",
        type=Path,
        help="require 'authorization: Bearer <token>'; re-read when the file changes",
    )
    p.add_argument(
        "--signing-key-file",
        type=Path,
        help="sign every result (HMAC-SHA256, bound to its request) with the key in this file, "
        "shared with the clients and never sent; re-read when the file changes",
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve /metrics on this port")
    p.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: how long compactions in flight may take to finish before "
        "they are cancelled (new ones get UNAVAILABLE at once); exit 0 at most ~10 s later",
    )
    WorkLimits.add_cli_args(p)
    p.add_argument("--max-deadline-s", type=float, default=3600.0,
                   help="the longest one request may keep a compaction going (default 3600; "
                   "requests without a deadline get it)")  # fmt: skip
    p.add_argument("--max-requests-per-tenant", type=int, default=MAX_REQUESTS_PER_TENANT,
                   help="requests one caller (its mTLS identity; without mTLS every caller is "
                   f"one) may have in progress at once (default {MAX_REQUESTS_PER_TENANT}; "
                   "beyond: RESOURCE_EXHAUSTED)")  # fmt: skip
    p.add_argument("--max-concurrent-rpcs", type=int, default=256,
                   help="Compact calls served at once, all callers (default 256; beyond: "
                   "RESOURCE_EXHAUSTED); health checks and model info are answered beside "
                   "them")  # fmt: skip
    # test-only: sleep this long before each layer, to make compactions deterministically slow
    p.add_argument("--test-layer-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from compactor.models import resolve_model
    from compactor.service.engine import ServiceConfig
    from compactor.service.server import PortInUseError, ServerConfig, TlsConfig
    from compactor.workers.pool import PoolConfig

    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("compactor serve: error: --tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise SystemExit("compactor serve: error: --tls-client-ca needs --tls-cert/--tls-key")
    if args.max_prefix_tokens is not None and args.max_prefix_tokens < 2:
        raise SystemExit(
            f"compactor serve: error: --max-prefix-tokens must be >= 2, got {args.max_prefix_tokens}"
        )
    try:
        limits = WorkLimits.from_args(args)
    except ValueError as exc:
        raise SystemExit(f"compactor serve: error: {exc}") from None
    if not args.tls_cert and not args.insecure and not is_loopback(args.host):
        raise SystemExit(
            f"compactor serve: error: --host {args.host} is not a loopback address and the "
            "service has no TLS: prompts and results would travel in clear; give --tls-cert and "
            "--tls-key, or --insecure to accept that"
        )
    if not args.tls_cert and not is_loopback(args.host):
        log.warning("serving plaintext on %s (--insecure): prompts travel in clear", args.host)
    _check_port(args.host, args.port)
    token, signing_key = (
        _secret_file(args, flag) for flag in ("auth_token_file", "signing_key_file")
    )
    try:
        model_dir = resolve_model(args.model)
    except ValueError as exc:
        raise SystemExit(f"compactor serve: error: {exc}") from exc
    try:
        config = ServerConfig(
            service=ServiceConfig(
                pool=PoolConfig(
                    model_dir=str(model_dir),
                    workers=args.workers,
                    mode="local" if args.in_process else "ray",
                    ray_address=args.ray_address,
                    max_queue=args.max_queue,
                    layer_delay_s=args.test_layer_delay_s,
                    device=args.device,
                ),
                max_prefix_tokens=args.max_prefix_tokens,
                cache_bytes=args.cache_mb << 20,
                auto_ratio=args.auto_ratio,
                auto_chunk_tokens=args.auto_chunk_tokens,
                limits=limits,
                max_deadline_s=args.max_deadline_s,
                max_per_tenant=args.max_requests_per_tenant,
            ),
            host=args.host,
            port=args.port,
            tls=TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca)
            if args.tls_cert
            else None,
            auth_token=token,
            signing_key=signing_key,
            max_message_bytes=args.max_message_mb << 20,
            metrics_port=args.metrics_port,
            drain_seconds=args.drain_seconds,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
        )
    except ValueError as exc:
        raise SystemExit(f"compactor serve: error: {exc}") from None
    try:
        asyncio.run(_run(config))
    except PortInUseError as exc:
        raise SystemExit(f"compactor serve: error: {exc}") from exc
    return 0


def _secret_file(args: argparse.Namespace, name: str) -> Any:
    """The `TokenFile` flag `name` gives (read now: a missing or empty file ends the command
    naming the flag), else None."""
    path = getattr(args, name)
    if not path:
        return None
    from compactor.service.auth import TokenFile

    secret = TokenFile(path)  # read again whenever the file changes
    try:
        secret.read()
    except (OSError, ValueError) as exc:
        raise SystemExit(f"compactor serve: error: --{name.replace('_', '-')}: {exc}") from None
    return secret


async def _run(config: object) -> None:
    from compactor.service.server import CompactorServer, ServerConfig

    assert isinstance(config, ServerConfig)
    server = await CompactorServer.start(config)
    print(f"compactor serving on {server.address}", flush=True)
    if server.metrics_port is not None:
        print(f"metrics on http://{config.host}:{server.metrics_port}/metrics", flush=True)
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _first, received, sig)
    sig = await received
    log.info("%s: shutting down gracefully (drain up to %.3g s)", sig.name, config.drain_seconds)
    await server.stop()


def _first(received: asyncio.Future[signal.Signals], sig: signal.Signals) -> None:
    if not received.done():
        received.set_result(sig)


def _check_port(host: str, port: int) -> None:
    """Fail early, with a clear message, if host:port cannot be bound. Binds as gRPC's
    listener does (SO_REUSEADDR): a restart on the port of a life that had clients finds its
    old connections in TIME_WAIT, which only a listener still there should refuse."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise SystemExit(
                f"compactor serve: error: cannot bind {host}:{port}: {exc.strerror} "
                "(is another server running? pick another --port)"
            ) from None
