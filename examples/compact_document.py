"""Compact one document's KV cache 10x and answer a question from it, in plain transformers.

    python examples/compact_document.py

Uses the embedded SmolLM2-135M (prepared once, cached locally) on the CPU.
"""

import torch

from compactor.hf import load_model, prefill
from compactor.hf.decode import PrefixState
from compactor.hf.generate import greedy_generate
from compactor.models import prepare_model
from compactor.pipeline import Hooks, compact_prefix
from compactor.spec import CompactionSpec

torch.set_num_threads(1)
model, tok = load_model(prepare_model("smollm2-135m"))

facts = ["The harbour master is called Henrik.", "The lighthouse is painted yellow."]
filler = [
    f"Day {i}: the boats left at dawn and came back before the evening tide." for i in range(30)
]
document = " ".join(filler[:10] + facts[:1] + filler[10:20] + facts[1:] + filler[20:])
# the shared prefix is the user's turn up to the document's end; each question follows it
prefix = f"<|im_start|>user\n{document}"
question = "\nWhat colour is the lighthouse painted?<|im_end|>\n<|im_start|>assistant\n"
doc_ids = tok(prefix)["input_ids"]
q_ids = tok(question, add_special_tokens=False)["input_ids"]
end = tok.convert_tokens_to_ids("<|im_end|>")

# 1. compact the document: keep 10% of its KV entries per layer and head (the default method)
spec = CompactionSpec(ratio=0.1)
compacted, _ = compact_prefix(model, tok, doc_ids, spec, hooks=Hooks(progress=False))
print(
    f"document: {len(doc_ids)} tokens, {compacted.kept_tokens()} KV entries kept "
    f"({compacted.kept_fraction():.0%} of the full cache), method {compacted.method}"
)

# 2. answer from the full cache and from the compacted one
for name, state in (
    ("full", PrefixState.full(prefill(model, doc_ids))),
    ("compacted", PrefixState.from_compacted(compacted)),
):
    answer = greedy_generate(model, state, q_ids, max_new_tokens=12, eos_ids=[end])
    print(f"{name:>9}: {tok.decode(answer, skip_special_tokens=True).strip()!r}")
