"""What the inference roles compute over a rollout: per-token log-probs (policy, reference),
per-token values (value), sequence scores (reward model) and every position's score (a process
reward model). Each result is assembled on the last
pipeline stage and handed to every stage, so every rank holds the whole rollout.

Layout: ``tokens`` [B, S] is prompt then response, right-padded; per-token results are [B, S-1]
over action positions (models/batches.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rlhf.models.batches import micro_batches_of, state_values, ungrouped
from megatron_rlhf.models.decoder import groups_of
from megatron_rlhf.models.pipeline import Reduce, broadcast_from_last_stage
from megatron_rlhf.models.routing import ROUTES
from megatron_rlhf.models.vocab_parallel import next_token_log_probs, reads_chunked
from megatron_rlhf.roles.base import Role


def _rows(role: Role, tokens: torch.Tensor, lengths: torch.Tensor, reduce: Reduce, tail: tuple,
          routes_out: Optional[list] = None, **columns) -> torch.Tensor:
    """``reduce`` over micro-batches grouped by length, each trimmed to its longest row; the
    results back in row order, zero at the trimmed positions. With ``routes_out`` (a list), the
    routing of every row on this stage is appended to it: [B, S, L, K], -1 at the trimmed positions."""
    micro_batches, order = micro_batches_of(role.config, lengths, groups_of(role.model).pp.size() > 1, tokens=tokens,
                                            **columns)
    recorded = [] if routes_out is not None else None
    outputs = role.forward(micro_batches, reduce, routes_out=recorded)
    if recorded is not None:
        routes_out.append(ungrouped(recorded, order, tokens.shape[1], fill=-1))
    local = ungrouped([o.float() for o in outputs], order, tail[0] if tail else 0) if outputs else None
    return broadcast_from_last_stage(local, (tokens.shape[0], *tail), torch.float32, tokens.device, groups_of(role.model).pp)


def log_probs(role: Role, tokens: torch.Tensor, lengths: torch.Tensor, vocab_size: int, temperature: float = 1.0,
              routes: Optional[torch.Tensor] = None, routes_out: Optional[list] = None) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for an LM-head role: [B, S] -> [B, S-1] (``lengths`` [B]:
    real tokens per row; 0 beyond). Routing replay (models/routing.py): ``routes`` [B, S, L, K]
    is replayed; with ``routes_out`` (a list) this pass's routing is appended to it."""

    tp_group = groups_of(role.model).tp

    @reads_chunked
    def reduce(output, mb):
        return next_token_log_probs(output, mb, vocab_size, temperature, tp_group)

    columns = {} if routes is None else {ROUTES: routes}
    return _rows(role, tokens, lengths, reduce, (tokens.shape[1] - 1,), routes_out, **columns)


def values(role: Role, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Value of each state t (before token t+1) from a scalar-head role: [B, S] -> [B, S-1]."""

    def reduce(output, mb):
        return state_values(output, mb)

    return _rows(role, tokens, lengths, reduce, (tokens.shape[1] - 1,))


def scores(role: Role, tokens: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
    """A reward model's score of each sequence: its scalar output at ``last_index`` [B] (the
    last response token). [B, S] -> [B]."""

    def reduce(output, mb):
        return output.float().squeeze(-1).gather(1, mb["last_index"].unsqueeze(1)).squeeze(1)

    return _rows(role, tokens, last_index + 1, reduce, (), last_index=last_index)


def token_scores(role: Role, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A scalar-head role's output at every position (a process reward model's step scores are read at
    its steps' last tokens): [B, S] -> [B, S] (0 beyond ``lengths``)."""

    def reduce(output, mb):
        return output.float().squeeze(-1)

    return _rows(role, tokens, lengths, reduce, (tokens.shape[1],))
