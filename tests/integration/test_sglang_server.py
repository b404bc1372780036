"""The real SGLang server on CPU with the prepared model and our plugin installed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.launch import SGLangServer
from sglang_ext import ANNOUNCEMENT

pytestmark = pytest.mark.sglang

DOC = " ".join(
    f"Section {i}: the lighthouse keeper logged {i * 7} ships and {i * 3} storms."
    for i in range(40)
)


@pytest.fixture(scope="module")
def server(
    prepared_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    log = tmp_path_factory.mktemp("sglang") / "server.log"
    with SGLangServer(prepared_model, log_path=log, max_total_tokens=4096) as srv:
        yield srv


def test_generate_answers(server: SGLangServer) -> None:
    out = server.generate("The capital of France is", max_new_tokens=8)
    assert "paris" in out["text"].lower()
    assert out["meta_info"]["completion_tokens"] > 0


def test_shared_prefix_is_served_from_the_radix_cache(server: SGLangServer) -> None:
    first = server.generate(DOC + "\nQuestion: how many ships in section 3?\nAnswer:")
    second = server.generate(DOC + "\nQuestion: how many storms in section 5?\nAnswer:")
    prompt_tokens = second["meta_info"]["prompt_tokens"]
    cached = second["meta_info"]["cached_tokens"]
    assert first["meta_info"]["prompt_tokens"] > 400
    # the whole shared document is reused, the differing question is not
    assert prompt_tokens - 20 < cached < prompt_tokens, (cached, prompt_tokens)


def test_plugin_is_loaded_by_sglang(server: SGLangServer) -> None:
    log = Path(server.log_path).read_text(errors="replace")
    assert "Failed to load plugin compaction" not in log
    assert "Failed to execute general plugin: compaction" not in log
    assert ANNOUNCEMENT in log
