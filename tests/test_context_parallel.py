"""Context parallelism without transformer-engine (models/context_parallel.py): each row's positions
divided over CP ranks give CP=1's numbers."""

import pytest
import torch

from megatron_rlhf.models import context_parallel


def test_the_chunks_are_megatrons_and_come_back_in_sequence_order(monkeypatch):
    """Rank r holds chunks r and 2CP-1-r of a row padded to whole chunks, as megatron's
    get_batch_on_this_cp_rank cuts a batch; the gathered positions go back to sequence order."""
    from megatron.core import utils
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(utils, "get_pg_size", lambda group: group.size())  # without a started world
    monkeypatch.setattr(utils, "get_pg_rank", lambda group: group.rank())

    class Group:
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    positions = torch.arange(24).unsqueeze(0)
    for cp in (1, 2, 3, 4):
        held = []
        for rank in range(cp):
            mine = context_parallel.local_positions(24, cp, rank)
            theirs = get_batch_on_this_cp_rank({"tokens": positions.clone()}, cp_group=Group(cp, rank))["tokens"][0]
            assert torch.equal(mine, theirs), (cp, rank)
            held.append(mine)
        gathered = torch.cat(held)
        assert torch.equal(gathered[context_parallel.sequence_order(cp, 24 // (2 * cp))], torch.arange(24)), cp
    assert context_parallel.padded_length(13, 2) == 16 and context_parallel.padded_length(16, 4) == 16


def test_a_rank_s_view_cuts_per_position_and_per_action_columns_and_keeps_per_row_ones():
    tokens = torch.arange(2 * 7).view(2, 7)
    mb = {"tokens": tokens, "action_mask": torch.ones(2, 6), "last_index": torch.tensor([6, 3])}
    view = context_parallel.on_this_rank(mb, 2, 1)  # 7 positions padded to 8: rank 1 holds 2, 3 | 4, 5
    assert view["tokens"].tolist() == [[2, 3, 4, 5], [9, 10, 11, 12]]
    assert view[context_parallel.LABELS].tolist() == [[3, 4, 5, 6], [10, 11, 12, 13]]
    assert view["action_mask"].shape == (2, 4) and torch.equal(view["last_index"], mb["last_index"])
    assert view["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    last = context_parallel.on_this_rank(mb, 2, 0)  # rank 0: positions 0, 1 | 6, 7 (7 is padding)
    assert last["action_mask"].tolist() == [[1, 1, 0, 0]] * 2  # position 6 has no action, 7 is padding
    with pytest.raises(ValueError, match="attention mask"):
        context_parallel.on_this_rank({**mb, "attention_mask": torch.ones(2, 1, 7, 7, dtype=torch.bool)}, 2, 0)


def _assert_runs_equal(got, want, where):
    for a, b in zip(got.log_probs, want.log_probs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{where}: log-probs")
    for a, b in zip(got.values, want.values):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{where}: values")
    for loss in want.figures:
        for step, (a, b) in enumerate(zip(got.figures[loss], want.figures[loss])):
            for name in b:
                assert a[name] == pytest.approx(b[name], rel=1e-6, abs=1e-6), (where, loss, step, name)
        assert got.grad_norms[loss] == pytest.approx(want.grad_norms[loss], rel=1e-6), (where, loss)
        for name, grad in want.grads[loss].items():
            apart = (got.grads[loss][name] - grad).norm() / grad.norm()
            assert apart <= 1e-6, f"{where}: {loss}: {name}'s gradient {apart:.2e} of its norm apart"
        for name, weight in want.weights[loss].items():
            # Relative to the tensor, and 5e-6 (1.7e-6 measured, the gradients' 5e-7): Adam scales an
            # element's gradient near zero, rounding alone, to a step of up to lr.
            moved = (got.weights[loss][name] - weight).norm() / weight.norm()
            assert moved <= 5e-6, f"{where}: {loss}: {name} after two steps: {moved:.2e} of its norm apart"


def test_cp2_gives_cp1_s_log_probs_values_losses_gradients_and_weights(workers):
    """On 2 ranks: CP=2 (with a sliding window too) against CP=1 (DP=2 on the same rows) for a
    policy's chunked log-probs and GRPO loss, a value head's values and loss, and SFT's loss."""
    ranks = workers(2, "context_parallel", "cp1", "cp2", "cp1+window", "cp2+window")
    for rank, found in enumerate(ranks):
        for layout in ("cp2", "cp2+window"):
            _assert_runs_equal(found.runs[layout], ranks[0].runs[layout.replace("cp2", "cp1")], f"{layout}, rank {rank}")
        grpo = found.runs["cp2"].figures["grpo"][0]
        assert grpo["tokens"] == 10 + 6 + 9 + 3  # each action counted once over the CP ranks
