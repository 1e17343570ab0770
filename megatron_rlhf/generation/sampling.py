"""Choosing the next token from logits: greedy, temperature, top-k, top-p. Pure tensor code."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    eos_id: Optional[int] = None  # a row ends after it emits this token
    pad_id: int = 0  # fills each row after its end

    @classmethod
    def from_config(cls, generation, eos_id: Optional[int], pad_id: int) -> "SamplingParams":
        return cls(
            max_new_tokens=generation.max_new_tokens,
            greedy=generation.greedy,
            temperature=generation.temperature,
            top_k=generation.top_k,
            top_p=generation.top_p,
            eos_id=eos_id,
            pad_id=pad_id,
        )


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[B, V] logits with everything outside the top-k, then outside the smallest set whose
    probability reaches top_p, set to -inf. The most likely token always survives."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token per row: [B, V] -> [B] (int64)."""
    if params.greedy:
        return logits.argmax(dim=-1)
    filtered = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
