"""What the inference roles compute over a rollout: per-token log-probs (policy, reference),
per-token values (value) and sequence scores (reward model). Each result is assembled on the last
pipeline stage and handed to every stage, so every rank holds the whole rollout.

Layout: ``tokens`` [B, S] is prompt then response, right-padded; per-token results are [B, S-1]
over action positions (models/batches.py).
"""

from __future__ import annotations

import torch

from megatron_rlhf.models.batches import length_grouped, state_values, ungrouped
from megatron_rlhf.models.pipeline import Reduce, broadcast_from_last_stage
from megatron_rlhf.models.vocab_parallel import next_token_log_probs
from megatron_rlhf.roles.base import Role


def _rows(role: Role, tokens: torch.Tensor, lengths: torch.Tensor, reduce: Reduce, tail: tuple, **columns) -> torch.Tensor:
    """``reduce`` over micro-batches grouped by length, each trimmed to its longest row; the
    results back in row order, zero at the trimmed positions."""
    micro_batches, order = length_grouped(role.config.micro_batch_size, lengths, tokens=tokens, **columns)
    outputs = role.forward(micro_batches, reduce)
    local = ungrouped([o.float() for o in outputs], order, tail[0] if tail else 0) if outputs else None
    return broadcast_from_last_stage(local, (tokens.shape[0], *tail), torch.float32, tokens.device)


def log_probs(role: Role, tokens: torch.Tensor, lengths: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for an LM-head role: [B, S] -> [B, S-1] (``lengths`` [B]:
    real tokens per row; 0 beyond)."""

    def reduce(output, mb):
        return next_token_log_probs(output, mb["tokens"], vocab_size, temperature)

    return _rows(role, tokens, lengths, reduce, (tokens.shape[1] - 1,))


def values(role: Role, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Value of each state t (before token t+1) from a scalar-head role: [B, S] -> [B, S-1]."""

    def reduce(output, mb):
        return state_values(output)

    return _rows(role, tokens, lengths, reduce, (tokens.shape[1] - 1,))


def scores(role: Role, tokens: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """A reward model's score of each sequence: its scalar output at ``last_index`` [B] (the
    last response token). [B, S] -> [B]."""

    def reduce(output, mb):
        return output.float().squeeze(-1).gather(1, mb["last_index"].unsqueeze(1)).squeeze(1)

    return _rows(role, tokens, last_index + 1, reduce, (), last_index=last_index)
