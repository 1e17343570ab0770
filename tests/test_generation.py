import pytest
import torch

from megatron_rlhf.generation import SamplingParams, filter_logits, right_pad, sample_next


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    from tests.conftest import run_workers

    return run_workers(tmp_path_factory.mktemp("gen"), 4, "generation_equivalence")


def test_cached_greedy_equals_argmax_of_the_full_forward(generated):
    r = generated[0]
    tp1 = r.greedy["tp1"]
    assert torch.equal(tp1.tokens, r.nocache.tokens) and torch.equal(tp1.response_lengths, r.nocache.response_lengths)
    assert tp1.response_lengths.tolist() == [6, 6, 6, 6]  # no EOS: every row runs to max_new_tokens
    assert torch.equal(r.tp1_left.tokens, tp1.tokens)
    assert torch.equal(r.tp1_wide.tokens, tp1.tokens)  # prompt tensors of any width


def test_a_kept_cache_across_turns_gives_the_tokens_of_prefilling_every_turn_and_feeds_less(generated):
    """Four turns with replies between them: the cache kept (every row in its slot; two slots for
    four rows, where rows take each other's slots; TP2 x PP2) against every prefix prefilled again."""
    prefilled, fed_again = generated[0].turns_prefilled
    kept, fed_kept = generated[0].turns_kept
    assert kept == prefilled and len(prefilled[1]) > 7 + 4 * 3
    assert fed_kept < fed_again / 2  # each turn feeds its reply and its own tokens only
    shared, fed_shared = generated[0].turns_kept_2_slots
    assert shared == prefilled and fed_kept < fed_shared < fed_again
    for rank_result in generated:
        assert rank_result.tp2_pp2_turns_kept[0] == prefilled


def test_turns_that_join_a_running_batch_give_the_tokens_of_turns_in_lockstep(generated):
    """An open run (generation/open_run.py): each row's next turn joins the running batch when its
    reply comes, after latencies that differ by row, in 4 or 2 slots, TP2 x PP2: the same tokens as
    every turn prefilled in lockstep, and a kept cache feeds less whenever slots allow."""
    prefilled, fed_again = generated[0].turns_prefilled
    for name, (rows, fed) in generated[0].turns_open.items():
        assert rows == prefilled, name
        assert fed < fed_again, name
    assert generated[0].turns_open["4_slots_delays_0000"][1] == generated[0].turns_kept[1]  # every turn resumed
    for rank_result in generated:
        assert rank_result.tp2_pp2_turns_open[0] == prefilled


@pytest.mark.parametrize("layout", ["tp2_pp1", "tp1_pp2", "tp2_pp2"])
def test_greedy_under_tp_and_pp_equals_tp1(generated, layout):
    for rank_result in generated:
        got, tp1 = rank_result.greedy[layout], rank_result.greedy["tp1"]
        assert torch.equal(got.tokens, tp1.tokens), layout
        assert torch.equal(got.response_lengths, tp1.response_lengths)


@pytest.mark.parametrize("layout", ["tp1", "tp2_pp1", "tp2_pp2"])
def test_vocab_parallel_log_probs_and_entropy_equal_the_full_softmax(generated, layout):
    """Over the tokenizer's vocabulary only (the padded rows of the output layer excluded)."""
    ref_logp, ref_entropy = generated[0].stats_reference
    checked = 0
    for rank_result in generated:
        got = rank_result.stats[layout]
        if got is None:  # not the last pipeline stage
            continue
        assert torch.allclose(got[0], ref_logp, atol=1e-5) and torch.allclose(got[1], ref_entropy, atol=1e-5)
        checked += 1
    assert checked >= 2


def test_rows_end_at_eos_and_are_padded_after(generated):
    r = generated[0]
    tokens, produced = r.tp1_eos.tokens, r.tp1_eos.response_lengths
    assert torch.equal(tokens, r.nocache_eos.tokens) and torch.equal(produced, r.nocache_eos.response_lengths)
    assert produced[0] == 3 and tokens[0, 3 + 2] == r.eos
    for row, n in enumerate([3, 7, 5, 1]):
        response = tokens[row, n : n + produced[row]]
        assert (response[:-1] != r.eos).all()  # the first EOS ends the row
        assert produced[row] == 6 or response[-1] == r.eos
        assert (tokens[row, n + produced[row] :] == 0).all()
    for rank_result in generated:
        assert torch.equal(rank_result.tp2_pp2_eos.tokens, tokens)
        # Decoded 3 rows at a time (generation.batch_size): the same rows, padded to one width.
        assert torch.equal(rank_result.tp2_pp2_eos_by_3.tokens, tokens)
        assert torch.equal(rank_result.tp2_pp2_eos_by_3.response_lengths, produced)


def test_a_decode_step_is_one_input_copy_then_device_work_at_bucketed_shapes(generated):
    """The rows decoded 3 at a time with EOS at TP2 x PP2 (checked above to give the one-batch
    tokens): each step that admits no prompt ran as the fixed-shape decode step."""
    for rank_result in generated:
        seen = rank_result.decode_steps
        assert seen["steps"] > 0 and seen["copies"] == seen["steps"]
        assert seen["host_reads"] == []  # nothing a CUDA graph could not replay
        # 3 slots: 1, 2 or 4 -> 3 rows; cache positions in buckets of 32 (the cache holds 13).
        assert seen["shapes"] and all(rows in (1, 2, 3) and extent in (13,) for rows, extent in seen["shapes"])


def test_the_engine_s_packed_linears_give_the_tokens_of_torch_s_and_are_megatron_s_again_after(generated):
    for rank_result in generated:
        assert torch.equal(rank_result.tp2_pp2_eos_packed.tokens, rank_result.tp2_pp2_eos.tokens)
        assert torch.equal(rank_result.tp2_pp2_eos_torch_linears.tokens, rank_result.tp2_pp2_eos.tokens)
        assert rank_result.megatron_products_restored
    # Per stage and step: 2 layers x (QKV, output projection, FC1, FC2), and the output layer on the last stage.
    assert all(r.packed_products > 0 for r in generated) and generated[-1].packed_products > generated[0].packed_products


def test_sampling_agrees_on_every_rank_and_stays_in_the_vocabulary(generated):
    tokens, produced = generated[0].sampled.tokens, generated[0].sampled.response_lengths
    for rank_result in generated[1:]:
        assert torch.equal(rank_result.sampled.tokens, tokens)
    assert tokens.max() < 100 and produced.tolist() == [8, 8, 8, 8]


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True, True]]
    probs = logits.exp()[0]  # 0.64, 0.24, 0.09, ...
    kept = ~torch.isinf(filter_logits(logits, top_p=0.8))[0]
    assert kept.tolist() == [True, True, False, False, False] and probs[:1].sum() < 0.8 <= probs[:2].sum()
    assert (~torch.isinf(filter_logits(logits, top_p=0.01))).sum() == 1  # the top token always stays


def test_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    params = SamplingParams(max_new_tokens=1, temperature=0.5, top_k=3)
    drawn = sample_next(logits, params, torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    freq = torch.bincount(drawn, minlength=4).float() / drawn.numel()
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 0.5, -1)
    assert freq[3] == 0 and torch.allclose(freq[:3], expected, atol=0.015)
    assert sample_next(logits[:2], SamplingParams(max_new_tokens=1, greedy=True)).tolist() == [0, 0]


def test_right_pad_moves_left_padded_prompts():
    left = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]])
    assert right_pad(left, torch.tensor([2, 4]), 0, "left").tolist() == [[5, 6, 0, 0], [7, 8, 9, 1]]
    with pytest.raises(ValueError, match="padding_side"):
        right_pad(left, torch.tensor([2, 4]), 0, "middle")


def test_greedy_equals_transformers_on_every_row_at_every_layout(tmp_path, workers):
    """A converted checkpoint generates what transformers' own greedy generate() does, row by row:
    prompts of 1 to 30 tokens, 3 decode slots for 8 prompts, an EOS that ends rows at spread lengths."""
    transformers = pytest.importorskip("transformers")
    from megatron_rlhf.checkpoint.convert import hf_to_megatron
    from tests.test_checkpoint_conversion import tiny_hf

    hf = tiny_hf(tmp_path / "hf", "lm")
    hf_to_megatron(str(tmp_path / "hf"), str(tmp_path / "mg"))
    lengths = [3, 17, 9, 1, 30, 12, 5, 24]
    prompts = torch.randint(3, 100, (8, 30), generator=torch.Generator().manual_seed(0))

    def hf_greedy(eos):
        rows = []
        for row, n in enumerate(lengths):
            out = hf.generate(prompts[row : row + 1, :n], attention_mask=torch.ones(1, n, dtype=torch.long), max_new_tokens=10,
                              do_sample=False, eos_token_id=eos, pad_token_id=0)[0, n:].tolist()
            rows.append(out[: out.index(eos) + 1] if eos is not None and eos in out else out)
        return rows

    transformers.logging.set_verbosity_error()
    with torch.no_grad():
        free_running = hf_greedy(None)
        eos = free_running[1][4]  # the token row 1 emits fifth ends rows wherever it first appears
        expected = hf_greedy(eos)
    assert len({len(r) for r in expected}) > 2  # response lengths are spread
    results = workers(4, "generation_vs_hf", str(tmp_path / "mg"), str(eos))
    for r in results:
        assert r.prompts[:, :30].masked_fill(torch.arange(30) >= torch.tensor(lengths)[:, None], 0).equal(
            prompts.masked_fill(torch.arange(30) >= torch.tensor(lengths)[:, None], 0))
        for layout in ("tp1_pp1", "tp2_pp1", "tp1_pp2", "tp2_pp2", "tp2_pp2_lag2"):
            g = r.greedy[layout]
            got = [g.tokens[row, n : n + int(g.response_lengths[row])].tolist() for row, n in enumerate(lengths)]
            assert got == expected, layout
            assert g.stats.useful == sum(len(e) for e in expected)
            # One forward per step; a prompt is fed once, then one token per decode step.
            assert g.stats.computed_tokens == sum(lengths) + g.stats.sampled - len(lengths)
        assert r.greedy["tp2_pp2_lag2"].stats.sampled > r.greedy["tp2_pp2"].stats.sampled  # ended rows ran on, unkept
