"""`compactor calibrate compresskv --model M`: offline calibration for CompressKV."""

from __future__ import annotations

import argparse
import json

HELP = "offline per-model calibration of methods that need it"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="calibrate_command", required=True)
    p = sub.add_parser(
        "compresskv",
        help="Semantic-Retrieval-Head scores + per-layer errors, saved next to the model",
        description=(
            "Run single-needle cases (compactor.eval.niah) through the model teacher-forced with the "
            "right answer; score each query head by the attention mass it puts on the answer "
            "span while the model predicts correct answer tokens, and each layer by its "
            "normalized attention-output error under a minimal budget. Writes "
            "compresskv_calibration.json into the model directory (or --out)."
        ),
    )
    p.add_argument("--model", required=True, help="known model name or checkpoint directory")
    p.add_argument("--cases", type=int, default=6, help="needle cases (default 6)")
    p.add_argument("--tokens", type=int, default=384, help="tokens per case (default 384)")
    p.add_argument("--min-budget", type=int, default=8, help="minimal budget per KV head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: in the model directory)")
    p.set_defaults(func=_compresskv)


def _compresskv(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from compactor import hf
    from compactor.eval.compresskv_calibration import calibrate_compresskv, save_calibration
    from compactor.models import resolve_model

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model_dir = resolve_model(args.model)
    model, tok = hf.load_model(model_dir)
    if tok is None:
        raise SystemExit(f"no tokenizer in {model_dir}: the needle cases need one")
    data = calibrate_compresskv(
        model,
        tok,
        num_cases=args.cases,
        num_tokens=args.tokens,
        min_budget=args.min_budget,
        seed=args.seed,
        progress=True,
    )
    if args.out:
        path = Path(args.out)
        path.write_text(json.dumps(data, indent=1))
    else:
        path = save_calibration(model_dir, data)
    top = [sorted(range(len(r)), key=lambda j: -r[j])[:4] for r in data["srh_scores"]]
    print(json.dumps({"path": str(path), "seconds": round(data["seconds"], 1), "top4": top}))
    return 0
