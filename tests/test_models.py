import math

import pytest
import torch

from tests.conftest import ON_GPU

TOL = 1e-5


def check_equivalence(results, layouts):
    for head in ("lm", "scalar"):
        for layout in layouts:
            key = (head, layout)
            diffs = [r.errors[key] for r in results if r.errors[key] is not None]
            assert diffs, f"{key}: no rank held the last pipeline stage"
            assert max(diffs) <= TOL, f"{key}: max abs diff {max(diffs)} > {TOL}"
            assert all(r.round_trips[key] for r in results), f"{key}: shards do not merge back"


def test_tp_pp_models_equal_the_tp1_model_and_bf16_trains(workers):
    results = workers(4, "models_equivalence")
    check_equivalence(results, ("tp2_pp1", "tp1_pp2", "tp2_pp2"))
    losses = [r.bf16_losses for r in results if r.bf16_losses]
    assert losses and all(math.isfinite(x) for x in losses[0])
    assert losses[0][-1] < losses[0][0] - 0.1, f"bf16 loss did not fall: {losses[0]}"
    assert results[0].bf16_param_dtype == "torch.bfloat16"


@pytest.mark.gpu(4)
def test_equivalence_on_gpu_with_nccl_and_sequence_parallel(workers):
    results = workers(4, "models_equivalence", "sp", env=ON_GPU)
    check_equivalence(results, ("tp2_pp1", "tp2_pp1_sp", "tp1_pp2", "tp2_pp2"))


@pytest.fixture(scope="module")
def dp1_steps(tmp_path_factory):
    """One process's steps of every variant the tests below compare against (one launch)."""
    from tests.conftest import run_workers

    return run_workers(tmp_path_factory.mktemp("dp1"), 1, "dp_step", "dist", "local", "dist+recompute",
                       "dist+local_attention")[0]


def test_dp2_training_step_equals_dp1_on_the_same_global_batch(workers, dp1_steps):
    import torch

    dp2 = workers(2, "dp_step", "dist", "local")
    assert dp1_steps.dp == 1 and dp2[0].dp == 2
    for optimizer in ("dist", "local"):
        for rank_result in dp2:
            for name, expected in dp1_steps.runs[optimizer].params.items():
                got = rank_result.runs[optimizer].params[name]
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=f"{optimizer}: {name}")
        # The steps really moved the weights (not a comparison of untouched initial values).
        assert dp1_steps.runs[optimizer].moved > 1e-4


def test_activation_recompute_trains_as_without(dp1_steps):
    """Full recomputation (megatron's CheckpointFunction, RNG states saved and restored) on CPU."""
    import torch

    plain, recomputed = dp1_steps.runs["dist"], dp1_steps.runs["dist+recompute"]
    assert plain.recompute is None and recomputed.recompute == "full"
    for name, expected in plain.params.items():
        torch.testing.assert_close(recomputed.params[name], expected, rtol=0, atol=1e-6, msg=name)
    assert recomputed.moved > 1e-4


def test_fused_attention_trains_as_megatrons_local_attention(dp1_steps):
    """The default core attention (torch's scaled_dot_product_attention, models/attention.py)
    against megatron's DotProductAttention: three Adam steps from the same weights. Their gradient
    norms agree to fp32 rounding; the weights to 2e-5 of the 3e-3 that three steps at lr 1e-3 can move
    a weight (Adam turns rounding-sized differences of near-zero gradients into sign flips)."""
    import torch

    fused, local = dp1_steps.runs["dist"], dp1_steps.runs["dist+local_attention"]
    assert (fused.core_attention, local.core_attention) == ("FusedCoreAttention", "DotProductAttention")
    assert fused.grad_norms == pytest.approx(local.grad_norms, rel=1e-6)
    for name, expected in local.params.items():
        torch.testing.assert_close(fused.params[name], expected, rtol=0, atol=2e-5, msg=name)
    assert fused.moved > 1e-4


def test_fused_attention_keeps_no_score_matrix_in_the_planner():
    """The planner's activations: the s x s scores only under megatron's local attention."""
    from megatron_rlhf.config.presets import PRESETS
    from megatron_rlhf.config.schema import ModelArchConfig
    from megatron_rlhf.memory.planner import activation_bytes

    arch = ModelArchConfig(**PRESETS["tiny"])
    def grows(attention):  # doubling the sequence: linear terms double, s x s terms quadruple
        one, two = (activation_bytes(arch, "scalar", 2, s, 1, 1, "fp32", False, True, attention=attention)
                    for s in (1024, 2048))
        return two / one
    assert grows("fused") == pytest.approx(2.0) and grows("local") > 3.0


def test_the_scalar_head_computes_in_fp32_from_bf16_weights():
    from megatron_rlhf.config.presets import PRESETS
    from megatron_rlhf.config.schema import ModelArchConfig, ParallelConfig
    from megatron_rlhf.models.decoder import ScalarHead, make_transformer_config

    config = make_transformer_config(ModelArchConfig(**PRESETS["tiny"]), ParallelConfig(), "bf16")
    head = ScalarHead(config, 64)
    hidden = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 4
    values, _ = head(hidden)
    assert head.weight.dtype == torch.bfloat16 and values.dtype == torch.float32
    assert torch.equal(values, hidden.float() @ head.weight.float().t())


def test_micro_batches_packed_by_tokens_hold_as_many_rows_as_fit_and_a_row_too_long_is_refused():
    import torch

    from megatron_rlhf.models.batches import token_packed

    lengths = torch.tensor([3, 9, 5, 9, 2, 4, 7])
    tokens = torch.arange(7 * 10).reshape(7, 10)
    mbs, order = token_packed(20, lengths, tokens=tokens, action_mask=torch.ones(7, 9))
    # Longest first: 9, 9 (2 x 9 <= 20), then 7, 5 (2 x 7), then 4, 3, 2 (3 x 4 <= 20; 5 x 4 would not fit).
    assert [mb["tokens"].shape for mb in mbs] == [(2, 9), (2, 7), (3, 4)]
    assert order.tolist() == [1, 3, 6, 2, 5, 0, 4] and all(mb["action_mask"].shape[1] == mb["tokens"].shape[1] - 1 for mb in mbs)
    assert sum(mb["tokens"].shape[0] * mb["tokens"].shape[1] <= 20 for mb in mbs) == 3
    with pytest.raises(ValueError, match="a row of 9 tokens does not fit in max_tokens_per_micro_batch=8"):
        token_packed(8, lengths, tokens=tokens)
    # Under pipeline parallelism every micro-batch has the same rows: the most that divide the 7 rows
    # and keep the longest (9) within the budget: 7 x 9 = 63 <= 70, one micro-batch; 20: one row each.
    assert [mb["tokens"].shape[0] for mb in token_packed(70, lengths, equal_rows=True, tokens=tokens)[0]] == [7]
    assert [mb["tokens"].shape[0] for mb in token_packed(20, lengths, equal_rows=True, tokens=tokens)[0]] == [1] * 7


def test_length_grouped_micro_batches_are_trimmed_and_come_back_in_row_order():
    from megatron_rlhf.models.batches import length_grouped, ungrouped

    lengths = torch.tensor([3, 9, 2, 9, 5, 1])
    tokens = torch.arange(6 * 10).view(6, 10)
    per_action = torch.randn(6, 9)
    batches, order = length_grouped(2, lengths, tokens=tokens, per_action=per_action, row=torch.arange(6))
    assert order.tolist() == [1, 3, 4, 0, 2, 5]  # longest first, ties in row order
    assert [tuple(mb["tokens"].shape) for mb in batches] == [(2, 9), (2, 5), (2, 2)]
    assert [tuple(mb["per_action"].shape) for mb in batches] == [(2, 8), (2, 4), (2, 1)]
    assert torch.equal(batches[1]["tokens"], tokens[[4, 0], :5]) and batches[2]["row"].tolist() == [2, 5]
    back = ungrouped([mb["per_action"] for mb in batches], order, 9)
    kept = torch.arange(9) < (lengths - 1).clamp(min=1)[:, None]  # each row's real action positions survive
    assert torch.equal(back[kept], per_action[kept]) and (back[0, 4:] == 0).all() and (back[5, 1:] == 0).all()
    assert torch.equal(ungrouped([mb["row"] for mb in batches], order, 0), torch.arange(6))


def test_rope_computes_megatrons_numbers_bit_for_bit():
    """megatron_compat/rope.py's RoPE (cosines once per angle tensor, no copy onto an empty
    unrotated part) against megatron's own function: whole and partial rotary dims, fp32 and
    bf16, new angles and angles changed in place."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rlhf.runtime.megatron_compat import rope

    rope.bind_rope()
    megatrons = rope._megatrons
    assert rope_utils._apply_rotary_pos_emb_bshd is rope.apply_rope_bshd and megatrons is not rope.apply_rope_bshd
    g = torch.Generator().manual_seed(0)
    for dim, rot, dtype in ((16, 16, torch.float32), (16, 8, torch.float32), (16, 16, torch.bfloat16)):
        freqs = torch.randn(7, 1, 1, rot, generator=g) * 3
        for _ in range(2):
            for heads in (4, 2):  # the queries, then the keys: the same angles
                t = torch.randn(7, 3, heads, dim, generator=g).to(dtype)
                assert torch.equal(rope.apply_rope_bshd(t, freqs), megatrons(t, freqs))
            freqs.mul_(0.5)  # changed in place: its cosines are computed again


def test_megatrons_local_attention_is_refused_where_transformer_engine_brings_its_own(monkeypatch):
    """attention: local asks for megatron's unfused attention; with transformer-engine installed the
    layers are its own, so the key would be silently ignored: refused by name instead."""
    from megatron_rlhf.config.presets import PRESETS
    from megatron_rlhf.config.schema import ModelArchConfig
    from megatron_rlhf.models import decoder

    class WithTransformerEngine:
        has_transformer_engine = True

    monkeypatch.setattr(decoder, "get_platform", lambda: WithTransformerEngine())
    with pytest.raises(ValueError, match="attention: local: transformer-engine is installed"):
        decoder.layer_spec(ModelArchConfig(**PRESETS["tiny"]), None, attention="local")


def test_log_probs_entropy_and_their_backward_in_chunks_equal_whole_logits(workers):
    """GRPO's policy loss and an inference pass from whole logits and 3 tokens at a time (chunks
    that cut rows), at TP=1, TP=2 (vocabulary shards: the chunk's softmax over both) and PP=2 (the
    head on the last stage), a tied LM head too: the log-probs within 2e-7 relative (the head's product
    over fewer rows may round the last bit otherwise), every gradient within 1e-6 (a chunk's weight
    gradient is summed chunk by chunk), and the second step's loss, statistics and gradient norm, from
    the first step's update, within 1e-5."""
    import torch

    one = workers(1, "chunked_log_probs", "tp1", "tp1+tied")[0].runs
    two = workers(2, "chunked_log_probs", "tp2", "pp2", "tp2+tied")
    for layout, ranks in [("tp1", [one]), ("tp1+tied", [one]), *[(l, [r.runs for r in two]) for l in ("tp2", "pp2", "tp2+tied")]]:
        for rank, runs in enumerate(ranks):
            whole, chunked = runs[(layout, 0)], runs[(layout, 3)]
            where = f"{layout}, rank {rank}"
            assert whole.chunked in (0, None) and chunked.chunked in (3, None), where
            for a, b in zip(whole.inference, chunked.inference):
                torch.testing.assert_close(b, a, rtol=2e-7, atol=0, msg=f"{where}: inference log-probs")
            for name, grad in whole.grads.items():
                torch.testing.assert_close(chunked.grads[name], grad, rtol=1e-6, atol=1e-7, msg=f"{where}: {name}")
            for i, (a, b) in enumerate(zip(whole.metrics, chunked.metrics)):
                bound = 1e-6 if i < 2 else 1e-5  # the second step's: after Adam's update, which scales each gradient to ~1
                for name in a:
                    assert b[name] == pytest.approx(a[name], rel=bound, abs=1e-7), f"{where}: {name}"
            assert chunked.grad_norms[0] == pytest.approx(whole.grad_norms[0], rel=1e-6), where
            assert chunked.grad_norms[1] == pytest.approx(whole.grad_norms[1], rel=1e-5), where
    last_stage = two[1].runs[("pp2", 3)]
    assert last_stage.chunked == 3 and last_stage.inference and not two[0].runs[("pp2", 3)].inference
    assert one[("tp1", 3)].metrics[0]["entropy"] > 0 and one[("tp1", 3)].grad_norms[0] > 0
