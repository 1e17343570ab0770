"""Batch-invariant mode (trainer.batch_invariant, models/batch_invariant.py): a row's numbers do not
depend on the rows beside it, and the engine's behaviour log-probs are the training forward's."""

import pytest
import torch

from megatron_rlhf.models import batch_invariant


def test_a_row_s_tokens_and_log_probs_do_not_depend_on_its_company_and_equal_the_trainer_s(workers):
    r = workers(1, "batch_invariance")[0]
    for precision, on in r.on.items():
        print(precision, on, r.off.get(precision))
        assert all(on["company_tokens_equal"]) and all(on["company_log_probs_equal"]), precision
        assert on["forward_row_alone_equals_in_batch"], precision
        assert on["behaviour_equals_training"] == on["rows"], precision
    # Without the mode the same rows' log-probs are not the trainer's bit for bit (what the mode is for).
    assert r.off["fp32"]["behaviour_equals_training"] < r.on["fp32"]["rows"]
    # Through the run's entry, rollout correction at the rollout's own weights reads exactly 1.
    on, off = r.grpo["true"], r.grpo["false"]
    assert on["rollout/behaviour_kl"] == 0.0 and on["rollout/is_weight_mean"] == 1.0
    assert off["rollout/behaviour_kl"] > 0.0
    # The agent game in bf16: the same trajectories and behaviour log-probs whatever the schedule.
    tokens, log_probs = r.game["overlap"]
    for schedule in ("lockstep", "2 slots"):
        assert torch.equal(r.game[schedule][0], tokens) and torch.equal(r.game[schedule][1], log_probs), schedule


def test_the_mode_is_refused_by_name_where_its_arithmetic_is_not_shown(tmp_path):
    import pytest

    from megatron_rlhf.config import ConfigError, load_config
    from tests.test_config import tiny_setup

    ok = load_config(str(tiny_setup(tmp_path, "trainer: {batch_invariant: true}\n")), world_size=1)
    assert ok.trainer.batch_invariant
    # Its LM heads compute whole logits (their own product), whatever logprob_chunk_tokens says.
    assert ok.ppo_policy.logprob_chunk_tokens == 1024 and ok.logprob_chunk_tokens("ppo_policy") == 0
    top = "trainer: {batch_invariant: true}\nparallel: {tensor_model_parallel_size: 2}\n"
    with pytest.raises(ConfigError) as err:
        load_config(str(tiny_setup(tmp_path, top, "attention: local\nlora: {rank: 4}\n")), world_size=2)
    text = str(err.value)
    assert "trainer.batch_invariant: true needs TP=1 (policy runs at TP=2)" in text
    assert "trainer.batch_invariant: true needs ppo_policy.attention: fused" in text
    assert "trainer.batch_invariant: true does not cover LoRA's adapter products (ppo_policy has adapters)" in text


@pytest.mark.parametrize("one_call", [True, False])
def test_row_blocks_and_key_blocks_give_a_row_its_own_arithmetic(monkeypatch, one_call):
    """The two kernels alone, against plain torch: a row of a linear computed alone and beside 1..63
    others (the rows in one call of at least ROW_BLOCK, as the probe finds this machine's GEMM; and
    block by block, where a machine's is not), and the attention of a query over one key block and
    over several, alone and in company."""
    monkeypatch.setattr(batch_invariant, "_rows_alike", lambda k, n, dtype: one_call)
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        weight, rows = torch.randn(300, 128, dtype=dtype), torch.randn(64, 128, dtype=dtype)
        alone = batch_invariant.row_blocked_linear(rows[:1], weight, None)
        for others in (1, 7, 15, 16, 63):
            assert torch.equal(batch_invariant.row_blocked_linear(rows[: others + 1], weight, None)[:1], alone)
        assert torch.allclose(alone.float(), (rows[:1].float() @ weight.float().t()), rtol=2e-2, atol=2e-1)
    keys, values = torch.randn(8, 2, 192, 16), torch.randn(8, 2, 192, 16)
    query, positions = torch.randn(8, 8, 16), torch.tensor([150, 3, 64, 191, 0, 100, 77, 128])
    reference = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, None], keys.repeat_interleave(4, 1), values.repeat_interleave(4, 1),
        attn_mask=batch_invariant.allowed_keys(positions, 192)[:, None, None, :])[:, :, 0]
    for length, max_block in ((192, 1024), (192, 64)):  # one block of 192; blocks of 64
        batch_invariant.MAX_KEY_BLOCK, before = max_block, batch_invariant.MAX_KEY_BLOCK
        try:
            with batch_invariant.batch_invariant(length):
                together = batch_invariant.attention(query, keys, values, None, positions, 0.25)
                for i in range(8):
                    alone = batch_invariant.attention(query[i : i + 1], keys[i : i + 1], values[i : i + 1], None,
                                                      positions[i : i + 1], 0.25)
                    assert torch.equal(alone, together[i : i + 1]), (max_block, i)
        finally:
            batch_invariant.MAX_KEY_BLOCK = before
        assert torch.allclose(together, reference, atol=1e-5)  # the attention it stands for (scale 1/sqrt(16))


def test_a_sliding_window_is_the_same_band_in_the_mode():
    """Megatron's window (tokens before, tokens after) in the mode's attention: each query reads only
    the keys of its band, as torch's attention with that band does, alone or in company."""
    from megatron_rlhf.generation.packing import visible
    from megatron_rlhf.models.attention import window_band

    torch.manual_seed(1)
    keys, values, query = torch.randn(1, 2, 128, 16), torch.randn(1, 2, 128, 16), torch.randn(100, 8, 16)
    positions, window = torch.arange(100), (7, 0)
    reference = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.repeat_interleave(4, 1), values.repeat_interleave(4, 1),
        attn_mask=batch_invariant.allowed_keys(positions, 128, window)[None, None])[0].transpose(0, 1)
    # The trainer's band (models/attention.window_band) and the engine's (generation/packing.visible).
    assert torch.equal(batch_invariant.allowed_keys(positions, 128, window)[:, :100], window_band(100, 100, window, "cpu"))
    assert torch.equal(batch_invariant.allowed_keys(positions, 128, window), visible(positions, 128, window[0]))
    with batch_invariant.batch_invariant(128):
        rows = torch.zeros(100, dtype=torch.long)
        together = batch_invariant.attention(query, keys, values, rows, positions, 0.25, window)
        alone = batch_invariant.attention(query[60:61], keys, values, rows[:1], positions[60:61], 0.25, window)
    assert torch.equal(alone, together[60:61])
    assert torch.allclose(together, reference, atol=1e-5)
