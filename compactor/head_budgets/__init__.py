"""Budgets that differ per (layer, KV head), measured offline:

- `curves`: sensitivity curves (error vs kept fraction per head) and the greedy allocation
  that moves budget between heads at a fixed total;
- `sensitivity`: measuring a model's curves (`compactor sensitivity`);
- `compresskv_calibration`: CompressKV's offline calibration (Semantic-Retrieval-Head scores
  and per-layer errors, `compactor calibrate`).
"""
