"""The generation engine's parts on their own: the host schedule (admission, refills, end tokens
learnt late), the step layout, and the packed attention against per-prompt attention."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.generation.kv_cache import _decode, _prefill, _prefill_after
from megatron_rlhf.generation.packing import pack_step, prefill_groups
from megatron_rlhf.generation.schedule import FREE, SlotSchedule


def run(schedule, ends_at=None, lag=0):
    """Drive ``schedule`` to the end; ``ends_at[row]``: the draw at which the row emits an end
    token. Returns each step's (admitted rows, decoding rows) and the draws each row made."""
    ends_at = ends_at or {}
    steps, draws = [], {}
    alive = [True] * len(schedule.row_in)
    while (step := schedule.next_step(lag)) is not None:
        steps.append(([schedule.row_in[s] for s in step.admitted], [schedule.row_in[s] for s in step.decoding]))
        for slot, row, counter in zip(step.slots, step.rows, step.counters):
            if slot in step.admitted:
                alive[slot] = True
            draws.setdefault(row, []).append(counter)
            if ends_at.get(row) == counter:
                alive[slot] = False
        schedule.note_alive(lambda flags=list(alive): flags)
    return steps, draws


def test_rows_are_admitted_in_order_and_freed_slots_refill_at_the_next_step():
    schedule = SlotSchedule([4, 2, 3, 5, 1], slots=2, max_new_tokens=3, prefill_tokens=100)
    steps, draws = run(schedule)
    assert steps[0] == ([0, 1], [])
    assert steps[1] == ([], [0, 1]) and steps[2] == ([], [0, 1])  # three draws each, then both leave
    assert steps[3] == ([2, 3], [])
    assert steps[6] == ([4], [])
    assert all(d == [0, 1, 2] for d in draws.values()) and schedule.drained
    assert len(steps) == 9 and schedule.row_in == [FREE, FREE]


def test_the_prefill_budget_defers_prompts_but_never_starves_a_long_one():
    schedule = SlotSchedule([6, 5, 20, 1], slots=4, max_new_tokens=2, prefill_tokens=10)
    steps, _ = run(schedule)
    assert steps[0] == ([0], [])  # 6 + 5 > 10: row 1 waits although slots are free
    assert steps[1] == ([1], [0])
    assert steps[2] == ([2], [1])  # 20 > 10, admitted alone
    assert steps[3] == ([3], [2])


def test_an_end_token_frees_the_slot_as_soon_as_it_is_known():
    schedule = SlotSchedule([3, 3, 3], slots=2, max_new_tokens=5, prefill_tokens=100)
    steps, draws = run(schedule, ends_at={0: 1})
    assert draws[0] == [0, 1] and steps[2] == ([2], [1])


def test_an_end_learnt_late_costs_unkept_draws_and_changes_nothing_else():
    on_time = run(SlotSchedule([3, 3, 3], 2, 5, 100), ends_at={0: 1})[1]
    schedule = SlotSchedule([3, 3, 3], 2, 5, 100)
    steps, late = run(schedule, ends_at={0: 1}, lag=2)
    assert on_time[0] == [0, 1] and late[0] == [0, 1, 2]  # one more draw before the host knows (unkept)
    assert late[1] == on_time[1] and late[2] == on_time[2]
    assert steps[3] == ([2], [1]) and schedule.drained


def test_an_end_learnt_too_late_costs_draws_up_to_max_new_tokens_and_the_run_still_ends():
    schedule = SlotSchedule([2, 2], 2, 3, 100)
    steps, draws = run(schedule, ends_at={1: 0}, lag=5)
    assert draws == {0: [0, 1, 2], 1: [0, 1, 2]} and len(steps) == 3 and schedule.drained


def test_prompts_of_one_length_share_a_prefill_call():
    assert prefill_groups([8, 5, 8, 3, 5, 8]) == [[0, 2, 5], [1, 4], [3]]
    assert prefill_groups([8, 5, 8, 8], offsets=[0, 0, 4, 0]) == [[0, 3], [1], [2]]


def test_a_row_whose_prefix_a_slot_holds_waits_for_that_slot_and_feeds_only_the_rest():
    """Row 0's first 3 tokens are in slot 1; rows 1 and 2 have no home. Slot 0 (nobody's home)
    takes row 1, slot 1 row 0 (3 cached positions); row 2 takes the first slot freed."""
    schedule = SlotSchedule([5, 4, 6], slots=2, max_new_tokens=[2, 2, 1], prefill_tokens=100, homes=[1, None, None],
                            cached=[3, 0, 0])
    first = schedule.next_step()
    assert first.admitted == [0, 1] and first.rows == [1, 0] and first.cached == [0, 3]
    steps, draws = run(schedule)
    assert steps[1] == ([2], []) and draws[2] == [0]
    assert schedule.served == [2, 0]  # what each slot's cache holds now


def test_a_homeless_row_never_takes_a_slot_a_waiting_row_calls_home():
    schedule = SlotSchedule([2, 2], slots=2, max_new_tokens=1, prefill_tokens=100, homes=[None, 0], cached=[0, 1])
    step = schedule.next_step()
    assert step.admitted == [0, 1] and step.rows == [1, 0] and step.cached == [1, 0]


@pytest.mark.parametrize("window", [None, 2])
def test_a_prompt_fed_after_cached_positions_attends_to_them_and_to_itself(window):
    """Two prompts fed after 4 and 6 positions their slots (1, 3) already hold, one whole prompt
    (slot 0): against SDPA over each slot's positions."""
    gen = torch.Generator().manual_seed(0)
    lengths, slots, offsets = [2, 3, 3], [1, 3, 0], [4, 6, 0]
    layout = pack_step(lengths, slots, [], [], torch.zeros(32, 1, 1, 8), window, torch.float32, torch.device("cpu"),
                       prompt_offsets=offsets)
    assert layout.positions.tolist() == [4, 5, 6, 7, 8, 0, 1, 2]
    q, k, v = (torch.randn(8, heads, 8, generator=gen) for heads in (4, 2, 2))
    cache_k, cache_v = torch.randn(4, 2, 16, 8, generator=gen), torch.randn(4, 2, 16, 8, generator=gen)
    cache_k[layout.slots, :, layout.positions], cache_v[layout.slots, :, layout.positions] = k, v  # attend()'s write
    out = torch.full_like(q, float("nan"))
    for group in layout.prefill:
        if group.offset:
            _prefill_after(q, cache_k, cache_v, group, None, out)
        else:
            _prefill(q, k, v, group, None, out)
    start = 0
    for n, slot, offset in zip(lengths, slots, offsets):
        positions = offset + torch.arange(n)
        allowed = (positions[:, None] >= torch.arange(offset + n)) & (
            True if window is None else positions[:, None] - torch.arange(offset + n) <= window)
        expected = F.scaled_dot_product_attention(q[start : start + n].transpose(0, 1), cache_k[slot, :, : offset + n],
                                                  cache_v[slot, :, : offset + n], attn_mask=allowed, enable_gqa=True)
        assert torch.allclose(out[start : start + n], expected.transpose(0, 1), atol=1e-6)
        start += n


@pytest.mark.parametrize("window", [None, 3])
def test_packed_attention_equals_attention_of_each_prompt_and_slot_alone(window):
    """5 prompts (two of one length: one call) and 3 decode tokens of slots 4, 6, 7 (slot 5
    admitted this step, inside the span read), 4 query heads over 2 kv heads, against SDPA per
    prompt and per slot over exactly its own positions."""
    gen = torch.Generator().manual_seed(0)
    lengths, decode_slots, decode_positions = [7, 3, 9, 3, 1], [4, 6, 7], [5, 11, 2]
    prompt_slots = [0, 1, 2, 3, 5]
    layout = pack_step(lengths, prompt_slots, decode_slots, decode_positions, torch.zeros(32, 1, 1, 8), window,
                       torch.float32, torch.device("cpu"))
    assert any(g.span is None for g in layout.prefill) and len(layout.prefill) < len(lengths)
    total = sum(lengths) + len(decode_slots)
    assert layout.positions.tolist() == [p for n in lengths for p in range(n)] + decode_positions
    assert layout.slots.tolist() == [s for s, n in zip(prompt_slots, lengths) for _ in range(n)] + decode_slots
    q, k, v = (torch.randn(total, heads, 8, generator=gen) for heads in (4, 2, 2))
    cache_k, cache_v = torch.randn(8, 2, 16, 8, generator=gen), torch.randn(8, 2, 16, 8, generator=gen)
    out = torch.full_like(q, float("nan"))
    for group in layout.prefill:
        _prefill(q, k, v, group, None, out)
    out[layout.decode_start :] = _decode(q[layout.decode_start :], cache_k, cache_v, layout, None)

    def alone(q_, k_, v_, query_positions):
        allowed = (query_positions[:, None] >= torch.arange(k_.shape[1])) & (
            True if window is None else query_positions[:, None] - torch.arange(k_.shape[1]) <= window)
        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=allowed, enable_gqa=True)

    start = 0
    for n in lengths:
        expected = alone(*(t[start : start + n].transpose(0, 1) for t in (q, k, v)), torch.arange(n)).transpose(0, 1)
        assert torch.allclose(out[start : start + n], expected, atol=1e-6)
        start += n
    for i, (slot, position) in enumerate(zip(decode_slots, decode_positions)):
        expected = alone(q[start + i][:, None], cache_k[slot, :, : position + 1], cache_v[slot, :, : position + 1],
                         torch.tensor([position]))
        assert torch.allclose(out[start + i], expected[:, 0], atol=1e-6)


@pytest.mark.parametrize("window", [None, 3])
def test_a_decode_step_at_its_bucket_s_shapes_attends_as_its_decoding_slots_alone(window):
    """Slots 1 and 4 of 6 decode (positions 9 and 2): the step computes 8 -> 6 rows over 32 -> 20
    cache positions; the decoding rows equal SDPA over exactly their own positions, the others
    write into the scratch slot and see position 0 only."""
    from megatron_rlhf.generation.decode import decode_layout, extent_bucket, rows_bucket

    assert [rows_bucket(s, 6) for s in range(6)] == [1, 2, 4, 4, 6, 6]
    assert [extent_bucket(n, 100) for n in (1, 32, 33, 99)] == [32, 32, 64, 100]
    rows, extent, scratch = rows_bucket(4, 6), extent_bucket(10, 20), 6
    decoding = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.bool)
    positions = torch.tensor([0, 9, 0, 0, 2, 0])
    layout = decode_layout(positions, decoding, scratch, torch.randn(20, 1, 1, 8), window, extent, torch.float32)
    assert layout.slots.tolist() == [6, 1, 6, 6, 4, 6] and layout.decode_span == (0, 6) and not layout.prefill
    seen = layout.decode_bias[:, 0, 0] == 0
    assert seen[[0, 2, 3, 5]].sum(-1).tolist() == [1, 1, 1, 1] and seen[[0, 2, 3, 5], 0].all()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, 4, 8, generator=gen)
    cache_k, cache_v = torch.randn(7, 2, 20, 8, generator=gen), torch.randn(7, 2, 20, 8, generator=gen)
    out = _decode(q, cache_k, cache_v, layout, None)
    for slot in (1, 4):
        position = int(positions[slot])
        first = 0 if window is None else max(0, position - window)
        expected = F.scaled_dot_product_attention(q[slot][:, None], cache_k[slot, :, first : position + 1],
                                                  cache_v[slot, :, first : position + 1], enable_gqa=True)
        assert torch.allclose(out[slot], expected[:, 0], atol=1e-6)


def test_the_engine_refuses_by_name_the_layer_switches_its_step_does_not_model():
    from types import SimpleNamespace

    from megatron_rlhf.generation.stage import PipelineStage, unmodelled

    plain = SimpleNamespace(apply_residual_connection_post_layernorm=False, fp32_residual_connection=False,
                            rotary_interleaved=False, multi_latent_attention=False, mtp_num_layers=None)
    assert unmodelled(plain) == []
    post_norm = SimpleNamespace(**{**vars(plain), "apply_residual_connection_post_layernorm": True, "mtp_num_layers": 1})
    assert unmodelled(post_norm) == ["apply_residual_connection_post_layernorm", "mtp_num_layers"]
    with pytest.raises(ValueError, match="does not model apply_residual_connection_post_layernorm, mtp_num_layers"):
        PipelineStage(SimpleNamespace(config=post_norm), cache=None)

