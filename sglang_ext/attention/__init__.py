"""The plugin's biased attention paths (no SGLang, no Triton imported by this package):

- `rows`: CPU, torch SDPA per request over its compacted prefix's entries + its own tail;
- `sdpa`: the one-request biased SDPA `rows` calls, and the reference the Triton paths test against;
- `paged`: Triton over SGLang's paged pool (plan / run per batch, causal tails);
- `cascade`: CUDA, each compacted prefix once per group of requests, ragged per KV head,
  merged with every tail by LSE; prefix plans kept across decode steps (`PrefixPlans`).
"""
