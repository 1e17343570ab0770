"""Per-token statistics of vocab-parallel logits [b, s, V/TP] without gathering the vocabulary.

The output layer is padded beyond the tokenizer's vocabulary (for TP divisibility); those rows are
never sampled, so they are excluded here too, and the log-probs PPO uses are those of the
distribution generation samples from. ``tp_group``: the model's TP group (models/decoder.groups_of;
default: the run's).
"""

from __future__ import annotations

import torch

from megatron_rlhf.models import batch_invariant
from megatron_rlhf.models.batches import at_actions, next_tokens


def _tp(tp_group):
    from megatron.core import parallel_state as ps

    return tp_group or ps.get_tensor_model_parallel_group()


def _real_vocab_logits(logits: torch.Tensor, vocab_size: int, temperature: float, tp_group) -> torch.Tensor:
    logits = logits.float() / temperature
    per_rank = logits.shape[-1]
    first = tp_group.rank() * per_rank
    if first + per_rank <= vocab_size:
        return logits
    padded = torch.arange(first, first + per_rank, device=logits.device) >= vocab_size
    # Finite, so that p * log p stays 0 (not NaN) for the excluded rows.
    return logits.masked_fill(padded, -1e30)


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                    tp_group=None) -> torch.Tensor:
    """log p(labels) under softmax(logits / temperature) over the real vocabulary: [b, s]."""
    from megatron_rlhf.runtime.megatron_compat import vocab_parallel_cross_entropy

    tp_group = _tp(tp_group)
    real = _real_vocab_logits(logits, vocab_size, temperature, tp_group)
    if batch_invariant.enabled():  # one reduction per row, the engine's and the trainer's alike
        if tp_group.size() > 1:
            raise ValueError("batch-invariant log-probs over vocabulary shards (TP > 1) are not modelled")
        return batch_invariant.log_softmax_at(real, labels)
    return -vocab_parallel_cross_entropy(real, labels, tp_group)


def next_token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                         tp_group=None) -> torch.Tensor:
    """log p(token t+1 | tokens <= t): logits [b, s, V/TP], tokens [b, s] -> [b, s-1]."""
    return at_actions(token_log_probs(logits, next_tokens(tokens), vocab_size, temperature, tp_group))


@torch.no_grad()
def token_entropy(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0, tp_group=None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the real vocabulary at each position: [b, s]."""
    import torch.distributed as dist

    group = _tp(tp_group)
    logits = _real_vocab_logits(logits, vocab_size, temperature, group)
    top = logits.max(dim=-1, keepdim=True).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), (exp * shifted).sum(-1)])
    dist.all_reduce(sums, group=group)
    # H = log Z - E[shifted], with Z = sum exp(shifted).
    return sums[0].log() - sums[1] / sums[0]
