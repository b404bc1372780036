"""The shared-document workload of the plugin's server tests and README (one document, 6 questions)."""

from __future__ import annotations

from typing import Any

from sglang_ext.launch import SGLangServer

_FILLER = [
    "The harbour town kept its records in a blue ledger.",
    "Fishing boats left before dawn and returned at noon.",
    "The old lighthouse was painted white with a red stripe.",
    "Merchants sold salt, rope, lanterns and dried fish on the quay.",
    "Every winter the storms closed the northern road for weeks.",
]
NEEDLES = {
    "What is the secret password of the vault?": ("The secret password of the vault is", "falcon"),
    "Who is the mayor of the town?": ("The mayor of the town is", "Margaret"),
    "Which colour is the mayor's boat?": ("The mayor's boat is painted", "green"),
}
OTHER_QUESTIONS = [
    "How do the fishing boats spend the day?",
    "When is the northern road closed?",
    "Where did merchants sell their goods?",
]


def document(sentences: int = 110) -> str:
    """About 1.3k tokens of filler with the three needles spread through it."""
    facts = [
        "The secret password of the vault is falcon.",
        "The mayor of the town is Margaret.",
        "The mayor's boat is painted green.",
    ]
    out = []
    for i in range(sentences):
        if i in (20, 55, 90):
            out.append(facts[(20, 55, 90).index(i)])
        out.append(f"Day {i}: " + _FILLER[i % len(_FILLER)])
    return " ".join(out)


def questions() -> list[str]:
    return [*NEEDLES, *OTHER_QUESTIONS]


def prompt(doc: str, question: str) -> str:
    return f"{doc}\nQuestion: {question}\nAnswer:"


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


def needle_correct(question: str, text: str) -> bool | None:
    """Whether an answer names the needle (None for non-needle questions)."""
    if question not in NEEDLES:
        return None
    return NEEDLES[question][1].lower() in text.lower()


def metric(server: SGLangServer, name: str) -> float:
    """Sum of a Prometheus series on /metrics (0 when absent)."""
    import urllib.request

    text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
