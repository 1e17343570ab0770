"""The PPO update does not depend on how the work is cut: micro-batch size, DP, TP and PP (with
rows grouped by length into micro-batches trimmed to their longest row) give the uncut run's
(whole rows) gradients and reported losses (fp32, relative difference <= 1e-5), for every loss
aggregation mode; TP ranks can never sample different tokens; clip_grad 0 still reports a norm."""

import pytest

from megatron_rlhf import ppo

TOLERANCE = 1e-5


def relative_difference(got, expected):
    assert sorted(got) == sorted(expected)
    return max(((got[k] - expected[k]).abs().max() / expected[k].abs().max().clamp(min=1e-30)).item() for k in expected)


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    from tests.conftest import run_workers

    tmp = tmp_path_factory.mktemp("invariance")
    single = run_workers(tmp, 1, "ppo_invariance", "single")[0]
    layouts = run_workers(tmp, 2, "ppo_invariance", "layouts")
    return single, layouts


@pytest.mark.parametrize("head, mode", [(h, m) for h in ("lm", "scalar") for m in ppo.LOSS_AGG_MODES]
                         + [("lm", "gspo+dual-clip")])
def test_micro_batch_size_changes_neither_gradients_nor_reported_loss(updates, head, mode):
    single, _ = updates
    uncut = single.steps[(head, mode, "mb8")]
    # Rows per micro-batch, and (token-mean) micro-batches packed by a budget of 40 tokens.
    for micro in ("mb1", "mb4") + (("tokens40",) if mode == "token-mean" else ()):
        cut = single.steps[(head, mode, micro)]
        assert relative_difference(cut.grads, uncut.grads) <= TOLERANCE, micro
        assert cut.loss == pytest.approx(uncut.loss, rel=TOLERANCE), micro


@pytest.mark.parametrize("head", ["lm", "scalar"])
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "pp2_tokens40"])  # the last: packed by tokens, equal rows
def test_dp_tp_and_pp_give_the_uncut_update(updates, head, layout):
    single, layouts = updates
    uncut = single.steps[(head, "token-mean", "mb8")]
    for rank in layouts:
        got = rank.steps[(head, "token-mean", layout)]
        assert relative_difference(got.grads, uncut.grads) <= TOLERANCE
        assert got.loss == pytest.approx(uncut.loss, rel=TOLERANCE)


def test_tp_ranks_sample_the_same_tokens_and_clip_grad_0_reports_the_norm(workers):
    results = workers(2, "ppo_edge_cases")
    for r in results:
        assert r.tp_ranks_agree
        norms = r.grad_norms
        assert norms[0.0] > 0 and norms[0.0] == pytest.approx(norms[1e9], rel=1e-6)


def _close(got: dict, expected: dict, what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=TOLERANCE, abs=TOLERANCE), (what, key, got[key], value)


def _same_iterations(pairs: dict, cut: str) -> None:
    """Each (iteration, the uncut one) pair: the same metrics and weights."""
    for run, (got, expected) in pairs.items():
        _close(got.metrics, expected.metrics, f"{run}: {cut}")
        _close(got.weights, expected.weights, f"{run} weights: {cut}")


def test_a_whole_iteration_with_several_steps_per_epoch_does_not_depend_on_dp_or_tp(tmp_path):
    """The PPO, GRPO and agent (multi-turn) demos, one iteration of 4 optimizer steps at TP=1 on one
    process (DP=1) and on two (DP=2), PPO and GRPO also on four (DP=4): the same reported figures and
    the same weights after it; the
    agent demo also at TP=2 from the same starting weights (loaded); GRPO with LoRA also with EMS
    off and other micro-batches at DP=2 (the same adapters after the step)."""
    from tests.conftest import run_workers

    one = run_workers(tmp_path, 1, "dp_iteration")[0]
    two = run_workers(tmp_path, 2, "dp_iteration")
    for rank in run_workers(tmp_path, 4, "dp_iteration"):
        _same_iterations({"ppo": (rank.ppo, one.ppo), "grpo": (rank.grpo, one.grpo)}, "DP=4")
    for rank in two:
        _same_iterations({"ppo": (rank.ppo, one.ppo), "grpo": (rank.grpo, one.grpo),
                          "grpo_lora": (rank.grpo_lora, one.grpo_lora), "game": (rank.game, one.game)}, "DP=2")
        _same_iterations({"game": (rank.game_tp2, one.game)}, "TP=2")
    assert one.game.metrics["rollout/turns_mean"] == 4 and 0 < one.game.metrics["rollout/model_token_share"] < 1
