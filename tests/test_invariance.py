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


@pytest.mark.parametrize("head", ["lm", "scalar"])
@pytest.mark.parametrize("mode", ppo.LOSS_AGG_MODES)
def test_micro_batch_size_changes_neither_gradients_nor_reported_loss(updates, head, mode):
    single, _ = updates
    uncut = single[(head, mode, "mb8")]
    for micro in ("mb1", "mb4"):
        cut = single[(head, mode, micro)]
        assert relative_difference(cut["grads"], uncut["grads"]) <= TOLERANCE, micro
        assert cut["loss"] == pytest.approx(uncut["loss"], rel=TOLERANCE), micro


@pytest.mark.parametrize("head", ["lm", "scalar"])
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_dp_tp_and_pp_give_the_uncut_update(updates, head, layout):
    single, layouts = updates
    uncut = single[(head, "token-mean", "mb8")]
    for rank in layouts:
        got = rank[(head, "token-mean", layout)]
        assert relative_difference(got["grads"], uncut["grads"]) <= TOLERANCE
        assert got["loss"] == pytest.approx(uncut["loss"], rel=TOLERANCE)


def test_tp_ranks_sample_the_same_tokens_and_clip_grad_0_reports_the_norm(workers):
    results = workers(2, "ppo_edge_cases")
    for r in results:
        assert r["tp_ranks_agree"]
        norms = r["grad_norms"]
        assert norms[0.0] > 0 and norms[0.0] == pytest.approx(norms[1e9], rel=1e-6)
