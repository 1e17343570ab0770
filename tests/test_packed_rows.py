"""Packed rows (models/packed_rows.py): a micro-batch's rows laid end to end without their padding,
each attending within itself, back in rows for the losses. (Their passes against padded rows at
TP=2, PP=2, in a window and with experts: tests/test_context_parallel.py; a run through the entry:
tests/test_train.py.)"""

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.models import packed_rows
from megatron_rlhf.models.attention import window_band
from megatron_rlhf.models.batches import LABELS, PACKED, ROW_LENGTHS, at_actions, dealt_by_tokens, micro_batches_of, \
    packed_sizes


def _mb():
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 0, 0]])
    return {"tokens": tokens, ROW_LENGTHS: torch.tensor([5, 2, 3]), "action_mask": torch.ones(3, 4)}


def test_the_packed_row_holds_real_tokens_their_positions_next_tokens_and_the_way_back():
    view = packed_rows.packed(_mb())
    packed = view[PACKED]
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]]  # restarting per row
    assert packed.params.qkv_format == "thd" and packed.params.cu_seqlens_q.tolist() == [0, 5, 7, 10]
    assert packed.params.max_seqlen_q == 5
    # each token's next (a row's last reads the next row's first: it has no action)
    assert view[LABELS].tolist() == [[2, 3, 4, 5, 6, 7, 8, 9, 10, 1]]
    assert torch.equal(view["action_mask"], _mb()["action_mask"])  # the loss's columns stay rows
    per_token = torch.arange(10.0).view(1, 10, 1).expand(1, 10, 3)
    rows = packed.as_rows(per_token)
    assert rows.shape == (3, 5, 3) and rows[..., 0].tolist() == [[0, 1, 2, 3, 4], [5, 6, 0, 0, 0], [7, 8, 9, 0, 0]]
    # an action's figure is its position's: [b, w-1] in rows
    assert at_actions(torch.arange(10.0).view(1, 10), view).tolist() == [[0, 1, 2, 3], [5, 6, 0, 0], [7, 8, 9, 0]]


def test_a_length_that_must_divide_gets_one_more_row_of_padding_and_a_mask_is_refused():
    packed = packed_rows.packed(_mb(), multiple=4)[PACKED]
    assert packed.tokens.shape == (1, 12) and packed.params.cu_seqlens_q.tolist() == [0, 5, 7, 10, 12]
    assert packed.position_ids[0, 10:].tolist() == [0, 1]
    assert packed.as_rows(torch.arange(12.0).view(1, 12))[2].tolist() == [7, 8, 9, 0, 0]  # the extra row never returns
    with pytest.raises(ValueError, match="packed rows: an explicit attention mask"):
        packed_rows.packed({**_mb(), "attention_mask": torch.ones(3, 1, 5, 5, dtype=torch.bool)})


@pytest.mark.parametrize("window", [None, (2, 0)])
def test_each_packed_row_attends_as_it_does_alone(window):
    """Query heads 4 over key groups 2; every row's context equal to the row's own causal (or
    windowed) attention."""
    lengths = [5, 1, 7, 3]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, 8, generator=g) for h in (4, 2, 2))
    mb = {"tokens": torch.zeros(4, 7, dtype=torch.long), ROW_LENGTHS: torch.tensor(lengths)}
    params = packed_rows.packed(mb)[PACKED].params
    band = None if window is None else (lambda sq, sk: window_band(sq, sk, window, "cpu"))
    context = packed_rows.attention(q, k, v, params, 0.3, band)
    start = 0
    for n in lengths:
        alone = [t[start : start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        mask = None if window is None else window_band(n, n, window, "cpu")
        want = F.scaled_dot_product_attention(*alone, attn_mask=mask, is_causal=window is None, scale=0.3,
                                              enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(context[start : start + n], want, rtol=0, atol=1e-6)
        start += n


def test_a_token_budget_of_real_tokens_takes_more_short_rows():
    longest_first = [10, 6, 3, 3, 2, 1]
    assert packed_sizes(longest_first, 12) == [1, 2, 3]  # rows x the longest: 10 | 6 6 | 3 3 3 3 ... within 12
    assert packed_sizes(longest_first, 12, real_tokens=True) == [1, 3, 2]  # 10 | 6 + 3 + 3 | 2 + 1
    with pytest.raises(ValueError, match="a row of 10 tokens does not fit in max_tokens_per_micro_batch=9"):
        packed_sizes(longest_first, 9, real_tokens=True)


def test_a_role_that_packs_cuts_its_micro_batches_by_real_tokens_and_says_their_lengths():
    from megatron_rlhf.config.schema import RoleConfig

    lengths = torch.tensor([3, 10, 2, 6, 3, 1])
    tokens = torch.zeros(6, 10, dtype=torch.long)
    for packs, rows in ((False, [1] * 6), (True, [1, 3, 2])):  # padded and pipelined: equal rows
        config = RoleConfig(micro_batch_size="auto", max_tokens_per_micro_batch=12, pack_rows=packs)
        mbs, order = micro_batches_of(config, lengths, pipelined=True, tokens=tokens)
        assert [mb["tokens"].shape[0] for mb in mbs] == rows, packs
        assert torch.equal(torch.cat([mb[ROW_LENGTHS] for mb in mbs]), lengths[order])
        if packs:  # a pipelined packed role's micro-batches need not have equal rows: the model sees one
            assert all(int(mb[ROW_LENGTHS].sum()) <= 12 for mb in mbs)


def test_dp_ranks_take_equal_rows_and_near_equal_real_tokens():
    lengths = torch.tensor([100, 5, 90, 10, 50, 40, 7, 60])
    shares = [dealt_by_tokens(lengths, 2, rank) for rank in range(2)]
    assert sorted(torch.cat(shares).tolist()) == list(range(8)) and all(len(s) == 4 for s in shares)
    tokens = [int(lengths[s].sum()) for s in shares]
    assert tokens == [100 + 50 + 40 + 5, 90 + 60 + 10 + 7]  # 195 and 167; consecutive halves: 205 and 157


def test_what_packed_rows_do_not_cover_is_refused_by_name(monkeypatch):
    import os

    from megatron_rlhf.config import ConfigError, load_config

    for key in ("TP", "PP", "CP"):
        monkeypatch.delenv(key, raising=False)
    tiny = os.path.join("examples", "tiny", "grpo.yaml")
    one = ["parallel.tensor_model_parallel_size=1"]
    assert load_config(tiny, world_size=1, overrides=one + ["ppo_policy.pack_rows=true"]).ppo_policy.pack_rows
    for overrides, message in (
            (["parallel.context_parallel_size=2", "policy.pack_rows=true"],
             r"policy.pack_rows.*: packed rows beside context parallelism \(CP=2\) are not modelled yet"),
            (["trainer.batch_invariant=true", "ppo_policy.pack_rows=true"],
             r"ppo_policy.pack_rows.*: trainer.batch_invariant computes right-padded rows"),
            (["reference.attention=local", "reference.pack_rows=true"],
             r"reference.pack_rows.*: needs reference.attention: fused")):
        with pytest.raises(ConfigError, match=message):
            load_config(tiny, world_size=2, overrides=one + overrides)
