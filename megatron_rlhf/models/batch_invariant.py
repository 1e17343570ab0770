"""Batch-invariant arithmetic (``trainer.batch_invariant``): a token's result computed in an order
fixed per token, whatever shares its call (how many rows, which slot, prefill, decode or the
training forward), so that the engine's behaviour log-prob of a sampled token is, bit for bit, the
log-prob the trainer computes for it at the same weights.

Where a plain forward's numbers depend on the company (measured: bench/batch_invariance.py), and
what takes its place while the mode is on:

- Linear layers: a GEMM library picks its kernel by the number of rows (MKL's fp32 kernel for one
  row is not its kernel for several; oneDNN's takes another for one row at k=4096). Here every
  column- and row-parallel linear (and the scalar head) multiplies at least ``ROW_BLOCK`` rows (fewer
  padded with zeros) with oneDNN's GEMM on the packed weight on CPU, for the engine and the trainer
  alike, in one call where that GEMM computes a row alike at every such count (probed once per
  shape, :func:`_rows_alike`), else in blocks of exactly ``ROW_BLOCK`` rows, each the same product.
- Attention: the engine reads a slot's cache over a bucketed extent, the trainer a causal [s, s]
  pass; their reductions run over different lengths and kernels. Here every query reads one
  fixed-length block of keys (the run's sequence length rounded up to 64; past its position,
  masked), or for runs longer than MAX_KEY_BLOCK, the blocks up to its position combined in order
  with a running max and sum (as flash attention does), in fp32, its products one per query and key
  group at one shape: how far the other queries of the call reach only adds blocks that are exact
  no-ops for it.
- The vocabulary's log-softmax: torch's ``log_softmax`` (the engine) and megatron's vocab-parallel
  cross entropy (the trainer) are different formulas. Here both take vocab_parallel.token_log_probs,
  which takes :func:`log_softmax_at` over the padded vocabulary with the padding masked alike.

Norms, rotary factors, activations, residual adds and the embedding are per token already.
Invariance holds at TP=1 (the config refuses more: the engine's gathered logits and the trainer's
vocabulary shards would sum the softmax in different orders), for dense models with fused attention,
on CPU (tests/test_batch_invariant.py; CUDA's kernels are not yet shown invariant and are refused).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

ROW_BLOCK = 16  # the fewest rows per product (a block's rows where products go block by block)
KEY_ALIGN = 64  # a key block is a multiple of this many keys
MAX_KEY_BLOCK = 1024  # longer runs read their keys in several blocks

_key_block: Optional[int] = None  # keys per block while the mode is on; None: off
_one_block = True  # whether every row of the run fits in one block (then a plain softmax over it)


def enabled() -> bool:
    """Whether this process computes in batch-invariant arithmetic."""
    return _key_block is not None


def switch_on(sequence_length: int) -> None:
    """The mode on in this process for rows of up to ``sequence_length`` tokens (the run's): a key
    block of that many keys rounded up to KEY_ALIGN (at most MAX_KEY_BLOCK). Set before any model
    is built (its linears are installed then)."""
    global _key_block, _one_block
    if sequence_length < 1:
        raise ValueError(f"the sequence length must be >= 1, got {sequence_length}")
    whole = -(-sequence_length // KEY_ALIGN) * KEY_ALIGN
    _key_block, _one_block = min(whole, MAX_KEY_BLOCK), whole <= MAX_KEY_BLOCK


def switch_off() -> None:
    global _key_block, _one_block
    _key_block, _one_block = None, True


@contextlib.contextmanager
def batch_invariant(sequence_length: int) -> Iterator[None]:
    """The mode on within the block (tests, benches); the run uses switch_on at start-up."""
    global _key_block, _one_block
    before = (_key_block, _one_block)
    switch_on(sequence_length)
    try:
        yield
    finally:
        _key_block, _one_block = before


def row_blocked_linear(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """input [..., k] x weight [n, k]^T (+ bias [n]) -> [..., n], a row's result never depending on
    the rows beside it. On CPU with oneDNN, its GEMM on the weight packed into its blocked layout (the
    engine's fast kernel, runtime/cpu_linears.py; packed once per engine call, fixed_weights, or per
    call in training) over at least ROW_BLOCK rows (_packed_products); elsewhere one batched product
    of identical blocks of ROW_BLOCK rows (the last padded with zeros). Differentiable: the backward
    is plain matmuls (only the forward needs to be invariant)."""
    if _onednn_for(input, weight):
        if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad):
            return _PackedRowBlocks.apply(input, weight, bias)
        return _packed_products(input, weight, bias)
    return _blocked_products(input, lambda blocks: torch.bmm(blocks, weight.t().expand(blocks.shape[0], -1, -1)),
                             weight.shape[0], bias)


def _blocked_products(input: torch.Tensor, product, width: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``product`` of [blocks, ROW_BLOCK, k] -> [blocks, ROW_BLOCK, width] over input's rows."""
    rows = input.reshape(-1, input.shape[-1])
    count = rows.shape[0]
    pad = -count % ROW_BLOCK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = product(rows.view(-1, ROW_BLOCK, rows.shape[1])).reshape(-1, width)[:count]
    out = out.reshape(*input.shape[:-1], width)
    return out if bias is None else out + bias


def _onednn_for(input: torch.Tensor, weight: torch.Tensor) -> bool:
    from megatron_rlhf.runtime.cpu_linears import packs

    return weight.device.type == "cpu" and input.dtype == weight.dtype and packs(weight.dtype)


_packed = None  # cpu_linears.PackedWeights within fixed_weights: each weight packed once


@contextlib.contextmanager
def fixed_weights() -> Iterator[None]:
    """Within the block no weight changes (an engine call): each is packed for oneDNN once."""
    from megatron_rlhf.runtime.cpu_linears import PackedWeights

    global _packed
    outer = _packed
    _packed = PackedWeights() if outer is None else outer
    try:
        yield
    finally:
        _packed = outer


def _packed_products(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    from megatron_rlhf.runtime.cpu_linears import pack, packed_product

    packed = pack(weight) if _packed is None else _packed.packed(weight)  # training: the weights change between calls
    if not _rows_alike(weight.shape[1], weight.shape[0], weight.dtype):
        return _blocked_products(input, lambda blocks: torch.stack([packed_product(b, packed) for b in blocks]),
                                 weight.shape[0], bias)
    rows = input.reshape(-1, input.shape[-1])
    count = rows.shape[0]
    if count < ROW_BLOCK:  # a single row (and a few) may take another kernel: never fewer than a block
        rows = torch.cat([rows, rows.new_zeros(ROW_BLOCK - count, rows.shape[1])])
    out = packed_product(rows, packed)[:count].reshape(*input.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


_alike: Dict[Tuple[int, int, torch.dtype], bool] = {}  # (k, n, dtype) -> whether every row count of ROW_BLOCK or more computes a row alike
PROBED_ROWS = (ROW_BLOCK, ROW_BLOCK + 1, 4 * ROW_BLOCK, 16 * ROW_BLOCK + 1)


def _rows_alike(k: int, n: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN's GEMM on a packed [n, k] weight of ``dtype`` gives each row the same result in
    calls of every row count from ROW_BLOCK up (probed once per shape on random values at
    PROBED_ROWS; measured so on the CI's VM for every shape tried, up to 4,096 rows: one call then
    serves any number of rows; where it does not hold, the rows go in blocks of ROW_BLOCK, each the
    same product by construction)."""
    from megatron_rlhf.runtime.cpu_linears import pack, packed_product

    key = (k, n, dtype)
    if key not in _alike:
        generator = torch.Generator().manual_seed(0)
        packed = pack(torch.randn(n, k, generator=generator).to(dtype))
        rows = torch.randn(PROBED_ROWS[-1], k, generator=generator).to(dtype)
        whole = packed_product(rows, packed)
        _alike[key] = all(torch.equal(packed_product(rows[:m], packed), whole[:m]) for m in PROBED_ROWS[:-1])
    return _alike[key]


class _PackedRowBlocks(torch.autograd.Function):
    """oneDNN's GEMM on the packed weight (_packed_products); a plain backward."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        ctx.save_for_backward(input, weight)
        ctx.has_bias = bias is not None
        return _packed_products(input, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        rows, grads = input.reshape(-1, input.shape[-1]), grad.reshape(-1, grad.shape[-1])
        return grad.matmul(weight), grads.t().matmul(rows), grads.sum(0) if ctx.has_bias else None


def allowed_keys(positions: torch.Tensor, length: int, window: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """[N, length] True where a query at ``positions`` [N] may read the key at each position:
    causal, and within megatron's ``window`` (tokens before, tokens after) where one is set."""
    keys = torch.arange(length, device=positions.device).unsqueeze(0)
    at = positions.unsqueeze(1)
    allowed = keys <= at
    if window is not None:
        allowed &= (at - keys <= window[0]) & (keys - at <= window[1])
    return allowed


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_rows: Optional[torch.Tensor],
              positions: torch.Tensor, scale: float, window: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """Each query over the keys up to its position, in fp32. query [N, heads, dim]; keys/values
    [R, groups, S, dim] (positions 0..S-1 of each row of keys, S whole key blocks: whole_blocks);
    ``key_rows`` [N]: the row of keys each query reads (None: query i reads row i); ``positions``
    [N]: each query's position. -> [N, heads, dim] in the query's dtype.

    A query's arithmetic is its own: its products are batched one per (query, key group) at one
    shape, and its softmax runs over one whole key block (rows of the run fit in one), or over the
    blocks in order with a running max and sum, where the blocks past its position (computed when
    another query in the call reaches further) are exact no-ops (a weight of 0, a factor of 1).
    The queries that read one row of keys read it in place (a stride-0 batch), not copied."""
    if not enabled():
        raise RuntimeError("batch-invariant attention outside the mode (batch_invariant.switch_on)")
    if keys.shape[2] % _key_block:
        raise ValueError(f"{keys.shape[2]} keys per row: not whole blocks of {_key_block} (batch_invariant.whole_blocks)")
    if key_rows is None:
        n = query.shape[0]
        return _attend(query, keys[:n], values[:n], positions, scale, window)
    out = torch.empty_like(query)
    readers: Dict[int, List[int]] = {}
    for i, row in enumerate(key_rows.tolist()):
        readers.setdefault(row, []).append(i)
    for row, members in readers.items():
        picked = torch.tensor(members, device=query.device)
        k, v = (t[row : row + 1].expand(len(members), -1, -1, -1) for t in (keys, values))
        out[picked] = _attend(query[picked], k, v, positions[picked], scale, window)
    return out


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float,
            window: Optional[Tuple[int, int]]) -> torch.Tensor:
    """query [c, heads, dim] over keys/values [c, groups, S, dim] up to each query's position."""
    c, heads, dim = query.shape
    groups = keys.shape[1]
    q = query.float().view(c, groups, heads // groups, dim)
    reach = int(positions.max()) + 1
    if reach > keys.shape[2]:
        raise ValueError(f"a query at position {reach - 1} reads past the {keys.shape[2]} keys of its row")
    if _one_block:
        if reach > _key_block:
            raise ValueError(f"a query at position {reach - 1}: longer than the mode's rows ({_key_block} keys; "
                             "batch_invariant.switch_on takes the run's sequence length)")
        k, v = keys[:, :, :_key_block].float(), values[:, :, :_key_block].float()
        allowed = allowed_keys(positions, _key_block, window)[:, None, None, :]
        scores = (_products(q, k.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
        return _products(torch.softmax(scores, dim=-1), v).reshape(c, heads, dim).to(query.dtype)
    top = torch.full((c, groups, heads // groups, 1), float("-inf"), device=query.device)
    total = torch.zeros_like(top)
    acc = torch.zeros(c, groups, heads // groups, dim, device=query.device)
    for start in range(0, reach, _key_block):
        k, v = (t[:, :, start : start + _key_block].float() for t in (keys, values))
        allowed = allowed_keys(positions, start + _key_block, window)[:, None, None, start:]
        scores = (_products(q, k.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
        new_top = torch.maximum(top, scores.amax(-1, keepdim=True))
        finite = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)  # never -inf - -inf
        weights, kept = torch.exp(scores - finite), torch.exp(top - finite)
        total = total * kept + weights.sum(-1, keepdim=True)
        acc = acc * kept + _products(weights, v)
        top = new_top
    return (acc / total).reshape(c, heads, dim).to(query.dtype)


def whole_blocks(length: int) -> int:
    """``length`` keys rounded up to whole key blocks: what a row of keys holds in the mode (the
    engine's cache regions are made so; the trainer pads once per layer), so no block is cut."""
    return -(-length // _key_block) * _key_block


def _products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [c, groups, m, k] @ b [c, groups, k, n], one product of one shape per (row, group); where b
    is one row for every c (stride 0), a product per group reads it in place."""
    if b.stride(0) == 0:
        return torch.stack([torch.bmm(a[:, g], b[:, g]) for g in range(a.shape[1])], 1)
    return torch.matmul(a, b)


def log_softmax_at(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at ``tokens``: fp32 logits [..., V] (the whole vocabulary, already at the
    temperature and with the padding masked: vocab_parallel.token_log_probs), tokens [...] -> [...].
    The same formula as megatron's cross entropy (max, shifted exps and their sum), one reduction
    per row."""
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    return shifted.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - shifted.exp().sum(-1).log()


def install(model: torch.nn.Module) -> None:
    """``model``'s parallel linears multiply in row blocks for the model's life (the mode is set
    once per run, before any model is built)."""
    from megatron_rlhf.runtime import megatron_compat as compat

    compat.replace_linear_matmuls(model, row_blocked_linear)
