"""Per-token statistics of vocab-parallel logits [b, s, V/TP] without gathering the vocabulary.

The output layer is padded beyond the tokenizer's vocabulary (for TP divisibility); those rows are
never sampled, so they are excluded here too, and the log-probs PPO uses are those of the
distribution generation samples from. ``tp_group``: the model's TP group (models/decoder.groups_of;
default: the run's).

Chunked: a model built with ``logprob_chunk_tokens`` (a role's key) whose pass is read by a
function marked ``reads_chunked`` hands it ``ChunkedLogits`` in place of its logits: the LM head's
input and weight. The log-probs and entropy are then computed ``chunk_tokens`` tokens at a time, the
backward recomputing each chunk's logits, so no more than one chunk's fp32 [tokens, V/TP] logits is
ever held (verl's, NeMo-RL's and Megatron-LM's long-context runs fail on exactly those logits).
The numbers are those of the whole logits (megatron's cross entropy on each chunk's rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional, Tuple

import torch

from megatron_rlhf.models import batch_invariant
from megatron_rlhf.models.batches import at_actions, next_tokens


def _tp(tp_group):
    from megatron.core import parallel_state as ps

    return tp_group or ps.get_tensor_model_parallel_group()


def _real_vocab_logits(logits: torch.Tensor, vocab_size: int, temperature: float, tp_group,
                       own: bool = False) -> torch.Tensor:
    """The logits over the real vocabulary, fp32, divided by the temperature (``own``: the caller's
    own fp32 logits may be changed in place rather than copied)."""
    logits = logits.float()
    logits = logits.div_(temperature) if own else logits / temperature
    per_rank = logits.shape[-1]
    first = tp_group.rank() * per_rank
    if first + per_rank <= vocab_size:
        return logits
    padded = torch.arange(first, first + per_rank, device=logits.device) >= vocab_size
    # Finite, so that p * log p stays 0 (not NaN) for the excluded rows.
    return logits.masked_fill_(padded, -1e30) if own else logits.masked_fill(padded, -1e30)


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


def next_token_log_probs(logits: torch.Tensor, mb, vocab_size: int, temperature: float = 1.0,
                         tp_group=None) -> torch.Tensor:
    """log p(token t+1 | tokens <= t): logits [b, s, V/TP] (or ChunkedLogits) of micro-batch ``mb``
    (its tokens [b, s]) -> [b, s-1] (models/batches.py's convention)."""
    if isinstance(logits, ChunkedLogits):
        return at_actions(logits.statistics(next_tokens(mb), vocab_size, temperature, tp_group, entropy=False)[0], mb)
    return at_actions(token_log_probs(logits, next_tokens(mb), vocab_size, temperature, tp_group), mb)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, vocab_size: int, temperature: float = 1.0, tp_group=None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the real vocabulary at each position: [b, s]."""
    group = _tp(tp_group)
    return _entropy_of_real(_real_vocab_logits(logits, vocab_size, temperature, group), group)


@torch.no_grad()
def _entropy_of_real(logits: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    top = logits.max(dim=-1, keepdim=True).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top
    exp = shifted.exp()
    sums = torch.stack([exp.sum(-1), exp.mul_(shifted).sum(-1)])
    dist.all_reduce(sums, group=group)
    # H = log Z - E[shifted], with Z = sum exp(shifted).
    return sums[0].log() - sums[1] / sums[0]


def log_probs_and_entropy(output, mb, vocab_size: int, temperature: float = 1.0,
                          tp_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """next_token_log_probs (with its gradient) and the entropy at each action position (without),
    [b, s-1] each, in one pass over the chunks of ``ChunkedLogits``."""
    if isinstance(output, ChunkedLogits):
        log_probs, entropy = output.statistics(next_tokens(mb), vocab_size, temperature, tp_group, entropy=True)
        return at_actions(log_probs, mb), at_actions(entropy, mb)
    return (next_token_log_probs(output, mb, vocab_size, temperature, tp_group),
            at_actions(token_entropy(output.detach(), vocab_size, temperature, tp_group), mb))


# -- chunked ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class ChunkedLogits:
    """What stands for a pass's logits when they are computed in chunks: the LM head's input
    ``hidden`` [b, s, h] (mapped for TP as the head maps it) and ``weight`` [V/TP, h]."""

    hidden: torch.Tensor
    weight: torch.Tensor
    chunk_tokens: int

    def statistics(self, labels: torch.Tensor, vocab_size: int, temperature: float, tp_group,
                   entropy: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """log p(labels) [b, s] (differentiable in hidden and weight) and, when asked, the entropy
        [b, s] (not differentiable; zeros otherwise)."""
        b, s, h = self.hidden.shape
        log_probs, entropies = _ChunkedLogProbs.apply(self.hidden.reshape(b * s, h), self.weight, labels.reshape(-1),
                                                      _ChunkedHead(vocab_size, temperature, _tp(tp_group),
                                                                   self.chunk_tokens, entropy))
        return log_probs.view(b, s), entropies.view(b, s)


def reads_chunked(fn: Callable) -> Callable:
    """Marks a loss or reduce function that reads its output through this module's functions
    (which take ChunkedLogits): its passes may hand it the LM head's input instead of the logits."""
    fn.reads_chunked = True
    return fn


@contextlib.contextmanager
def chunked_lm_head(model: torch.nn.Module, reader: Optional[Callable]):
    """Within the block, ``model``'s pass (a GPTModel with an LM head on this pipeline stage,
    built with ``logprob_chunk_tokens``) returns the head's input; yields a function that makes the
    pass's output ChunkedLogits. Yields None where the logits stay whole: no LM head here, chunking
    off (always in the batch-invariant mode, whose head has its own product:
    RLHFConfig.logprob_chunk_tokens), or a ``reader`` not marked reads_chunked."""
    from megatron_rlhf.models.decoder import unwrap
    from megatron_rlhf.runtime.megatron_compat import column_input_kept

    gpt = unwrap(model)
    chunk = getattr(gpt, "logprob_chunk_tokens", 0)
    if not chunk or not getattr(reader, "reads_chunked", False):
        yield None
        return
    weights: list = []
    with column_input_kept(gpt.output_layer, weights):
        yield lambda hidden: ChunkedLogits(hidden, weights.pop(), chunk)


@dataclasses.dataclass(frozen=True)
class _ChunkedHead:
    vocab_size: int
    temperature: float
    tp_group: object
    chunk_tokens: int
    entropy: bool

    def chunks(self, n: int):
        return (slice(start, min(start + self.chunk_tokens, n)) for start in range(0, n, self.chunk_tokens))

    def real_logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A chunk's logits over the real vocabulary (fp32, divided by the temperature), as the head
        computes them (megatron's local product, in the weight's dtype)."""
        return _real_vocab_logits(torch.matmul(hidden.to(weight.dtype), weight.t()), self.vocab_size,
                                  self.temperature, self.tp_group, own=True)

    def vocab_range(self, logits: torch.Tensor) -> Tuple[int, int]:
        from megatron.core.tensor_parallel.utils import VocabUtility

        return VocabUtility.vocab_range_from_per_partition_vocab_size(logits.shape[-1], self.tp_group.rank(),
                                                                      self.tp_group.size())


class _ChunkedLogProbs(torch.autograd.Function):
    """hidden [N, h], weight [V/TP, h], labels [N] -> (log-probs [N], entropy [N]), by megatron's
    vocab-parallel cross entropy (its own steps, VocabParallelCrossEntropy) on each chunk's logits.
    Keeps its inputs and each row's logit maximum and sum of exponentials; the backward recomputes a
    chunk's logits, makes them its softmax with those, and takes megatron's gradient of it."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, head: _ChunkedHead):
        import torch.distributed as dist
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as CE

        n = hidden.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        maxima, sums = torch.empty_like(log_probs), torch.empty_like(log_probs)
        for rows in head.chunks(n):
            real = head.real_logits(hidden[rows], weight)
            if head.entropy:
                entropy[rows] = _entropy_of_real(real, head.tp_group)
            real, maximum = CE.calculate_logits_max(real)
            dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=head.tp_group)
            _, _, predicted, sum_exp, _ = CE.calculate_predicted_logits(real, labels[rows], maximum,
                                                                        *head.vocab_range(real))
            dist.all_reduce(predicted, group=head.tp_group)
            dist.all_reduce(sum_exp, group=head.tp_group)
            log_probs[rows] = predicted - torch.log(sum_exp)  # minus megatron's loss, log(sum) - predicted
            maxima[rows], sums[rows] = maximum, sum_exp
        ctx.save_for_backward(hidden, weight, labels, maxima, sums)
        ctx.head = head
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy):
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as CE

        hidden, weight, labels, maxima, sums = ctx.saved_tensors
        head = ctx.head
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # summed over the chunks in fp32 whatever the weight's dtype (the whole product's sum is one GEMM's)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for rows in head.chunks(hidden.shape[0]):
            softmax = head.real_logits(hidden[rows], weight)
            softmax.sub_(maxima[rows].unsqueeze(-1)).exp_().div_(sums[rows].unsqueeze(-1))
            start, end = head.vocab_range(softmax)
            target_mask = (labels[rows] < start) | (labels[rows] >= end)
            masked_target = (labels[rows] - start).masked_fill(target_mask, 0)
            grad_2d, arange, update, grad = CE.prepare_gradient_calculation_operands(softmax, target_mask)
            grad = CE.calculate_gradients(grad_2d, arange, masked_target, update, grad, -grad_log_probs[rows])
            grad = grad.div_(head.temperature).to(weight.dtype)  # the head's product's gradient, in its dtype
            chunk = hidden[rows].to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = torch.matmul(grad, weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += torch.matmul(grad.t(), chunk)
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None
