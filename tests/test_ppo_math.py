"""PPO math against direct reference formulas written as plain Python loops over lists."""

import math
import random

import pytest
import torch

from megatron_rlhf import ppo

# Masks with the edge cases: a full row, a right-padded row, a length-1 response, an all-masked
# row, and a row with leading padding (left-padded).
MASK = [
    [1, 1, 1, 1, 1],
    [1, 1, 1, 0, 0],
    [1, 0, 0, 0, 0],
    [0, 0, 0, 0, 0],
    [0, 0, 1, 1, 1],
]


def rand(rows, cols, seed):
    rng = random.Random(seed)
    return [[rng.uniform(-2, 2) for _ in range(cols)] for _ in range(rows)]


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def ref_gae(rewards, values, mask, gamma, lam):
    adv_rows, ret_rows = [], []
    for r, v, m in zip(rewards, values, mask):
        T = len(r)
        adv = [0.0] * T
        for i in range(T):
            if not m[i]:
                continue
            # Sum over the counted positions from i up to the end of its contiguous span.
            total, j, discount = 0.0, i, 1.0
            while j < T and m[j]:
                next_v = v[j + 1] if j + 1 < T and m[j + 1] else 0.0
                delta = r[j] + gamma * next_v - v[j]
                total += discount * delta
                discount *= gamma * lam
                j += 1
            adv[i] = total
        adv_rows.append(adv)
        ret_rows.append([(a + vv) if mm else 0.0 for a, vv, mm in zip(adv, v, m)])
    return adv_rows, ret_rows


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_gae_equals_the_direct_sum_of_discounted_td_errors(gamma, lam):
    rewards, values = rand(5, 5, 1), rand(5, 5, 2)
    adv, ret = ppo.gae_advantages(t(rewards), t(values), t(MASK), gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards, values, MASK, gamma, lam)
    torch.testing.assert_close(adv, t(ref_adv), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, t(ref_ret), rtol=0, atol=1e-12)
    assert adv[3].abs().sum() == 0 and ret[3].abs().sum() == 0  # all-masked row
    assert adv[2, 0].item() == pytest.approx(rewards[2][0] - values[2][0])  # length-1 response


def test_kl_estimators():
    logp, ref = rand(5, 5, 3), rand(5, 5, 4)
    k1 = ppo.kl_penalty(t(logp), t(ref), "k1")
    k3 = ppo.kl_penalty(t(logp), t(ref), "k3")
    for i in range(5):
        for j in range(5):
            log_r = ref[i][j] - logp[i][j]
            assert k1[i, j].item() == pytest.approx(logp[i][j] - ref[i][j], abs=1e-12)
            assert k3[i, j].item() == pytest.approx(math.exp(log_r) - log_r - 1, abs=1e-12)
            assert k3[i, j].item() >= 0
    # low_var_kl: k3 clamped to [-10, 10]; a token the reference finds far less likely hits the clamp.
    far = ppo.kl_penalty(t([[0.0, -1.0]]), t([[-20.0, -1.5]]), "low_var_kl")
    assert far[0, 0].item() == 10.0
    assert far[0, 1].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1, abs=1e-12)
    with pytest.raises(ValueError, match="k1, k3, low_var_kl"):
        ppo.kl_penalty(t(logp), t(ref), "k2")


def test_token_rewards_put_the_score_on_the_last_counted_token():
    kl, scores = rand(5, 5, 5), [1.5, -2.0, 3.0, 7.0, 0.25]
    got = ppo.token_rewards(t(scores), t(kl), 0.1, t(MASK))
    for i in range(5):
        last = max((j for j in range(5) if MASK[i][j]), default=None)
        for j in range(5):
            expected = -0.1 * kl[i][j] if MASK[i][j] else 0.0
            if j == last:
                expected += scores[i]
            assert got[i, j].item() == pytest.approx(expected, abs=1e-12)
    assert ppo.last_token_index(t(MASK)).tolist() == [4, 2, 0, -1, 4]


def ref_masked_mean(x, mask):
    vals = [v for row, mrow in zip(x, mask) for v, m in zip(row, mrow) if m]
    return sum(vals) / len(vals) if vals else 0.0


def test_masked_statistics_and_whitening():
    x = rand(5, 5, 6)
    vals = [v for row, mrow in zip(x, MASK) for v, m in zip(row, mrow) if m]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    assert ppo.masked_mean(t(x), t(MASK)).item() == pytest.approx(mean, abs=1e-12)
    total, total_sq, count = ppo.masked_moments(t(x), t(MASK)).tolist()
    assert (total, total_sq, count) == pytest.approx((sum(vals), sum(v * v for v in vals), len(vals)), abs=1e-12)
    white = ppo.whiten_with_moments(t(x), t(MASK), ppo.masked_moments(t(x), t(MASK)), eps=0.0)
    for i in range(5):
        for j in range(5):
            expected = (x[i][j] - mean) / math.sqrt(var) if MASK[i][j] else 0.0
            assert white[i, j].item() == pytest.approx(expected, abs=1e-10)
    empty = torch.zeros(5, 5, dtype=torch.float64)
    assert ppo.masked_mean(t(x), empty).item() == 0.0  # no counted token: 0, not NaN


def test_policy_loss_is_the_clipped_surrogate():
    logp, old, adv = rand(5, 5, 7), rand(5, 5, 8), rand(5, 5, 9)
    old = [[o * 0.3 + lp for o, lp in zip(orow, lrow)] for orow, lrow in zip(old, logp)]  # ratios near 1
    clip = 0.2
    per_token_loss, stats = ppo.policy_loss_terms(t(logp), t(old), t(adv), clip, clip)
    total, count = ppo.aggregate_loss(per_token_loss, t(MASK))
    loss, clipfrac = total / count, ppo.masked_mean(stats["clipped"], t(MASK))
    per_token, clipped_flags = [], []
    for i in range(5):
        lrow, crow = [], []
        for j in range(5):
            ratio = math.exp(logp[i][j] - old[i][j])
            a = adv[i][j]
            unclipped, clipped = -a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip)
            lrow.append(max(unclipped, clipped))
            crow.append(1.0 if clipped > unclipped else 0.0)
        per_token.append(lrow)
        clipped_flags.append(crow)
    assert loss.item() == pytest.approx(ref_masked_mean(per_token, MASK), abs=1e-12)
    assert clipfrac.item() == pytest.approx(ref_masked_mean(clipped_flags, MASK), abs=1e-12)
    assert 0 < clipfrac.item() < 1


def test_value_loss_is_the_clipped_squared_error():
    v, old, ret = rand(5, 5, 10), rand(5, 5, 11), rand(5, 5, 12)

    def value_loss(clip_range):  # as roles/losses.py aggregates it (token-mean)
        per_token, stats = ppo.value_loss_terms(t(v), t(old), t(ret), clip_range)
        total, count = ppo.aggregate_loss(per_token, t(MASK))
        return total / count, ppo.masked_mean(stats["clipped"], t(MASK))

    loss, clipfrac = value_loss(0.5)
    per_token = []
    for i in range(5):
        row = []
        for j in range(5):
            vc = old[i][j] + min(max(v[i][j] - old[i][j], -0.5), 0.5)
            row.append(0.5 * max((v[i][j] - ret[i][j]) ** 2, (vc - ret[i][j]) ** 2))
        per_token.append(row)
    assert loss.item() == pytest.approx(ref_masked_mean(per_token, MASK), abs=1e-12)
    unclipped_loss, _ = value_loss(None)
    expected = ref_masked_mean([[0.5 * (a - b) ** 2 for a, b in zip(vr, rr)] for vr, rr in zip(v, ret)], MASK)
    assert unclipped_loss.item() == pytest.approx(expected, abs=1e-12)
    assert clipfrac.item() > 0


def test_a_value_inside_the_clip_band_is_never_counted_clipped():
    """fp32 values within clip_range of the old ones: old + (V - old) rounds away from V for some of
    them, which counted a rounding as a clip (the clip fraction then moved with the layout's last bits)."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4096, generator=g) * 0.01
    values = (old.double() + (torch.rand(4096, generator=g, dtype=torch.float64) - 0.5) * 0.3).float()  # within 0.15
    assert not torch.equal(old + (values - old), values)  # the rounding the old form counted
    _, stats = ppo.value_loss_terms(values, old, torch.randn(4096, generator=g), 0.2)
    assert stats["clipped"].sum() == 0


def test_adaptive_kl_controller_moves_toward_the_target_with_a_bounded_step():
    ctl = ppo.AdaptiveKLController(value=0.2, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=256)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000))
    ctl.update(current_kl=3.0, n_steps=256)  # error -0.5 clipped to -0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 256 / 10000) * (1 - 0.2 * 256 / 10000))
    fixed = ppo.FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05


def test_running_moments_equal_the_moments_of_everything_seen():
    rng = random.Random(14)
    moments, seen = ppo.RunningMoments(), []
    for n in (7, 1, 12, 3):
        batch = [rng.gauss(3.0, 2.0) for _ in range(n)]
        seen += batch
        batch_mean, batch_std = moments.update(torch.tensor(batch, dtype=torch.float64))
        assert batch_mean == pytest.approx(sum(batch) / n)
        mean = sum(seen) / len(seen)
        assert moments.mean == pytest.approx(mean, abs=1e-12)
        assert moments.var == pytest.approx(sum((v - mean) ** 2 for v in seen) / len(seen), abs=1e-12)
    restored = ppo.RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert (restored.mean, restored.var, restored.count, restored.std) == (moments.mean, moments.var, moments.count,
                                                                           moments.std)


def test_clip_rewards():
    assert ppo.clip_rewards(t([-9.0, 0.5, 9.0]), 5.0).tolist() == [-5.0, 0.5, 5.0]
    assert ppo.clip_rewards(t([-9.0]), None).tolist() == [-9.0]


# --- loss aggregation, whitening over parts (issue: the update must not depend on the cut) -------

def _aggregation_case():
    gen = torch.Generator().manual_seed(4)
    per_token = torch.randn(5, 7, generator=gen)
    mask = torch.zeros(5, 7)
    for row, (start, n) in enumerate([(1, 6), (2, 1), (0, 0), (3, 4), (0, 7)]):  # row 2 has no token
        mask[row, start : start + n] = 1.0
    return per_token, mask


@pytest.mark.parametrize("mode", ppo.LOSS_AGG_MODES)
def test_aggregate_loss_equals_the_direct_formula_and_adds_up_over_any_split(mode):
    from megatron_rlhf.ppo import aggregate_loss

    per_token, mask = _aggregation_case()
    rows = [r for r in range(5) if mask[r].sum() > 0]
    if mode == "token-mean":
        expected = sum(per_token[r, t] for r in range(5) for t in range(7) if mask[r, t]) / mask.sum()
    elif mode == "seq-mean-token-sum":
        expected = sum(sum(per_token[r, t] for t in range(7) if mask[r, t]) for r in rows) / len(rows)
    elif mode == "seq-mean-token-sum-norm":  # Dr. GRPO: over the constant budget (here 16), not the length
        expected = sum(sum(per_token[r, t] for t in range(7) if mask[r, t]) / 16 for r in rows) / len(rows)
    else:
        expected = sum(sum(per_token[r, t] for t in range(7) if mask[r, t]) / mask[r].sum() for r in rows) / len(rows)
    total, count = aggregate_loss(per_token, mask, mode, norm=16)
    assert count.dtype == torch.int64
    assert (total / count).item() == pytest.approx(float(expected), rel=1e-6)
    for cut in ([1, 2, 2], [3, 2], [1, 1, 1, 1, 1]):
        parts = [aggregate_loss(p, m, mode, norm=16) for p, m in zip(per_token.split(cut), mask.split(cut))]
        assert (sum(s for s, _ in parts) / sum(c for _, c in parts)).item() == pytest.approx(float(expected), rel=1e-6)
    with pytest.raises(ValueError, match="loss_agg_mode must be one of token-mean"):
        aggregate_loss(per_token, mask, "mean")


def test_whitening_a_batch_in_parts_by_the_summed_moments_equals_whitening_it_whole():
    from megatron_rlhf.ppo import masked_moments, whiten_with_moments

    x, mask = _aggregation_case()
    whole = whiten_with_moments(x, mask, masked_moments(x, mask))
    moments = masked_moments(x[:2], mask[:2]) + masked_moments(x[2:], mask[2:])  # what an all-reduce over DP gives
    parts = torch.cat([whiten_with_moments(x[:2], mask[:2], moments), whiten_with_moments(x[2:], mask[2:], moments)])
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)
    # Against the direct formula: unbiased std over the counted positions.
    values = x[mask > 0]
    torch.testing.assert_close(whole[mask > 0], (values - values.mean()) / values.std(), rtol=1e-5, atol=1e-5)


def test_value_loss_without_clipping_stays_on_the_inputs_device():
    values = torch.zeros(2, 3, device="meta")
    _, stats = ppo.value_loss_terms(values, values, values, None)
    assert ppo.masked_mean(stats["clipped"], torch.ones(2, 3, device="meta")).device.type == "meta"


def test_policy_loss_terms_clip_low_and_high_separately():
    from megatron_rlhf.ppo import policy_loss_terms

    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 0.9, 1.1, 1.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    per_token, stats = policy_loss_terms(logp, old, adv, clip_low=0.2, clip_high=0.3)
    ratio = logp.exp()
    expected = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.3))
    torch.testing.assert_close(per_token, expected)
    assert stats["clipped"].tolist() == [[0.0, 0.0, 0.0, 1.0]]


def _verl_style_dual_clip(ratio, adv, low, high, c):
    """The dual-clip loss as verl's compute_policy_loss writes it, per token."""
    first = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    return torch.where(adv < 0, torch.minimum(-adv * c, first), first)


def test_dual_clip_caps_the_loss_of_negative_advantages_only():
    from megatron_rlhf.ppo import policy_loss_terms

    old = torch.zeros(1, 5)
    logp = torch.log(torch.tensor([[0.5, 2.0, 5.0, 5.0, 0.9]]))
    adv = torch.tensor([[-1.0, -1.0, -2.0, 1.0, 0.5]])
    per_token, _ = policy_loss_terms(logp, old, adv, 0.2, 0.2, dual_clip=3.0)
    # ratio 5 with A = -2: PPO's loss 10 is capped at 3 * 2 = 6; with A > 0 nothing changes.
    assert per_token.tolist()[0] == pytest.approx([0.8, 2.0, 6.0, -1.2, -0.45], rel=1e-6)
    torch.testing.assert_close(per_token, _verl_style_dual_clip(logp.exp(), adv, 0.2, 0.2, 3.0))
    gen = torch.Generator().manual_seed(8)
    logp, old, adv = (torch.randn(6, 9, generator=gen) for _ in range(3))
    torch.testing.assert_close(policy_loss_terms(logp, old, adv, 0.2, 0.28, dual_clip=2.5)[0],
                               _verl_style_dual_clip((logp - old).exp(), adv, 0.2, 0.28, 2.5))
    assert torch.equal(policy_loss_terms(logp, old, adv, 0.2, 0.28)[0],
                       torch.maximum(-adv * (logp - old).exp(), -adv * (logp - old).exp().clamp(0.8, 1.28)))


def _gspo_direct(logp, old, adv, mask, low, high):
    """The paper's objective, per sequence: s = exp(mean of the log-ratio over its tokens),
    loss_i = max(-A_i * s, -A_i * clip(s)), averaged over the sequences with a token."""
    losses = []
    for row in range(logp.shape[0]):
        counted = mask[row] > 0
        if not counted.any():
            continue
        s = torch.exp((logp[row] - old[row])[counted].mean())
        a = adv[row][counted][0]
        losses.append(torch.maximum(-a * s, -a * s.clamp(1 - low, 1 + high)))
    return torch.stack(losses).mean()


def test_gspo_is_the_sequence_ratio_objective_in_value_and_gradient():
    from megatron_rlhf.ppo import aggregate_loss, gspo_loss_terms

    gen = torch.Generator().manual_seed(9)
    mask = torch.tensor(GROUP_MASK[:6], dtype=torch.float32)
    old = torch.randn(6, 3, generator=gen)
    adv = torch.randn(6, 1, generator=gen).expand(6, 3) * mask  # one advantage per sequence
    for spread, (low, high) in ((0.3, (0.2, 0.28)), (1e-4, (3e-4, 4e-4))):  # some sequences clipped, then none
        logp = (old + spread * torch.randn(6, 3, generator=gen)).requires_grad_()
        per_token, stats = gspo_loss_terms(logp, old, adv, low, high, mask)
        total, count = aggregate_loss(per_token, mask, "seq-mean-token-mean")
        direct_logp = logp.detach().clone().requires_grad_()
        direct = _gspo_direct(direct_logp, old, adv, mask, low, high)
        torch.testing.assert_close(total / count, direct)
        (total / count).backward()
        direct.backward()
        torch.testing.assert_close(logp.grad, direct_logp.grad * mask)
    # Every token of a sequence carries the sequence's ratio.
    sequence = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1).clamp(min=1))
    assert torch.allclose((stats["ratio_dev"] + 0)[mask[:, 0] > 0, 0], (sequence - 1).abs()[mask[:, 0] > 0])


def test_a_huge_log_ratio_gives_finite_gradients_and_values_inside_the_bound_are_unchanged():
    from megatron_rlhf.ppo import gspo_loss_terms, policy_loss_terms
    from megatron_rlhf.ppo.core import LOG_RATIO_LIMIT

    old = torch.zeros(1, 4)
    logp = torch.tensor([[100.0, -100.0, 3.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, -1.0, 1.0]])
    for terms in (policy_loss_terms, gspo_loss_terms):
        per_token, _ = terms(logp, old, adv, 0.2, 0.2, torch.ones(1, 4), 3.0)
        per_token.sum().backward()
        assert torch.isfinite(per_token).all() and torch.isfinite(logp.grad).all(), terms.__name__
        logp.grad = None
    per_token, _ = policy_loss_terms(logp, old, adv, 0.2, 0.2)
    per_token.sum().backward()
    # Outside the bound: the clamped formula (ratio e^20 with A = -1: the unclipped branch, no gradient
    # through the clamp); inside: exactly the unbounded ratio.
    bounded = torch.exp(torch.tensor([LOG_RATIO_LIMIT, -LOG_RATIO_LIMIT]))
    assert per_token[0, :2].tolist() == pytest.approx([bounded[0].item(), -bounded[1].item()], rel=1e-6)
    assert logp.grad[0, :2].tolist() == [0.0, 0.0]
    inside = torch.tensor([[3.0, -0.5]])
    assert torch.equal(per_token.detach()[:, 2:], torch.maximum(-adv[:, 2:] * inside.exp(),
                                                                -adv[:, 2:] * inside.exp().clamp(0.8, 1.2)))
    for estimator in ("k3", "low_var_kl"):
        far = torch.tensor([[100.0, -100.0]], requires_grad=True)
        kl = ppo.kl_penalty(far, torch.zeros(1, 2), estimator)
        kl.sum().backward()
        assert torch.isfinite(kl).all() and torch.isfinite(far.grad).all(), estimator
        near = torch.tensor([[0.7, -3.0]])
        assert torch.equal(ppo.kl_penalty(near, torch.zeros(1, 2), "k3"), torch.expm1(-near) + near)


# --------------------------------------------------------------------------------------------------
# Critic-free estimators, against formulas written per group with plain Python. Hand-made groups:
# spread scores, a tie inside a group, a group of one, a group whose scores are all equal, and
# groups whose rows are not adjacent.
SCORES = [1.0, 0.0, 0.5, 0.5, 2.0, 3.0, 3.0, 3.0, -1.0, 4.0]
GROUPS = [0, 0, 0, 1, 2, 3, 3, 3, 1, 0]
GROUP_MASK = [[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]


def members(i):
    return [SCORES[j] for j in range(len(SCORES)) if GROUPS[j] == GROUPS[i]]


def tiled(per_row):
    return t([[a * m for m in row] for a, row in zip(per_row, GROUP_MASK)])


def ref_grpo(normalize, eps=1e-6):
    out = []
    for i, x in enumerate(SCORES):
        group = members(i)
        if len(group) == 1:  # no baseline: mean 0, std 1
            out.append(x / (1 + eps) if normalize else x)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        out.append((x - mean) / (std + eps) if normalize else x - mean)
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_grpo_is_the_group_normalised_score(normalize):
    got = ppo.grpo_advantages(t(SCORES), torch.tensor(GROUPS), t(GROUP_MASK), normalize_by_std=normalize)
    torch.testing.assert_close(got, tiled(ref_grpo(normalize)), rtol=0, atol=1e-12)
    assert got[5:8].abs().max() == 0  # all-equal group: no signal
    assert got[4, 0].item() == pytest.approx(2.0 / (1 + 1e-6) if normalize else 2.0)  # group of one


def test_rloo_subtracts_the_mean_of_the_other_responses():
    ref = []
    for i, x in enumerate(SCORES):
        others = members(i)
        others.remove(x)
        ref.append(x - sum(others) / len(others) if others else x)
    got = ppo.rloo_advantages(t(SCORES), torch.tensor(GROUPS), t(GROUP_MASK))
    torch.testing.assert_close(got, tiled(ref), rtol=0, atol=1e-12)
    # RLOO is GRPO's unnormalised advantage scaled by n / (n - 1) for a group of n.
    grpo = ppo.grpo_advantages(t(SCORES), torch.tensor(GROUPS), t(GROUP_MASK), normalize_by_std=False)
    torch.testing.assert_close(got[:3], grpo[:3] * 4 / 3, rtol=0, atol=1e-12)


def test_reinforce_plus_plus_returns_and_baseline_whitened_over_the_batch():
    rewards = rand(5, 5, 8)
    for gamma in (1.0, 0.9):
        ref = []
        for r, m in zip(rewards, MASK):
            ref.append([sum(gamma ** (k - i) * r[k] * m[k] for k in range(i, len(r)) if all(m[i : k + 1])) if m[i] else 0.0
                        for i in range(len(r))])
        torch.testing.assert_close(ppo.discounted_returns(t(rewards), t(MASK), gamma), t(ref), rtol=0, atol=1e-12)
    # reinforce_plus_plus_baseline: score - group mean at every token, then whitened over the batch.
    centred = ppo.grpo_advantages(t(SCORES), torch.tensor(GROUPS), t(GROUP_MASK), normalize_by_std=False)
    whitened = ppo.whiten_with_moments(centred, t(GROUP_MASK), ppo.masked_moments(centred, t(GROUP_MASK)))
    counted = [a for row, mrow in zip(tiled(ref_grpo(False)).tolist(), GROUP_MASK) for a, m in zip(row, mrow) if m]
    mean = sum(counted) / len(counted)
    std = math.sqrt(sum((a - mean) ** 2 for a in counted) / (len(counted) - 1))
    ref = [[(a - mean) / math.sqrt(std**2 + 1e-8) * m for a, m in zip(row, mrow)]
           for row, mrow in zip(tiled(ref_grpo(False)).tolist(), GROUP_MASK)]
    torch.testing.assert_close(whitened, t(ref), rtol=0, atol=1e-10)


def test_informative_groups_and_the_overlong_penalty():
    scores = t([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.2, 0.2, 0.3])
    assert ppo.informative_groups(scores, 3).tolist() == [False, True, True]
    assert ppo.informative_groups(t([0.7, 0.7]), 1).tolist() == [False, False]  # a group of one never has signal
    # max_new_tokens 16, buffer 4: free up to 12 tokens, then -factor * excess / 4, -factor at 16.
    lengths = torch.tensor([3, 12, 13, 15, 16])
    assert ppo.overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.375, -0.5]
    assert ppo.overlong_penalty(lengths, 16, 0, 0.5).tolist() == [0.0] * 5


def test_the_estimator_registry_is_the_configs_domain_and_dispatches_to_the_formulas():
    from megatron_rlhf.config.names import ADVANTAGE_ESTIMATORS, CRITIC_ESTIMATORS

    assert set(ppo.ESTIMATORS) == set(ADVANTAGE_ESTIMATORS)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.5, 0.0, 0.0], [0.0, -1.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.1, 0.2], [0.0, 0.0, 0.0], [0.2, 0.2, 0.0]])
    group = torch.tensor([0, 0, 1, 1])
    x = ppo.EstimatorInputs(rewards, mask, values, group, gamma=0.9, lam=0.8, normalize_by_std=True)
    outcomes = torch.tensor([1.0, 2.0, 0.5, -1.0])
    expected = {
        "gae": ppo.gae_advantages(rewards, values, mask, 0.9, 0.8),
        "grpo": (ppo.grpo_advantages(outcomes, group, mask, True), None),
        "rloo": (ppo.rloo_advantages(outcomes, group, mask), None),
        "reinforce_plus_plus": (ppo.discounted_returns(rewards, mask, 0.9), None),
        "reinforce_plus_plus_baseline": (ppo.grpo_advantages(outcomes, group, mask, False), None),
    }
    for name, estimator in ppo.ESTIMATORS.items():
        advantages, returns = estimator.advantages(x)
        assert torch.equal(advantages, expected[name][0]), name
        assert (returns is None) == (name not in CRITIC_ESTIMATORS) and (returns is None or torch.equal(returns, expected[name][1]))
    # rloo by hand: group 0 (1.0, 2.0) -> -1.0, +1.0 at every response token
    assert ppo.ESTIMATORS["rloo"].advantages(x)[0][0].tolist() == [-1.0, -1.0, 0.0]
    assert [ppo.ESTIMATORS[n].whitened(w) for n in ("gae", "grpo", "reinforce_plus_plus") for w in (True, False)] == \
        [True, False, False, False, True, True]


def test_rollout_correction_weights_and_masks_are_the_formulas_on_hand_cases():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3], [0.4, 0.4, 0.1, 0.6]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.4, 0.3, 0.3], [0.1, 0.8, 0.1, 0.6]]))
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ratios = [[2.0, 0.5, 3.0, 1.0], [4.0, 0.5, 1.0, 1.0]]  # pi_old / pi_behaviour, by hand
    truncated = ppo.rollout_correction(old, behaviour, mask, "truncate", "token", (0.5, 2.0))
    expected = [[min(r, 2.0) if m else 1.0 for r, m in zip(rr, mm)] for rr, mm in zip(ratios, mask.tolist())]
    assert torch.allclose(truncated.weights, torch.tensor(expected), rtol=1e-6)
    assert torch.equal(truncated.keep, mask.float())
    # Sequence level: the product of the row's ratios (2 x 0.5 x 3 = 3; 4 x 0.5 = 2), capped, at every token.
    sequence = ppo.rollout_correction(old, behaviour, mask, "truncate", "sequence", (0.5, 2.5))
    assert torch.allclose(sequence.weights, torch.tensor([[2.5, 2.5, 2.5, 1.0], [2.0, 2.0, 1.0, 1.0]]), rtol=1e-6)
    # Mask: ratios outside [0.6, 2.5] leave the loss (0.5 below, 3 and 4 above); weights stay 1.
    masked = ppo.rollout_correction(old, behaviour, mask, "mask", "token", (0.6, 2.5))
    assert masked.keep.tolist() == [[1 if m and 0.6 <= r <= 2.5 else 0 for r, m in zip(rr, mm)]
                                    for rr, mm in zip(ratios, mask.tolist())]
    assert torch.equal(masked.weights, torch.ones_like(old))
    sums = ppo.mismatch_figures(old, behaviour, mask, masked)
    masked_tokens, tokens = sums["rollout/masked_share"]
    assert (float(masked_tokens), float(tokens)) == (4.0, 5.0)  # only the ratio 2 stays
    kl = sum(r - 1 - math.log(r) for rr, mm in zip(ratios, mask.tolist()) for r, m in zip(rr, mm) if m) / 5
    assert float(sums["rollout/behaviour_kl"][0]) / float(sums["rollout/behaviour_kl"][1]) == pytest.approx(kl, rel=1e-5)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_with_behaviour_equal_to_old_changes_nothing(mode, level):
    torch.manual_seed(0)
    old = torch.randn(6, 9) - 2
    mask = torch.tensor(MASK + [[1] * 5], dtype=torch.float).repeat(1, 2)[:, :9]
    correction = ppo.rollout_correction(old, old.clone(), mask, mode, level, (0.5, 2.0))
    assert torch.equal(correction.weights, torch.ones_like(old)) and torch.equal(correction.keep, mask)
    logp, adv = torch.randn(6, 9), torch.randn(6, 9)
    plain, _ = ppo.policy_loss_terms(logp, old, adv, 0.2, 0.2)
    weighed, _ = ppo.policy_loss_terms(logp, old, adv, 0.2, 0.2)
    assert torch.equal(ppo.aggregate_loss(weighed * correction.weights, correction.keep)[0],
                       ppo.aggregate_loss(plain, mask)[0])
