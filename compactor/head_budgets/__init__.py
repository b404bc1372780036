"""Budgets that differ per (layer, KV head):

- `curves`: sensitivity curves (error vs kept fraction per head), measured on a layer and kept
  as JSON beside the model (`compactor.eval.sensitivity` measures a whole model's);
- `uniform`: the same budget for every head;
- `allocate`: the greedy allocation that moves budget between heads at a fixed total along
  the curves.
"""
