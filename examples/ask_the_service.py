"""Send one document to a running compaction service and get its compacted KV cache back.

    compactor serve --model smollm2-135m --port 50051 &
    python examples/ask_the_service.py 127.0.0.1:50051

The service prefills the document, fits the compacted entries (here: 10% kept per layer
and KV head) and streams them back checksummed; asking again is answered from its cache.
"""

import sys

from transformers import AutoTokenizer

from compactor import CompactionSpec, fingerprint
from compactor.client import CompactorClient
from compactor.models import prepare_model

endpoint = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"
model_dir = prepare_model("smollm2-135m")  # the tokenizer and the fingerprint of its weights
tok = AutoTokenizer.from_pretrained(str(model_dir))
document = " ".join(f"Day {i}: the boats left at dawn and came back at dusk." for i in range(40))
ids = tok(f"<|im_start|>user\n{document}")["input_ids"]

with CompactorClient(endpoint) as client:
    print(f"service at {endpoint} serves {client.model_info().name or 'a model'}")
    for attempt in ("first", "again"):
        result = client.compact_prefix(ids, fingerprint(model_dir), CompactionSpec(ratio=0.1),
                                timeout=600)  # fmt: skip
        p = result.prefix
        print(f"{attempt}: {p.logical_length} tokens -> {p.kept_tokens()} KV entries "
              f"({p.kept_fraction():.0%}), {p.nbytes() / 2**20:.2f} MiB, method {p.method}, "
              f"{result.seconds:.1f} s, from the cache: {result.cache_hit}")  # fmt: skip
