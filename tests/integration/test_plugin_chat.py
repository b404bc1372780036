"""End to end on chat traffic: the documents are compacted, the shared system prompt alone is not.

A real CPU SGLang server with the plugin (serving `plumbing_model`; `inproc://`, the default
trigger rule: 3 different continuations) is driven with the `openai` client on
`/v1/chat/completions` (the model's chat template): a ~300-token system prompt in every request,
two short chats that share only it, then three ~550-token documents in the user turn under it,
three questions each (max_tokens 8; the compactor's own follow-up answers cut to 8 tokens to
keep it fast). Each document is compacted once, whole from the root (system turn + document, cut
`--compaction-boundary-margin` tokens before the questions' branch and down to a multiple of
`--compaction-align-tokens`); no compaction is ever asked for the system prompt alone; every
request is answered.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.launch import SGLangServer
from harness.workload import (
    QUICK_ANSWER_TOKENS,
    compaction_args,
    document,
    metric,
    questions,
    wait_for_compactions,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SYSTEM = " ".join(
    f"Rule {i}: answer questions about the harbour town archive briefly, quote the ledger "
    f"when you can, and say so when the ledger does not tell."
    for i in range(12)
)
DOCS = 3
MARGIN = 32  # --compaction-boundary-margin (default)
ALIGN = 64  # --compaction-align-tokens (default)


def _user(doc: str, question: str) -> str:
    return f"{doc}\n\nQuestion: {question}"


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_chat_documents_are_compacted_not_the_system_prompt(
    plumbing_model: Path, tmp_path: Path
) -> None:
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(plumbing_model)

    def ids(user: str) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    system_len = _common(ids("Hello"), ids("What can you do?"))  # system turn + user header
    assert 200 <= system_len <= 400, system_len
    docs = [document(32, index=i) for i in range(DOCS)]
    asked = questions()[:3]
    # the questions' branch point: system turn + user header + document + "\n\nQuestion:"
    branch = [_common(ids(_user(d, asked[0])), ids(_user(d, asked[1]))) for d in docs]
    assert all(b - system_len > 450 for b in branch), (system_len, branch)

    args = [
        *compaction_args("inproc://", 0.1, min_hits=2, min_prefix_tokens=256, timeout_s=300,
                        answer_tokens=QUICK_ANSWER_TOKENS),
        "--compaction-min-continuations", "3",  # the default rule (compaction_args sets 2)
        "--compaction-max-in-flight", "3",
        "--enable-metrics",
    ]  # fmt: skip
    with SGLangServer(
        plumbing_model, log_path=tmp_path / "server.log", max_total_tokens=8192, extra_args=args
    ) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=300)
        model = client.models.list().data[0].id

        def chat(user: str) -> str:
            out = client.chat.completions.create(
                model=model,
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": user},
                ],
                max_tokens=8,
                temperature=0.0,
            )
            assert out.usage is not None and out.usage.completion_tokens >= 1, out
            content = out.choices[0].message.content
            assert isinstance(content, str), out
            return content

        answers = [chat("Hello, who are you?"), chat("What can you do for me?")]
        assert metric(srv, "sglang:compaction_requested_total") == 0  # two chats: not enough
        answers += [chat(_user(d, q)) for d in docs for q in asked]
        m = wait_for_compactions(srv, DOCS, timeout_s=300)
        requested = metric(srv, "sglang:compaction_requested_total")
        log = Path(srv.log_path).read_text(errors="replace")
    assert len(answers) == 2 + DOCS * len(asked)
    asked_T = [int(t) for t in re.findall(r"compaction requested T=(\d+)", log)]
    installed_T = [int(t) for t in re.findall(r"installed compacted prefix .*? T=(\d+)", log)]
    print(
        f"\nsystem turn {system_len} tokens, branch points {branch}; requested T={asked_T}, "
        f"installed T={installed_T}; logical {m['logical_tokens']:.0f}, "
        f"physical {m['physical_tokens']:.0f}"
    )
    assert requested == DOCS and m["installed_total"] == DOCS and m["fallbacks_total"] == 0, log
    # never the system prompt alone: every compaction covers the system turn and a document
    assert all(t > system_len for t in asked_T), (asked_T, system_len)
    # one per document, cut the boundary margin before its questions' branch, then down to a
    # multiple of the alignment (tokenizing the template here may differ from the server's
    # by a token at a seam)
    assert sorted(installed_T) == sorted(asked_T)
    for t, b in zip(sorted(asked_T), sorted(branch)):
        assert t % ALIGN == 0 and b - MARGIN - ALIGN - 2 < t <= b - MARGIN + 2, (asked_T, branch)
