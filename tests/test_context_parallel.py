"""Context parallelism without transformer-engine (models/context_parallel.py): each row's positions
divided over CP ranks give CP=1's numbers; and packed rows (models/packed_rows.py) give padded rows' numbers."""

import pytest
import torch

from megatron_rlhf.models import context_parallel


class Group:
    """A CP group's size and this rank's place in it (no world started)."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_the_chunks_are_megatrons_and_come_back_in_sequence_order(monkeypatch):
    """Rank r holds chunks r and 2CP-1-r of a row padded to whole chunks, as megatron's
    get_batch_on_this_cp_rank cuts a batch; the gathered positions go back to sequence order."""
    from megatron.core import utils
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(utils, "get_pg_size", lambda group: group.size())  # without a started world
    monkeypatch.setattr(utils, "get_pg_rank", lambda group: group.rank())

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
    view = context_parallel.on_this_rank(mb, Group(2, 1))  # 7 positions padded to 8: rank 1 holds 2, 3 | 4, 5
    assert view["tokens"].tolist() == [[2, 3, 4, 5], [9, 10, 11, 12]]
    assert view[context_parallel.LABELS].tolist() == [[3, 4, 5, 6], [10, 11, 12, 13]]
    assert view["action_mask"].shape == (2, 4) and torch.equal(view["last_index"], mb["last_index"])
    assert view["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    last = context_parallel.on_this_rank(mb, Group(2, 0))  # rank 0: positions 0, 1 | 6, 7 (7 is padding)
    assert last["action_mask"].tolist() == [[1, 1, 0, 0]] * 2  # position 6 has no action, 7 is padding
    with pytest.raises(ValueError, match="attention mask"):
        context_parallel.on_this_rank({**mb, "attention_mask": torch.ones(2, 1, 7, 7, dtype=torch.bool)}, Group(2, 0))


# The worker's micro-batches: rows of 13 and 9 tokens, then 12 and 6; each row's actions are its
# positions before its last token (a packed pass has nothing at the others).
ACTIONS = [torch.arange(12) < torch.tensor([[12], [8]]), torch.arange(12) < torch.tensor([[11], [5]])]


def _assert_runs_equal(got, want, where, actions_only=False):
    for a, b, actions in zip(got.log_probs, want.log_probs, ACTIONS):
        a, b = (a[actions], b[actions]) if actions_only else (a, b)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{where}: log-probs")
    for a, b, actions in zip(got.values, want.values, ACTIONS):
        a, b = (a[actions], b[actions]) if actions_only else (a, b)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{where}: values")
    for loss in want.figures:
        for step, (a, b) in enumerate(zip(got.figures[loss], want.figures[loss])):
            for name in b:
                assert a[name] == pytest.approx(b[name], rel=1e-6, abs=1e-6), (where, loss, step, name)
        assert got.grad_norms[loss] == pytest.approx(want.grad_norms[loss], rel=1e-6), (where, loss)
        for name, grad in want.grads[loss].items():
            apart = (got.grads[loss][name] - grad).norm() / grad.norm().clamp(min=1e-30)
            assert apart <= 1e-6, f"{where}: {loss}: {name}'s gradient {apart:.2e} of its norm apart"
        for name, weight in want.weights[loss].items():
            # Relative to the tensor, and 1e-5 (5.7e-6 measured, the gradients' 6e-7): Adam divides a
            # gradient by its own size, so where a moment nearly cancels, rounding moves the step.
            moved = (got.weights[loss][name] - weight).norm() / weight.norm()
            assert moved <= 1e-5, f"{where}: {loss}: {name} after two steps: {moved:.2e} of its norm apart"


def test_cp_and_packed_rows_give_cp1_s_log_probs_values_losses_gradients_and_weights(workers):
    """On 4 ranks, each against CP=1's padded rows at the same TP and PP (DP over the rest, on the same
    rows): CP=2 with TP=2, CP=2 with PP=2 (log-probs and values on the last stage), and CP=4 with a
    sliding window; packed rows with TP=2, PP=2, a window and experts (GRPO's); a policy's chunked log-probs and a value head's values, and the losses of every stage:
    GRPO (KL in it), GSPO (a mean over sequences), the value loss (each sequence's sum), SFT, a
    reward model's and DPO's (whole sequences' sums over the CP ranks). (The run's entry at CP=2:
    tests/test_train.py.)"""
    layouts = ("cp1+tp2", "cp2+tp2", "cp1+pp2", "cp2+pp2", "cp1+window", "cp4+window",
               "packed+tp2", "packed+pp2", "packed+window", "cp1+experts", "packed+experts")
    ranks = workers(4, "context_parallel", *layouts, timeout=900)
    for rank, found in enumerate(ranks):
        for layout in ("cp2+tp2", "cp2+pp2", "cp4+window"):
            _assert_runs_equal(found.runs[layout], found.runs[layout.replace("cp2", "cp1").replace("cp4", "cp1")],
                               f"{layout}, rank {rank}")
        # packed rows: the same rows laid end to end, at TP=2, PP=2, in a window, with experts whose
        # routing the packed pass records and GRPO's packed steps replay
        for layout in ("packed+tp2", "packed+pp2", "packed+window", "packed+experts"):
            _assert_runs_equal(found.runs[layout], found.runs[layout.replace("packed", "cp1")], f"{layout}, rank {rank}",
                               actions_only=True)
        assert found.runs["cp2+tp2"].figures["grpo"][0]["tokens"] == 10 + 6 + 9 + 3  # each action once over CP
        assert found.runs["cp4+window"].figures["rm"][0]["pairs"] == 2  # each pair once over CP


def test_what_cp_does_not_cover_yet_is_refused_by_name_and_the_world_must_divide(monkeypatch):
    import os

    from megatron_rlhf.config import ConfigError, load_config

    for key in ("TP", "PP", "CP"):
        monkeypatch.delenv(key, raising=False)
    tiny = os.path.join("examples", "tiny", "grpo.yaml")
    config = load_config(tiny, world_size=4, overrides=["parallel.tensor_model_parallel_size=1",
                                                        "parallel.context_parallel_size=2"])
    assert config.parallel.replica_ranks() == 2
    with pytest.raises(ConfigError, match=r"parallel.context_parallel_size.*world size 6 is not divisible by "
                                          r"TP\*PP\*CP = 1\*1\*4 = 4"):
        load_config(tiny, world_size=6, overrides=["parallel.tensor_model_parallel_size=1", "parallel.context_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"context_parallel_size.*: 2: trainer.batch_invariant covers whole rows"):
        load_config(tiny, world_size=2, overrides=["parallel.tensor_model_parallel_size=1", "parallel.context_parallel_size=2",
                                                   "trainer.batch_invariant=true"])
    with pytest.raises(ConfigError, match=r"context_parallel_size.*: 2: policy's model has experts"):
        load_config(os.path.join("examples", "tiny", "moe.yaml"), world_size=4,
                    overrides=["parallel.tensor_model_parallel_size=1", "parallel.expert_model_parallel_size=1",
                               "parallel.context_parallel_size=2"])
