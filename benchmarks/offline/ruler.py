"""RULER-style accuracy of compacted prefixes, paired against the full cache on the same items.

Each item is one context of a RULER task (`compactor.eval.ruler`) and its scored question. The
full cache ("stock") answers it greedily; then every method x ratio compacts the context and
answers again, in one or both settings:

- agnostic: the compaction never sees the question (its queries come from the context
  alone, `--query-sources`), the setting of kvpress's leaderboard;
- multi-query: the compaction also fits on other questions about the same context (the
  `follow-up` source), then the scored question is asked: the serving setting.

Our methods start from `--base`: the spec the CLI and the service default to, or the SGLang
plugin's (its follow-up queries with the model's answers, on-policy; without follow-ups it
falls back to repeat-prefill, as a served prefix does).

Per (setting, method, ratio) it reports accuracy, retention = P(compacted correct | stock
correct) with McNemar counts, and the teacher-forced per-token agreement and log-prob gap on
stock's answers, each with a bootstrap 95% interval (`compactor.eval.paired`). Each record also
holds the attention errors on the scored question's and stock answer's own queries (the
queries that read the needle): output and mass relative errors, means over layers and heads. Seeds come from
a split: `dev` (0, 1, ...) to choose defaults, `heldout` (1000, 1001, ...) to report them.

    .venv/bin/python -m benchmarks.offline.ruler --quick     # a minute or two: structure, pairing
    .venv/bin/python -m benchmarks.offline.ruler             # the suite
    .venv/bin/python -m benchmarks.offline.ruler --merge A.json B.json --json ruler.json

`--merge` runs nothing: it joins result files of runs that split the suite (by setting,
method, press or haystack) into one, after checking that an item shared by two of them got
the same stock answer score in both and that no (item, setting, method, ratio) is in two; the
summary is recomputed, each record names its part, and each part's provenance and config
are kept.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import RESULTS, ROOT, add_options, script_parser
from benchmarks.offline._kvpress import compression_ratio
from benchmarks.offline.ruler_results import merge, overall, summarize

SPLIT_SEED = {"dev": 0, "heldout": 1000}
KVPRESS_PY = ROOT / "third_party" / ".kvpress-venv" / "bin" / "python"
PRESSES = {  # --presses name -> kvpress class (its compression_ratio: `_kvpress`)
    "kvzip": "KVzipPress",
    "expected_attention": "ExpectedAttentionPress",
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "streaming_llm": "StreamingLLMPress",
    "keydiff": "KeyDiffPress",
}
BASES = ("spec", "plugin")
GENERIC = ("What is the text above about?", "Summarize the text above in one sentence.")


def _parse(argv: list[str] | None) -> Any:
    p = script_parser(__doc__)
    add_options(
        p,
        model=("smollm2-135m", "known model name or checkpoint directory"),
        tokens=("2000", "comma-separated context lengths (tokens)"),
        seeds=(4, "items per task and length"),
        split=("heldout", "seeds 0, 1, ... (dev: choose defaults) or 1000, ... (heldout: report)"),
        seed_start=(0, "the split's first seed to run (4: seeds 1004, ... of heldout): a later "
                    "part of a split, joined to the earlier ones with --merge"),
        threads=(1, "torch threads"),
        tasks=("niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe,fwe",
               "comma-separated RULER tasks (compactor.eval.ruler)"),
        haystacks=("filler,essays", "the prose the NIAH tasks and vt hide needles in "
                   "(compactor.eval.niah.HAYSTACKS; cwe and fwe have none)"),
        methods=("am-highest,kvzip,kvzip:refit=am", "our methods, NAME[:KEY=VALUE...]"),
        ratios=("0.1,0.05,0.02", "kept fractions (0.1 = 10x)"),
        settings=("agnostic,multi-query", "agnostic and/or multi-query (see above)"),
        base=("spec", "the spec our methods start from: spec (CompactionSpec(), the CLI's and "
              "the service's) or plugin (the SGLang plugin's: follow-up queries, on-policy)"),
        query_sources=("", "reference-query sources of our methods ('': the base spec's)"),
    )  # fmt: skip
    p.add_argument(
        "--max-queries", type=int, help="reference queries per KV head (default: the base's)"
    )
    p.add_argument(
        "--on-policy", choices=("on", "off"), help="on-policy fitting (default: the base's)"
    )
    add_options(
        p,
        presses=(
            "kvzip,expected_attention,snapkv,tova,streaming_llm,keydiff",
            "kvpress presses run on the same items in the kvpress venv; '' for none",
        ),
    )
    add_options(p, json=(str(RESULTS / "ruler" / "ruler.json"), "where the results go"))
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="join these result files into --json (runs nothing; see above)",
    )
    p.add_argument("--kvpress-side", nargs=2, metavar=("MODEL_DIR", "ITEMS_JSON"),
                   help=argparse.SUPPRESS)  # fmt: skip
    add_options(p, quick=(False, "2 tasks x 2 haystacks, 1 seed, 512 tokens, 1 ratio, "
                          "repeat-prefill queries"))  # fmt: skip
    args = p.parse_args(argv)
    if args.split not in SPLIT_SEED:
        p.error(f"--split must be one of {sorted(SPLIT_SEED)}, got {args.split!r}")
    if args.seed_start < 0:
        p.error(f"--seed-start must be >= 0, got {args.seed_start}")
    if args.base not in BASES:
        p.error(f"--base must be one of {', '.join(BASES)}, got {args.base!r}")
    if args.quick:
        args.tasks, args.tokens, args.seeds, args.ratios = "niah_single,vt", "512", 1, "0.1"
        args.haystacks = "filler,essays"
        args.methods, args.query_sources = "am-highest", "repeat-prefill"
        args.presses = "snapkv" if KVPRESS_PY.exists() else ""
    return args


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def setting_spec(
    base: str, sources: str, setting: str, max_queries: int | None, on_policy: str | None = None
) -> Any:
    """The spec a method entry of `setting` starts from (its method and ratio replaced per
    run): the `base` spec (``spec``: ``CompactionSpec()``; ``plugin``: the plugin's) with
    `sources` ('' keeps the base's), `max_queries` and `on_policy` ("on"/"off"; None keeps
    the base's). multi-query
    adds the ``follow-up`` source; agnostic drops it, falling back as serving does
    (``CompactionSpec.for_follow_ups``)."""
    from compactor.spec import CompactionSpec
    from sglang_ext.config import PLUGIN_SPEC

    start = PLUGIN_SPEC if base == "plugin" else CompactionSpec()
    qs = tuple(_csv(sources)) or start.queries.sources
    multi = setting == "multi-query"
    if multi and "follow-up" not in qs:
        qs = (*qs, "follow-up")
    cap = {"max_queries_per_head": max_queries} if max_queries else {}
    spec = start.replace(queries={"sources": qs, **cap})
    if on_policy is not None:
        spec = spec.replace(on_policy=on_policy == "on")
    return spec if multi else spec.for_follow_ups([])


def run_items(args: Any, model: Any, tok: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One record per (item, setting, method, ratio), stock's outcome beside ours; and the
    items as token ids (what the kvpress side answers)."""
    from compactor.eval.harness import EvalCase, build_reference, evaluate_prefix
    from compactor.eval.niah import question_text
    from compactor.eval.ruler import HAYSTACK_TASKS, make_ruler
    from compactor.eval.runner import method_spec
    from compactor.pipeline import Hooks, compact_prefix

    def enc(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    records, items = [], []
    seed0 = SPLIT_SEED[args.split] + args.seed_start
    for tokens in (int(t) for t in _csv(args.tokens)):
        for task, haystack in _task_haystacks(args, HAYSTACK_TASKS):
            for seed in range(seed0, seed0 + args.seeds):
                case = make_ruler(tok, task, tokens, seed, haystack)
                ids, scored = enc(case.prefix), case.questions[0]
                ref = build_reference(
                    model, tok, EvalCase(f"{task}-{seed}", ids, [enc(scored.text)],
                                         [scored.answers]), case.answer_tokens)  # fmt: skip
                others = [q.text for q in case.questions[1:]]
                others += [question_text(tok, g) for g in GENERIC]
                item = {"task": task, "haystack": haystack, "tokens": len(ids), "seed": seed,
                        "stock_score": ref.niah_scores[0]}  # fmt: skip
                answer = tok.decode(ref.answers[0], skip_special_tokens=True)  # as kvpress's
                items.append({**item, "prefix_ids": ids, "question_ids": enc(scored.text),
                              "answers": scored.answers, "answer_tokens": case.answer_tokens,
                              "stock_answer": answer})  # fmt: skip
                for setting in _csv(args.settings):
                    multi = setting == "multi-query"
                    base = setting_spec(
                        args.base, args.query_sources, setting, args.max_queries, args.on_policy
                    )
                    follow_ups = [enc(t) for t in others] if multi else None
                    hooks = Hooks(progress=False, reuse={})  # one prefill per item and setting
                    for method in _csv(args.methods):
                        for ratio in (float(r) for r in _csv(args.ratios)):
                            t0 = time.perf_counter()
                            spec = method_spec(base, method, ratio)
                            prefix, _ = compact_prefix(model, tok, ids, spec, follow_ups, hooks)
                            m = evaluate_prefix(model, tok, ref, prefix, niah=True)
                            records.append({**item, "setting": setting, "method": method,
                                            "ratio": ratio, "score": m["niah_accuracy"],
                                            "token_agreement": m["agreement"],
                                            "logprob_gap": m["logppl_gap"],
                                            "output_err": m["output_rel_err"],
                                            "mass_err": m["mass_rel_err"],
                                            "seconds": time.perf_counter() - t0})  # fmt: skip
                print(f"{task} ({haystack}) T={len(ids)} seed={seed}: stock "
                      f"{ref.niah_scores[0]:.2f}", flush=True)  # fmt: skip
    return records, items


def _task_haystacks(args: Any, haystack_tasks: tuple[str, ...]) -> list[tuple[str, str]]:
    """(task, haystack) pairs to run: every haystack of `--haystacks` for a task that has one,
    the default (filler) for the others."""
    haystacks = _csv(args.haystacks)
    return [(t, h) for t in _csv(args.tasks)
            for h in (haystacks if t in haystack_tasks else ["filler"])]  # fmt: skip


def run_kvpress(args: Any, items: list[dict[str, Any]], model_dir: Path) -> list[dict[str, Any]]:
    """The same items through kvpress's presses (query-agnostic: the context is compressed
    before the question is seen, then greedy answers), in the kvpress venv."""
    from compactor.eval.niah import score_answer

    presses = _csv(args.presses)
    if not presses:
        return []
    if not KVPRESS_PY.exists():
        raise SystemExit(f"--presses needs the kvpress venv ({KVPRESS_PY}): make kvpress-venv")
    work = Path(args.json).with_suffix(".kvpress.tmp.json")
    ratios = [float(r) for r in _csv(args.ratios)]
    work.write_text(json.dumps({"presses": presses, "ratios": ratios, "items": items}))
    cmd = [str(KVPRESS_PY), "-m", "benchmarks.offline.ruler", "--kvpress-side", str(model_dir),
           str(work)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    answers = json.loads(work.with_suffix(".out").read_text())
    work.unlink()
    work.with_suffix(".out").unlink()
    records = []
    for item, got in zip(items, answers, strict=True):
        base = {k: item[k] for k in ("task", "haystack", "tokens", "seed", "stock_score")}
        for key, (answer, seconds) in got.items():
            press, ratio = key.split("@")
            if press == "none":  # kvpress without a press gives stock's answer (first in `got`)
                base["kvpress_stock_agrees"] = answer.strip() == item["stock_answer"].strip()
                continue
            records.append({**base, "setting": "agnostic", "method": f"kvpress:{press}",
                            "ratio": float(ratio), "score": score_answer(answer, item["answers"]),
                            "token_agreement": None, "logprob_gap": None,
                            "output_err": None, "mass_err": None,
                            "seconds": seconds})  # fmt: skip
    return records


def kvpress_side(model_dir: str, items_json: str) -> None:
    """Runs in the kvpress venv (torch, transformers, kvpress only): every item through
    every press at every ratio; writes [{"press@ratio": [answer, seconds]}] per item."""
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    torch.set_num_threads(1)
    job = json.loads(Path(items_json).read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pipe = pipeline("kv-press-text-generation", model=model,
                    tokenizer=AutoTokenizer.from_pretrained(model_dir), device="cpu")  # fmt: skip
    out = []
    for item in job["items"]:
        ids = {"context_ids": torch.tensor([item["prefix_ids"]]),
               "questions_ids": [torch.tensor([item["question_ids"]])]}  # fmt: skip
        runs = [("none", 1.0, None)] + [
            (name, r, getattr(kvpress, PRESSES[name])(compression_ratio=compression_ratio(r)))
            for name in job["presses"]
            for r in job["ratios"]
        ]
        got: dict[str, tuple[str, float]] = {}
        for name, r, press in runs:
            t0 = time.perf_counter()
            with torch.inference_mode():
                answer = pipe._forward(ids, max_new_tokens=item["answer_tokens"], press=press)[0]
            got[f"{name}@{r}"] = (answer, time.perf_counter() - t0)
        out.append(got)
        print(f"kvpress: {item['task']} seed={item['seed']} done", flush=True)
    Path(items_json).with_suffix(".out").write_text(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.kvpress_side:
        kvpress_side(*args.kvpress_side)
        return 0
    if args.merge:
        from harness.provenance import provenance

        records, parts = merge(args.merge)
        merged = {"provenance": provenance(argv), "parts": parts,
                  "summary": summarize(records), "items": records}  # fmt: skip
        return _write(args.json, merged)
    import torch

    from compactor import hf
    from compactor.models import resolve_model
    from harness.provenance import provenance

    prov = provenance(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    model, tok = hf.load_model(model_dir)
    t0 = time.perf_counter()
    records, items = run_items(args, model, tok)
    records += run_kvpress(args, items, Path(model_dir))
    out = {
        "provenance": prov,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "base_specs": {  # what each setting's runs started from, defaults resolved
            setting: setting_spec(
                args.base, args.query_sources, setting, args.max_queries, args.on_policy
            ).to_dict()
            for setting in _csv(args.settings)
        },
        "seconds": time.perf_counter() - t0,
        "summary": summarize(records),
        "items": records,
    }
    return _write(args.json, out)


def _write(path: str, out: dict[str, Any]) -> int:
    """Write the results to `path` and print the summary over all items."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    for s in overall(out["summary"]):
        print(f"{s['setting']:12} {s['method']:28} {s['compression']:5}x  {s['items']:3} items  "
              f"stock {s['stock_accuracy']:.2f}  ours {s['accuracy']:.2f}  "
              f"retention {s['retention']}  agree/token {s.get('token_agreement')}")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
