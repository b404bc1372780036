"""Shared-document workloads: needle documents, their questions, and clients for a live server.

Each document is harbour-town filler with three needles (a vault password,
the mayor's name, the colour of the mayor's boat); document `i` uses the i-th value set, so
answers are checkable per document. `questions()` are asked before compaction (the
compaction fits them); `unseen_questions()` only after, to measure what a user's next
question gets. The plugin's server tests use document 0 and its six questions; the serving
demo (`harness.demo`) uses several documents and both sets. `many_questions(n)` extends the
seen set (refits on more questions); `prose_document(...)` is a document with no needles,
asked `many_questions(n, prose=True)` before and `prose_unseen_questions()` after.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from harness.launch import SGLangServer
from harness.pool import fetch_metrics

_FILLER = [
    "The harbour town kept its records in a blue ledger.",
    "Fishing boats left before dawn and returned at noon.",
    "The old lighthouse was painted white with a red stripe.",
    "Merchants sold salt, rope, lanterns and dried fish on the quay.",
    "Every winter the storms closed the northern road for weeks.",
]
# question -> statement template; document i fills it with NEEDLE_VALUES[i][j]
_NEEDLE_TEMPLATES = {
    "What is the secret password of the vault?": "The secret password of the vault is {}.",
    "Who is the mayor of the town?": "The mayor of the town is {}.",
    "Which colour is the mayor's boat?": "The mayor's boat is painted {}.",
}
NEEDLE_VALUES = [
    ("falcon", "Margaret", "green"),
    ("otter", "Henrik", "yellow"),
    ("juniper", "Beatrice", "purple"),
    ("harpoon", "Oswald", "orange"),
]
OTHER_QUESTIONS = [
    "How do the fishing boats spend the day?",
    "When is the northern road closed?",
    "Where did merchants sell their goods?",
]
# Asked only after the install: the compaction never saw them (its follow-ups are
# `questions()`). Needle rephrasings -> index of the needle value they ask for.
_UNSEEN_NEEDLES = {
    "What word opens the vault?": 0,
    "What is the name of the town's mayor?": 1,
    "What colour is the boat that belongs to the mayor?": 2,
}
UNSEEN_OTHER_QUESTIONS = [
    "What did the old lighthouse look like?",
    "What colour was the ledger of the harbour town?",
    "When did the fishing boats come back?",
]
_NEEDLE_DAYS = (20, 55, 90)
# More seen questions (many_questions), after questions(): rephrased needle questions, then
# questions about the filler facts; per-day questions follow.
_MORE_NEEDLE_QUESTIONS = [
    "What is the vault's password?",
    "What is the mayor called?",
    "What colour is the boat of the mayor?",
    "Which word is the password of the vault?",
    "Who governs the harbour town as mayor?",
]
_MORE_OTHER_QUESTIONS = [
    "In which book did the town keep its records?",
    "When did the fishing boats leave the harbour?",
    "What colours was the old lighthouse painted?",
    "What did the merchants sell on the quay?",
    "What closed the northern road every winter?",
    "For how long was the northern road closed?",
    "Which road did the winter storms close?",
    "Where did the town keep its records?",
    "What stripe did the lighthouse have?",
    "At what time of day did the boats return?",
]
# A prose document's own sentences (with the filler's), and its generic unseen questions.
_PROSE = [
    "A ferry crossed the bay twice a day when the water was calm.",
    "The baker on the hill sold rye bread and honey cakes.",
    "Children mended nets on the steps of the customs house.",
    "A brass bell in the market square rang at six every evening.",
    "Gulls nested on the roof of the old warehouse by the pier.",
    "The harbour master wrote the tides on a slate by his door.",
    "In spring the meadows above the town filled with wild flowers.",
]
_MORE_PROSE_QUESTIONS = [
    "How often did the ferry cross the bay?",
    "What did the baker on the hill sell?",
    "Where did the children mend nets?",
    "When did the bell in the market square ring?",
    "Where did the gulls nest?",
    "What did the harbour master write on his slate?",
]
PROSE_UNSEEN_QUESTIONS = [
    "What is the text above about?",
    "Which animals does the text mention?",
    "What could a visitor buy in the town?",
]


def _check_index(index: int) -> int:
    if not 0 <= index < len(NEEDLE_VALUES):
        raise ValueError(f"document index {index} not in [0, {len(NEEDLE_VALUES)})")
    return index


def needles(index: int = 0) -> dict[str, str]:
    """Needle question -> expected answer word for document `index` (`questions()` and
    `unseen_questions()` alike)."""
    values = NEEDLE_VALUES[_check_index(index)]
    return dict(zip(_NEEDLE_TEMPLATES, values)) | {q: values[j] for q, j in _UNSEEN_NEEDLES.items()}


NEEDLES = needles(0)


def document(sentences: int = 110, index: int = 0) -> str:
    """Filler with document `index`'s needles in it (110 sentences: ~1.9k tokens).

    The needles sit at 18%, 50% and 82% of the sentences; documents other than 0 open with
    their own title line, so no two share a radix path.
    """
    values = NEEDLE_VALUES[_check_index(index)]
    facts = [t.format(v) for t, v in zip(_NEEDLE_TEMPLATES.values(), values)]
    days = [round(sentences * d / 110) for d in _NEEDLE_DAYS]
    out = [f"Ledger {index} of the harbour town."] if index else []
    for i in range(sentences):
        if i in days:
            out.append(facts[days.index(i)])
        out.append(f"Day {i}: " + _FILLER[(i + index) % len(_FILLER)])
    return " ".join(out)


def questions() -> list[str]:
    """The six questions asked before compaction (the compaction's follow-ups)."""
    return [*_NEEDLE_TEMPLATES, *OTHER_QUESTIONS]


def unseen_questions() -> list[str]:
    """Six more questions, asked only after the install: a user's next questions."""
    return [*_UNSEEN_NEEDLES, *UNSEEN_OTHER_QUESTIONS]


def many_questions(n: int, prose: bool = False) -> list[str]:
    """`n` distinct questions asked before compaction, deterministic; none is an unseen one.

    Needle documents: the six `questions()` first, then rephrased needle questions and
    questions about the filler facts, then "What happened on day d?" (d = 1, 2, ...).
    `prose`: for a `prose_document` (no needles): the filler and prose questions, then the
    same per-day ones. Raises ValueError on n < 0.
    """
    if n < 0:
        raise ValueError(f"many_questions: n must be >= 0, got {n}")
    if prose:
        pool = [*OTHER_QUESTIONS, *_MORE_OTHER_QUESTIONS, *_MORE_PROSE_QUESTIONS]
    else:
        pool = [*questions(), *_MORE_NEEDLE_QUESTIONS, *_MORE_OTHER_QUESTIONS]
    pool += [f"What happened on day {d}?" for d in range(1, n - len(pool) + 1)]
    return pool[:n]


def prose_unseen_questions() -> list[str]:
    """Six questions asked of a `prose_document` only after the install (none about
    needles): three about the filler, three generic."""
    return [*UNSEEN_OTHER_QUESTIONS, *PROSE_UNSEEN_QUESTIONS]


def prose_document(sentences: int = 110, index: int = 0) -> str:
    """A document with no needles: a title line, then each day a sentence drawn from the
    filler and the prose sentences, seeded by `index` (documents differ from each other and
    from every `document`). Raises ValueError on a negative index."""
    if index < 0:
        raise ValueError(f"prose document index {index} must be >= 0")
    rng = random.Random(1000 + index)
    pool = [*_FILLER, *_PROSE]
    out = [f"Chronicle {index} of the harbour town."]
    out += [f"Day {i}: " + rng.choice(pool) for i in range(sentences)]
    return " ".join(out)


def prompt(doc: str, question: str) -> str:
    return f"{doc}\nQuestion: {question}\nAnswer:"


def needle_correct(question: str, text: str, index: int = 0) -> bool | None:
    """Whether an answer names document `index`'s needle (None for non-needle questions)."""
    answer = needles(index).get(question)
    return None if answer is None else answer.lower() in text.lower()


def ask_all(server: SGLangServer, doc: str, max_new_tokens: int = 16) -> list[dict[str, Any]]:
    """Greedy answers to every question, in order, with token ids."""
    outs = []
    for q in questions():
        out = server.post(
            "/generate",
            {
                "text": prompt(doc, q),
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
                "return_logprob": False,
            },
        )
        outs.append(out)
    return outs


@dataclass
class Timed:
    """One streamed greedy request: its answer and client-side timings (seconds)."""

    text: str
    output_ids: list[int]
    cached_tokens: int
    ttft_s: float
    latency_s: float


def stream_generate(url: str, text: str, max_new_tokens: int, timeout: float = 600.0) -> Timed:
    """POST /generate with `stream: true`; TTFT is the arrival of the first streamed chunk."""
    payload = {
        "text": text,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
    }
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft, last = None, None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            if ttft is None and chunk.get("output_ids"):
                ttft = time.perf_counter() - t0
            last = chunk
    if last is None:
        raise RuntimeError(f"{url}/generate streamed no data")
    meta = last.get("meta_info", {})
    return Timed(
        text=last.get("text", ""),
        output_ids=list(last.get("output_ids", [])),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        ttft_s=ttft if ttft is not None else time.perf_counter() - t0,
        latency_s=time.perf_counter() - t0,
    )


def stream_all(url: str, prompts: list[str], max_new_tokens: int) -> tuple[list[Timed], float]:
    """Send every prompt at once (one thread each); returns results in order and wall seconds."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
        results = list(pool.map(lambda p: stream_generate(url, p, max_new_tokens), prompts))
    return results, time.perf_counter() - t0


def percentile(xs: Sequence[float], q: float) -> float:
    """The `q` quantile of `xs` (0 <= q <= 1) by nearest rank: an element of `xs`."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def prompt_ids(server: SGLangServer, text: str) -> list[int]:
    """The token ids `server` makes of `text` for /generate (its /tokenize, special tokens as
    /generate adds them)."""
    return [int(t) for t in server.post("/tokenize", {"prompt": text})["tokens"]]


def metric(server: SGLangServer, name: str) -> float:
    """Sum of a Prometheus series on /metrics (0 when absent)."""
    return fetch_metrics(server.url).get(name, 0.0)


# Follow-up answer length (`compaction_args(answer_tokens=)`) for the tests that check how the
# plugin handles a compaction, not how good the fit is: a quicker, coarser fit.
QUICK_ANSWER_TOKENS = 8


def compaction_args(
    endpoint: str,
    ratio: float,
    method: str = "am-highest",
    min_hits: int = 2,
    min_prefix_tokens: int = 256,
    timeout_s: float = 600.0,
    refit_at: Sequence[int] = (),
    answer_tokens: int | None = None,
) -> list[str]:
    """`launch_server` flags that turn the plugin on against `endpoint`. The workloads ask
    one document `min_hits` different questions: its path is sent at the `min_hits`-th
    (`--compaction-min-continuations` set to `min_hits`). They measure one fit per document:
    no refits unless `refit_at` gives the question counts (`--compaction-refit-at`).
    `answer_tokens` sets `--compaction-follow-up-answer-tokens` (the plugin's default if None):
    a shorter answer per follow-up makes a quicker, coarser fit."""
    flags = [
        "--compaction-endpoint", endpoint,
        "--compaction-method", method,
        "--compaction-ratio", str(ratio),
        "--compaction-min-hits", str(min_hits),
        "--compaction-min-continuations", str(min_hits),
        "--compaction-min-prefix-tokens", str(min_prefix_tokens),
        "--compaction-timeout", str(timeout_s),
        "--compaction-refit-at", ",".join(str(n) for n in refit_at) or "none",
    ]  # fmt: skip
    if answer_tokens is not None:
        flags += ["--compaction-follow-up-answer-tokens", str(answer_tokens)]
    return flags


def compacted_length(branch: int) -> int:
    """The prefix length the plugin's trigger sends for a branch point at `branch` tokens
    (the defaults: `--compaction-boundary-margin` short, then down to a multiple of
    `--compaction-align-tokens`)."""
    from sglang_ext.config import CompactionConfig

    n = branch - CompactionConfig.boundary_margin
    return n - n % CompactionConfig.align_tokens


def wait_for_compactions(
    server: SGLangServer, expected: int, timeout_s: float, progress: bool = True
) -> dict[str, float]:
    """Poll /metrics until `expected` compactions ended (installed or fallen back).

    Returns the plugin's counters and gauges. Raises TimeoutError with the log tail.
    """
    names = ("installed_total", "fallbacks_total", "logical_tokens", "physical_tokens")
    t0 = time.monotonic()
    last = -1
    while True:
        scraped = fetch_metrics(server.url)
        m = {n: scraped.get(f"sglang:compaction_{n}", 0.0) for n in names}
        ended = int(m["installed_total"] + m["fallbacks_total"])
        if progress and ended != last:
            print(
                f"    compactions ended {ended}/{expected} "
                f"({time.monotonic() - t0:.0f} s, {int(m['fallbacks_total'])} fallbacks)",
                flush=True,
            )
            last = ended
        if ended >= expected:
            return m
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(
                f"{ended}/{expected} compactions after {timeout_s:.0f} s; server log tail:\n"
                + server.log_tail()
            )
        time.sleep(0.5)
