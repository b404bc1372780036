"""`compactor request`: send one prefix to a compaction server and summarize the result.

INPUT is a JSON list of token ids (or {'token_ids': [...]}) or a text file tokenized with
the model's tokenizer. --model is a known model name or a checkpoint directory (its
fingerprint identifies the model), or the 32-hex fingerprint itself (then INPUT must be
token ids).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from compactor.commands._common import require_file
from compactor.spec import CompactionSpec
from compactor.spec.cli_args import UsageError, add_spec_args, spec_from_args, usage_error

# The request's defaults: the spec's (budget auto: neither --ratio nor --tokens gives the
# server's auto ratio).
REQUEST_SPEC = CompactionSpec()


if TYPE_CHECKING:
    from compactor.client import TlsFiles

HELP = "compact one prefix on a running `compactor serve`"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, help="HOST:PORT")
    p.add_argument("--model", required=True)
    p.add_argument("--input", required=True, type=Path)
    add_spec_args(p, defaults=REQUEST_SPEC)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--output", type=Path, help="save the CompactedPrefix (safetensors)")
    p.add_argument("--tls-ca", type=Path, help="CA of the server's certificate (turns TLS on)")
    p.add_argument("--tls-cert", type=Path, help="client certificate for mTLS (with --tls-ca)")
    p.add_argument("--tls-key", type=Path, help="its key (with --tls-cert)")
    p.add_argument("--auth-token-file", type=Path)
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a plaintext channel to a non-loopback endpoint (the prefix, and the token if "
        "any, travel in clear)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_request)


def _request(args: argparse.Namespace) -> int:
    import grpc

    from compactor.client import CompactorClient
    from compactor.service.result_stream import ChecksumError
    from compactor.workers.job import CompactJob

    tls = _tls(args)
    spec = spec_from_args(args)
    try:  # what the server would refuse (head budgets other than uniform/auto, ...)
        CompactJob.check_spec(spec)
    except ValueError as exc:
        raise usage_error(exc, args) from None
    require_file(args.input, "--input")
    fp, token_ids = _resolve(args.model, args.input)
    token = args.auth_token_file.read_text().strip() if args.auth_token_file else None
    try:
        with CompactorClient(args.endpoint, tls=tls, auth_token=token) as client:
            res = client.compact_prefix(token_ids, fp, spec, timeout=args.timeout)
    except grpc.RpcError as err:
        raise SystemExit(f"compactor request: {err.code().name}: {err.details()}") from None
    except ChecksumError as exc:
        raise SystemExit(f"compactor request: corrupt result: {exc}") from None
    summary = res.summary()
    if args.output:
        res.prefix.save(args.output)
        summary["output"] = str(args.output)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            print(f"{k:>18}: {v}")
    return 0


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    """The channel's TLS files; UsageError for a half-given pair or for plaintext to a
    non-loopback host without --insecure (what `compactor serve` and the plugin refuse too)."""
    from compactor.client import TlsFiles
    from compactor.endpoints import endpoint_host, is_loopback

    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together", "--tls-key")
    if args.tls_cert is not None and args.tls_ca is None:
        raise UsageError("a client certificate needs --tls-ca (TLS is on only with it)", "--tls-ca")
    if args.tls_ca is not None:
        return TlsFiles(args.tls_ca, args.tls_cert, args.tls_key)
    if not is_loopback(args.endpoint) and not args.insecure:
        raise UsageError(
            f"plaintext to {endpoint_host(args.endpoint)}: pass --tls-ca (TLS), or --insecure to send in clear",
            "--endpoint",
        )
    return None


def _resolve(model: str, path: Path) -> tuple[str, list[int]]:
    """(fingerprint, token ids) from --model and --input."""
    from compactor.models import fingerprint, resolve_model

    model_dir = None
    if re.fullmatch(r"[0-9a-f]{32}", model):
        fp = model
    else:
        try:
            model_dir = resolve_model(model)
        except ValueError as exc:
            raise SystemExit(f"compactor request: error: {exc}") from exc
        fp = fingerprint(model_dir)
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        data = data.get("token_ids")
    if isinstance(data, list) and all(isinstance(t, int) for t in data):
        return fp, data
    if model_dir is None:
        raise SystemExit("compactor request: error: text input needs --model NAME or a directory")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return fp, list(tok(text, add_special_tokens=False)["input_ids"])
