"""The prepared checkpoint loads in transformers and answers sensibly."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def _chat_answer(model_dir: Path, question: str, max_new_tokens: int = 24) -> str:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
    )
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def test_checkpoint_is_plain_fp32_llama(prepared_model: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(prepared_model, dtype=torch.float32)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.head_dim == 64 and getattr(cfg, "quantization_config", None) is None
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_generates_sensible_answers(prepared_model: Path) -> None:
    assert "paris" in _chat_answer(prepared_model, "What is the capital of France?").lower()
    answer = _chat_answer(prepared_model, "What is 2 + 3? Answer with the number.").lower()
    assert "5" in answer or "five" in answer
