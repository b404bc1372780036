"""The plugin's gRPC channel flags (TLS, bearer token, result signing key) and their startup
checks.

The token never rides on the command line: SGLang keeps the raw command line
(`ServerArgs._launch_command`) and the unauthenticated `GET /server_info` returns it, and
`ps` shows it. It comes from `--compaction-token-file` (re-read when the file changes) or
the environment variable `SGLANG_COMPACTION_TOKEN`; `--compaction-token` is kept only to
refuse it with that advice (argparse stops at it, so its value is stored nowhere).

The key results are signed with is another secret, shared with the service as a file
(`--compaction-signing-key-file`) and never sent: whoever reads the token off the wire cannot
sign a result with it.

Checked at startup (:func:`check_channel`, from `config_from_namespace`): TLS needs
`--compaction-tls-ca`; the CA, cert and key files (and the secrets' files) are readable; cert and key
come together; a plaintext channel (prompts and results in clear, and the token, if any)
goes only to a loopback host unless `--compaction-insecure` says so.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from typing import Any

from compactor import endpoint_host, is_loopback

__all__ = [
    "TOKEN_ENV",
    "add_channel_args",
    "check_channel",
    "endpoint_host",
    "is_loopback",
    "token_from_env",
]

TOKEN_ENV = "SGLANG_COMPACTION_TOKEN"
logger = logging.getLogger(__name__)


class _RefuseTokenFlag(argparse.Action):
    """`--compaction-token`: always an error, before its value is stored anywhere."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        parser.error(
            "--compaction-token is not accepted: a token on the command line is echoed by "
            "GET /server_info and shown by ps; put it in a file and pass "
            f"--compaction-token-file PATH, or set the environment variable {TOKEN_ENV}"
        )


def add_channel_args(g: Any) -> None:
    """Add the channel flags to an argparse group (mutates `g`)."""
    g.add_argument(
        "--compaction-tls",
        action="store_true",
        help="Use TLS for gRPC (implied by a grpcs:// endpoint); needs --compaction-tls-ca.",
    )
    g.add_argument("--compaction-tls-ca", default=None, help="CA bundle (PEM) of the service.")
    g.add_argument(
        "--compaction-tls-cert", default=None, help="Client certificate (mTLS; with the key)."
    )
    g.add_argument("--compaction-tls-key", default=None, help="Client key (mTLS; with the cert).")
    g.add_argument(
        "--compaction-token",
        nargs="?",
        action=_RefuseTokenFlag,
        help="Refused: use --compaction-token-file or the environment variable "
        f"{TOKEN_ENV} (a command-line token is echoed by GET /server_info).",
    )
    g.add_argument(
        "--compaction-token-file",
        default=None,
        help="File holding the bearer token for the service; re-read when it changes. "
        f"Or set the environment variable {TOKEN_ENV}.",
    )
    g.add_argument(
        "--compaction-signing-key-file",
        default=None,
        help="File holding the key the service signs results with (compactor serve "
        "--signing-key-file); every result must then carry its signature for its request. "
        "Re-read when it changes.",
    )
    g.add_argument(
        "--compaction-insecure",
        action="store_true",
        help="Talk to a non-loopback service without TLS: prompts, results and the token (if "
        "any) in clear (refused otherwise).",
    )


def token_from_env(token_file: str | None) -> str | None:
    """The token of `$SGLANG_COMPACTION_TOKEN` (None when unset); ValueError when both it
    and `--compaction-token-file` are given, or it is set but blank."""
    raw = os.environ.get(TOKEN_ENV)
    if raw is None:
        return None
    if token_file:
        raise ValueError(
            f"give the compaction token one way: --compaction-token-file or ${TOKEN_ENV}, not both"
        )
    if not raw.strip():
        raise ValueError(f"${TOKEN_ENV} is set but empty")
    return raw.strip()


def _check_file(flag: str, path: str | None) -> None:
    if path is None:
        return
    if not os.path.isfile(path):
        raise ValueError(f"{flag}: no such file {path!r}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{flag}: {path!r} is not readable")


def check_channel(
    endpoint: str,
    *,
    tls: bool,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    token: str | None,
    token_file: str | None,
    insecure: bool,
    signing_key_file: str | None = None,
) -> None:
    """Refuse (ValueError naming the flag) a channel set up wrong; `inproc://` has none."""
    if endpoint.startswith("inproc://"):
        return
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("--compaction-tls-cert and --compaction-tls-key go together")
    if not tls and (tls_ca or tls_cert):
        raise ValueError(
            "--compaction-tls-ca/-cert/-key need --compaction-tls or a grpcs:// endpoint "
            "(without them the channel would be plaintext)"
        )
    if tls and not tls_ca:
        why = "a grpcs:// endpoint" if endpoint.startswith("grpcs://") else "--compaction-tls"
        raise ValueError(f"{why} needs --compaction-tls-ca (the service's CA bundle, PEM)")
    for flag, path in (
        ("--compaction-tls-ca", tls_ca),
        ("--compaction-tls-cert", tls_cert),
        ("--compaction-tls-key", tls_key),
    ):
        _check_file(flag, path)
    for flag, secret in (("--compaction-token-file", token_file),
                         ("--compaction-signing-key-file", signing_key_file)):  # fmt: skip
        if secret is not None:
            from compactor import TokenFile

            try:
                TokenFile(secret).read()
            except (OSError, ValueError) as exc:
                raise ValueError(f"{flag}: {exc}") from None
    if tls or is_loopback(endpoint):
        return
    has_token = token is not None or token_file is not None
    what = "prompts, results and the compaction token" if has_token else "prompts and results"
    if not insecure:
        raise ValueError(
            f"refusing to send {what} in plaintext to {endpoint!r}: use --compaction-tls with "
            "--compaction-tls-ca (or a grpcs:// endpoint), or pass --compaction-insecure to "
            "accept it"
        )
    logger.warning("%s go in plaintext to %s (--compaction-insecure)", what, endpoint)
