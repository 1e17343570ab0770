"""Choosing the next token from logits: greedy, temperature, top-k, top-p. Pure tensor code.

Sampling draws from per-row streams: the uniform behind a row's n-th token is a hash of (the
row's seed, n), so the random numbers a row draws do not depend on which rows share its batch, the
order rows are scheduled in, the decode batch size or the data-parallel layout (its logits, which
the kernels compute with the rows beside it, can differ in their last bits). The hash is integer
arithmetic that never overflows int64, so it is the same on every device.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    eos_ids: Tuple[int, ...] = ()  # a row ends after it emits one of these tokens
    pad_id: int = 0  # fills each row after its end

    @classmethod
    def from_config(cls, generation, eos_ids: Tuple[int, ...], pad_id: int) -> "SamplingParams":
        return cls(
            max_new_tokens=generation.max_new_tokens,
            greedy=generation.greedy,
            temperature=generation.temperature,
            top_k=generation.top_k,
            top_p=generation.top_p,
            eos_ids=() if generation.ignore_eos else tuple(eos_ids),
            pad_id=pad_id,
        )


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[B, V] logits with everything outside the top-k, then outside the smallest set whose
    probability reaches top_p, set to -inf. The most likely token always survives."""
    # masked_fill, not boolean indexing: the latter counts the mask's hits on the host (a sync,
    # which a CUDA graph cannot hold).
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


_LOW16, _LOW32 = 0xFFFF, 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 32-bit x and c, without leaving int64's range."""
    return ((x & _LOW16) * c + (((x >> 16) * c) & _LOW16) * 65536) & _LOW32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (C. Wellons' lowbias32) of int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_seeds(*keys) -> torch.Tensor:
    """One 32-bit seed per row from integer keys (ints or int64 tensors, broadcast together; each
    taken mod 2**32), hashed in order: stream_seeds(run_seed, iteration, prompt_index, sample)."""
    seed = torch.zeros((), dtype=torch.int64)
    for key in keys:
        key = torch.as_tensor(key, dtype=torch.int64)
        seed = _mix32(seed.to(key.device) * 31 + _mix32(key & _LOW32) & _LOW32)
    return seed


def stream_uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[N] uniforms in [0, 1) (float64, 53 bits): the ``counters[i]``-th draw of stream ``seeds[i]``."""
    high = _mix32(_mix32(seeds ^ _mix32(counters & _LOW32)) ^ 0x68E31DA4)
    low = _mix32(high ^ 0x1B56C4E9)
    return ((high >> 5) * 67108864 + (low >> 6)).double() / 9007199254740992.0


def chosen_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B] float32: log softmax(logits / temperature) at ``tokens`` [B] (logits [B, V]): the
    behaviour policy's log-probability of what it sampled, as training scores a token (the whole
    vocabulary at the temperature, before top-k/top-p; rollout correction compares the two)."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def sample_next(logits: torch.Tensor, params: SamplingParams, seeds: Optional[torch.Tensor] = None,
                counters: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Next token per row: [B, V] -> [B] (int64). Sampling (not greedy) takes row i's
    ``counters[i]``-th draw of stream ``seeds[i]`` (both [B] int64) and inverts the CDF of the
    filtered distribution there; a token of probability 0 is never chosen."""
    if params.greedy:
        return logits.argmax(dim=-1)
    if seeds is None or counters is None:
        raise ValueError("sampling needs a stream seed and a draw counter per row")
    filtered = filter_logits(logits.float() / params.temperature, params.top_k, params.top_p)
    cdf = torch.softmax(filtered, dim=-1).double().cumsum(dim=-1)
    target = stream_uniforms(seeds, counters).to(cdf.device).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
