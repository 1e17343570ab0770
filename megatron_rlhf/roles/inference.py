"""What the inference roles compute over a rollout: per-token log-probs (policy, reference),
per-token values (value) and sequence scores (reward model). Each result is assembled on the last
pipeline stage and handed to every stage, so every rank holds the whole rollout.

Layout: ``tokens`` [B, S] is prompt then response, right-padded; per-token results are [B, S-1]
over action positions (models/batches.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_rlhf.models.batches import MicroBatch, split_rows, state_values
from megatron_rlhf.models.pipeline import Reduce, broadcast_from_last_stage
from megatron_rlhf.models.vocab_parallel import next_token_log_probs
from megatron_rlhf.roles.base import Role


def _rows(role: Role, micro_batches: Sequence[MicroBatch], reduce: Reduce, tail: tuple) -> torch.Tensor:
    outputs = role.forward(list(micro_batches), reduce)
    rows = sum(mb["tokens"].shape[0] for mb in micro_batches)
    local = torch.cat(outputs).float() if outputs else None
    return broadcast_from_last_stage(local, (rows, *tail), torch.float32, micro_batches[0]["tokens"].device)


def log_probs(role: Role, tokens: torch.Tensor, vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for an LM-head role: [B, S] -> [B, S-1]."""

    def reduce(output, mb):
        return next_token_log_probs(output, mb["tokens"], vocab_size, temperature)

    return _rows(role, split_rows(role.config.micro_batch_size, tokens=tokens), reduce, (tokens.shape[1] - 1,))


def values(role: Role, tokens: torch.Tensor) -> torch.Tensor:
    """Value of each state t (before token t+1) from a scalar-head role: [B, S] -> [B, S-1]."""

    def reduce(output, mb):
        return state_values(output)

    return _rows(role, split_rows(role.config.micro_batch_size, tokens=tokens), reduce, (tokens.shape[1] - 1,))


def scores(role: Role, tokens: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """A reward model's score of each sequence: its scalar output at ``last_index`` [B] (the
    last response token). [B, S] -> [B]."""

    def reduce(output, mb):
        return output.float().squeeze(-1).gather(1, mb["last_index"].unsqueeze(1)).squeeze(1)

    mbs = split_rows(role.config.micro_batch_size, tokens=tokens, last_index=last_index)
    return _rows(role, mbs, reduce, ())
