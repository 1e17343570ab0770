"""Partial rollouts (rollout/partial.py): resumed responses are those of one go, groups stay whole,
held groups survive a checkpoint, stale ones are dropped and counted, and the rows do not depend on
DP, the policy's TP, micro-batches or EMS."""

import pytest
import torch

from megatron_rlhf.rollout.partial import PartialRollouts

TOLERANCE = 1e-5
SAMPLES, EOS, MAX_NEW = 4, 2, 16  # the GRPO demo's responses per prompt, end token, max_new_tokens


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.conftest import run_workers

    tmp = tmp_path_factory.mktemp("partial")
    return run_workers(tmp, 1, "partial_rollouts")[0], run_workers(tmp, 2, "partial_rollouts")


def _close(got: dict, expected: dict, what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=TOLERANCE, abs=TOLERANCE), (what, key, got[key], value)


def test_resumed_responses_equal_one_go_when_the_weights_do_not_change(runs):
    single, _ = runs
    lr0 = single.lr0
    assert sum(m["rollout/partial_resumed"] for m in lr0.metrics) > 0  # some responses ran over iterations
    assert max(m["rollout/staleness_mean"] for m in lr0.metrics) > 0
    for rows, one_go in zip(lr0.rows, lr0.one_go):
        assert torch.equal(rows["response_lengths"], one_go["response_lengths"])
        for i, (p, r) in enumerate(zip(rows["prompt_lengths"].tolist(), rows["response_lengths"].tolist())):
            assert torch.equal(rows["tokens"][i, : p + r], one_go["tokens"][i, : p + r])
            # The engine's log-probs recorded chunk by chunk are those of one go.
            got, want = rows["behaviour_log_probs"][i, p - 1 : p + r - 1], one_go["log_probs"][i, p - 1 : p + r - 1]
            assert (got - want).abs().max() <= TOLERANCE
    for m in lr0.metrics:  # the weights that sampled every token are the weights that score it
        assert m["rollout/behaviour_kl"] <= 1e-6 and m["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_groups_stay_whole_and_every_trained_response_has_ended(runs):
    single, _ = runs
    for rows in single.lr0.rows:
        assert len(rows["seeds"]) == 8 * SAMPLES
        index = rows["prompt_index"].view(-1, SAMPLES)
        assert (index == index[:, :1]).all()  # a group's responses are adjacent rows
        assert len(set(rows["seeds"].tolist())) == len(rows["seeds"])
        for t, p, r in zip(rows["tokens"], rows["prompt_lengths"].tolist(), rows["response_lengths"].tolist()):
            assert r == MAX_NEW or t[p + r - 1] == EOS


def test_a_checkpoint_holding_unfinished_responses_resumes_exactly(runs):
    single, _ = runs
    resume = single.resume
    assert resume.held_unfinished > 0  # the checkpoint held responses in the middle of their tokens
    assert resume.resumed == resume.whole[2:]


def test_dp_the_policys_tp_micro_batches_and_ems_change_nothing(runs):
    single, pair = runs
    for rank in pair:
        for got, want in zip(rank.lr0.metrics, single.lr0.metrics):
            _close(got, want, "lr0")
        for got, want in zip(rank.resume.whole, single.resume.whole):
            _close(got, want, "trained")
        for got, want in zip(rank.lr0.rows, single.lr0.rows):
            assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(got["seeds"], want["seeds"])
        assert rank.resume.resumed == rank.resume.whole[2:]


class _Config:
    """What PartialRollouts reads of a config to keep and drop held groups."""

    def __init__(self, samples=2, need=2, max_staleness=1):
        from types import SimpleNamespace as NS

        self.generation = NS(samples_per_prompt=samples)
        self.ppo = NS(rollout_batch_size=need)
        self.rollout = NS(partial=NS(max_staleness=max_staleness))


def _partial(config) -> PartialRollouts:
    from types import SimpleNamespace as NS

    return PartialRollouts(config, NS(roles=None))


def test_the_first_ended_groups_in_pool_order_are_trained_and_the_rest_held_whole():
    partial = _partial(_Config(samples=2, need=2))
    # Four groups of two: group 0 half ended, groups 1, 2 and 3 ended.
    pool = {"seeds": torch.arange(8), "ended": torch.tensor([1, 0, 1, 1, 1, 1, 1, 1]),
            "versions": torch.zeros(8, 3, dtype=torch.long)}
    picked = partial._hold_the_rest(pool)
    assert picked.tolist() == [2, 3, 4, 5]
    assert partial.held["seeds"].tolist() == [0, 1, 6, 7] and partial.held_groups == 2


def test_a_group_older_than_max_staleness_is_dropped_and_counted():
    partial = _partial(_Config(samples=2, max_staleness=1))
    versions = torch.full((6, 4), -1, dtype=torch.long)
    versions[0:2, :2] = 3  # a group started in iteration 3
    versions[2, :3], versions[3, :1] = 4, 5  # started in 4 (one response resumed in 5)
    versions[4:6, 0] = 5
    partial.held = {"seeds": torch.arange(6), "versions": versions, "ended": torch.zeros(6, dtype=torch.long)}
    held, dropped = partial._fresh(iteration=5)
    assert dropped == 2 and held["seeds"].tolist() == [2, 3, 4, 5]
    strict = _partial(_Config(samples=2, max_staleness=0))
    strict.held = partial.held
    held, dropped = strict._fresh(iteration=5)
    assert dropped == 4 and held["seeds"].tolist() == [4, 5]


@pytest.fixture(scope="module")
def trajectory_runs(tmp_path_factory):
    from tests.conftest import run_workers

    tmp = tmp_path_factory.mktemp("partial_trajectories")
    return run_workers(tmp, 1, "partial_trajectories")[0], run_workers(tmp, 2, "partial_trajectories")


def test_trajectories_resumed_with_their_environments_equal_one_go_when_the_weights_do_not_change(trajectory_runs):
    single, _ = trajectory_runs
    lr0 = single.lr0
    assert sum(m["rollout/partial_resumed"] for m in lr0.metrics) > 0  # some trajectories ran over iterations
    assert sum(m["rollout/env_replayed_calls"] for m in lr0.metrics) > 0  # their environments rebuilt
    assert max(m["rollout/staleness_mean"] for m in lr0.metrics) > 0
    for rows, one_go in zip(lr0.rows, lr0.one_go):
        assert len(rows["seeds"]) == 4 * 4  # rollout_batch_size groups of samples_per_prompt
        assert torch.equal(rows["response_lengths"], one_go["response_lengths"])
        for i, (p, r) in enumerate(zip(rows["prompt_lengths"].tolist(), rows["response_lengths"].tolist())):
            # Every reply depends on the moves before it: a game not rebuilt would show other targets.
            assert torch.equal(rows["tokens"][i, : p + r], one_go["tokens"][i, : p + r])
            assert torch.equal(rows["action_mask"][i, : p + r - 1], one_go["action_mask"][i, : p + r - 1])
            got, want = rows["behaviour_log_probs"][i, : p + r - 1], one_go["behaviour_log_probs"][i, : p + r - 1]
            assert (got - want).abs().max() <= TOLERANCE
    for m in lr0.metrics:
        assert m["rollout/behaviour_kl"] <= 1e-6 and m["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_a_checkpoint_holding_unfinished_trajectories_resumes_exactly_at_any_layout(trajectory_runs):
    single, pair = trajectory_runs
    assert single.resume.held_unfinished > 0  # trajectories held between turns
    # Within 1e-5, not bit for bit: the engine's log-prob of a token (the behaviour policy's, which
    # TIS weighs by) moves in its last bits with which rows share its decode step, and without
    # lockstep that follows when each environment's reply came. The tokens never do.
    assert len(single.resume.resumed) == len(single.resume.whole[2:]) == 1
    for got, want in zip(single.resume.resumed, single.resume.whole[2:]):
        _close(got, want, "resumed")
    for rank in pair:
        for got, want in zip(rank.lr0.metrics, single.lr0.metrics):
            _close(got, want, "lr0")
        for got, want in zip(rank.lr0.rows, single.lr0.rows):
            assert torch.equal(got["tokens"], want["tokens"]) and torch.equal(got["seeds"], want["seeds"])
        for got, want in zip(rank.resume.whole, single.resume.whole):
            _close(got, want, "trained")
        for got, want in zip(rank.resume.resumed, rank.resume.whole[2:]):
            _close(got, want, "resumed")
