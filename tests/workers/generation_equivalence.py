"""Greedy generation with the KV cache under TP=2, PP=2 and TP2xPP2 equals TP=1, and TP=1 equals
step-by-step argmax of the full forward without a cache. Also: left-padded prompts, EOS, and
sampling that agrees across TP ranks. Run with 4 processes."""

import contextlib
import os
from unittest import mock

import torch
from common import save, setup, tiny_arch
from tests.workers.findings import Generated, GenerationEquivalence
from megatron.core import parallel_state as ps

from megatron_rlhf.generation import CacheSession, OpenRun, SamplingParams, generate
from megatron_rlhf.models.decoder import build_model, load_local_state_dict, local_state_dict
from megatron_rlhf.models.pipeline import forward_backward, gather_vocab_parallel
from megatron_rlhf.models.sharding import merge_state_dicts, shard_state_dict
from megatron_rlhf.models.vocab_parallel import token_entropy, token_log_probs
from megatron_rlhf.runtime import cpu_linears

VOCAB = 100
arch = tiny_arch(vocab_size=VOCAB)
gen = torch.Generator().manual_seed(0)
lengths = torch.tensor([3, 7, 5, 1])
prompts = torch.randint(3, VOCAB, (4, 7), generator=gen)
for row, n in enumerate(lengths.tolist()):
    prompts[row, n:] = 0  # right padding
left = torch.zeros_like(prompts)
for row, n in enumerate(lengths.tolist()):
    left[row, 7 - n :] = prompts[row, :n]
GREEDY = SamplingParams(max_new_tokens=6, greedy=True, pad_id=0)


def argmax_without_cache(model, params):
    """Lockstep decoding where every step runs the full forward over the whole prefix."""
    width = int(lengths.max()) + params.max_new_tokens
    tokens = torch.zeros(4, width, dtype=torch.long)
    tokens[:, :7] = prompts
    done = torch.zeros(4, dtype=torch.bool)
    produced = torch.zeros(4, dtype=torch.long)
    for position in range(int(lengths.min()), width):
        logits = gather_vocab_parallel(forward_backward(model, [{"tokens": tokens[:, :position]}])[0]["output"])
        nxt = logits[:, -1, :VOCAB].argmax(-1)
        for row in range(4):
            if position < lengths[row]:
                continue
            if done[row]:
                continue
            tokens[row, position] = nxt[row]
            produced[row] += 1
            if produced[row] >= params.max_new_tokens or int(nxt[row]) in params.eos_ids:
                done[row] = True
        if done.all():
            break
    used = int((lengths + produced).max())
    return Generated(tokens=tokens[:, :used], response_lengths=produced)


def stats(model):
    """Log-probs of the next token and entropies at temperature 0.7, over the tokenizer's vocabulary
    only, computed on vocab-parallel logits (last stage; None elsewhere)."""
    out = forward_backward(model, [{"tokens": prompts}])
    if not out:
        return None
    logits = out[0]["output"]
    return token_log_probs(logits, torch.roll(prompts, -1, 1), VOCAB, 0.7), token_entropy(logits, VOCAB, 0.7)


def turns(model, session_slots=None):
    """Four turns of greedy generation per row (each row's own limit), a fixed reply of 1-4 tokens
    appended after each; every turn's prefix prefilled again, or (``session_slots``) its new
    tokens only, the cache kept in that many slots. Returns each row's tokens, and the tokens fed."""
    replies = torch.randint(3, VOCAB, (4, 4, 4), generator=torch.Generator().manual_seed(1))
    rows = [prompts[r, :n].tolist() for r, n in enumerate(lengths.tolist())]
    fed = 0
    session = CacheSession(session_slots, 64) if session_slots else None
    for turn in range(4):
        width = max(map(len, rows))
        batch = torch.tensor([row + [0] * (width - len(row)) for row in rows])
        g = generate(model, batch, torch.tensor([len(row) for row in rows]), GREEDY, VOCAB, max_new_tokens=[2, 3, 1, 3],
                     cache_length=64, session=session, keys=list(range(4)) if session else None)
        fed += g.stats.computed_tokens
        for r, row in enumerate(rows):
            row += g.tokens[r, len(row) : len(row) + int(g.response_lengths[r])].tolist()
            row += replies[r, turn, : 1 + (r + turn) % 4].tolist()
    if session is not None:
        session.close()
    return rows, fed


def open_turns(model, slots, delays):
    """turns()' four turns in an open run: row r's next turn joins ``delays[r]`` engine steps
    after its turn ended (its reply's latency), so rows come back in another order and join a
    running batch. Returns each row's tokens, and the tokens fed."""
    replies = torch.randint(3, VOCAB, (4, 4, 4), generator=torch.Generator().manual_seed(1))
    rows = [prompts[r, :n].tolist() for r, n in enumerate(lengths.tolist())]
    limits, turn = [2, 3, 1, 3], [0] * 4
    due, steps = dict.fromkeys(range(4), 0), 0  # row -> the engine step its next turn joins at
    session = CacheSession(slots, 64)
    with OpenRun(model, GREEDY, VOCAB, session) as run:
        while due or run.busy:
            joining = sorted(r for r, at in due.items() if at <= steps)
            if joining:
                run.add(joining, [rows[r] for r in joining], [limits[r] for r in joining], torch.tensor(joining))
                for r in joining:
                    del due[r]
            steps += 1
            for r, ids, _ in run.step():
                rows[r] += ids
                rows[r] += replies[r, turn[r], : 1 + (r + turn[r]) % 4].tolist()
                turn[r] += 1
                if turn[r] < 4:
                    due[r] = steps + delays[r]
    session.close()
    return rows, run.stats.computed_tokens


def as_record(g) -> Generated:
    return Generated(tokens=g.tokens.cpu(), response_lengths=g.response_lengths.cpu())


def counting_packed_products():
    """Counts the engine's products on packed weights (runtime/cpu_linears.py) in ``counted[0]``."""
    counted, matmul = [0], cpu_linears.PackedWeights.matmul

    def counting(self, *args):
        counted[0] += 1
        return matmul(self, *args)

    return counted, mock.patch.object(cpu_linears.PackedWeights, "matmul", counting)


def watching_decode_steps():
    """Counts the engine's decode steps, their input copies and shapes, and any value the host reads
    from a tensor inside a step after its copy (the part a CUDA graph replays), in ``seen``."""
    import importlib

    from megatron_rlhf.generation import decode

    engine = importlib.import_module("megatron_rlhf.generation.generate")  # the package's `generate` is the function

    seen = {"steps": 0, "copies": 0, "shapes": set(), "host_reads": []}
    inside = [False]
    run_decode, send = engine.EngineStep._run_decode, decode.DecodeInputs.send

    def counted_send(self, step, rows):
        seen["copies"] += 1
        view = send(self, step, rows)
        inside[0] = True
        return view

    def counted_step(self, step):
        seen["steps"] += 1
        try:
            return run_decode(self, step)
        finally:
            inside[0] = False

    def layout(positions, decoding, scratch, rotary, window, extent, dtype, *rope_factor):
        seen["shapes"].add((positions.shape[0], extent))
        return decode_layout(positions, decoding, scratch, rotary, window, extent, dtype, *rope_factor)

    def reading(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if inside[0]:
                seen["host_reads"].append(name)
            return original(self, *args, **kwargs)
        return mock.patch.object(torch.Tensor, name, read)

    decode_layout = engine.decode_layout
    patches = [mock.patch.object(engine.EngineStep, "_run_decode", counted_step),
               mock.patch.object(decode.DecodeInputs, "send", counted_send),
               mock.patch.object(engine, "decode_layout", layout)]
    patches += [reading(name) for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")]
    return seen, patches


result = GenerationEquivalence.to_fill()
result.stats, result.greedy = {}, {}
parallel = setup(1, 1)
model = build_model(arch, parallel, "lm")
full = merge_state_dicts([[{k: v.detach().clone() for k, v in local_state_dict(model).items()}]], arch.num_layers, VOCAB, "lm")
result.nocache = argmax_without_cache(model, GREEDY)
full_logits = forward_backward(model, [{"tokens": prompts}])[0]["output"][..., :VOCAB] / 0.7
logp = torch.log_softmax(full_logits, -1)
result.stats_reference = (logp.gather(-1, torch.roll(prompts, -1, 1).unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1))
result.stats["tp1"] = stats(model)
result.greedy["tp1"] = as_record(generate(model, prompts, lengths, GREEDY, VOCAB))
result.tp1_left = as_record(generate(model, left, lengths, GREEDY, VOCAB, padding_side="left"))
# Prompts padded far wider than the longest prompt + max_new_tokens (a batch's width from elsewhere).
result.tp1_wide = as_record(generate(model, torch.cat([prompts, torch.zeros(4, 300, dtype=torch.long)], 1), lengths,
                                       GREEDY, VOCAB))
# EOS: the token row 0 emits third becomes the end token; every row stops at its first one.
eos = int(result.nocache.tokens[0, 3 + 2])
with_eos = SamplingParams(max_new_tokens=6, greedy=True, eos_ids=(eos,), pad_id=0)
result.eos = eos
result.tp1_eos = as_record(generate(model, prompts, lengths, with_eos, VOCAB))
result.nocache_eos = argmax_without_cache(model, with_eos)
result.turns_prefilled = turns(model)
result.turns_kept = turns(model, session_slots=4)
result.turns_kept_2_slots = turns(model, session_slots=2)  # rows take each other's slots: some prefixes again
# Turns without lockstep: replies of different latencies, 4 and 2 slots (rows join running batches).
result.turns_open = {f"{slots}_slots_delays_{''.join(map(str, delays))}": open_turns(model, slots, delays)
                     for slots, delays in ((4, (0, 0, 0, 0)), (4, (5, 0, 2, 9)), (2, (5, 0, 2, 9)), (2, (0, 7, 1, 3)))}
del model

for tp, pp in ((2, 1), (1, 2), (2, 2)):
    parallel = setup(tp, pp)
    model = build_model(arch, parallel, "lm")
    shard = shard_state_dict(
        full, arch.num_layers, arch.padded_vocab_size(tp), tp, ps.get_tensor_model_parallel_rank(),
        pp, ps.get_pipeline_model_parallel_rank(), head="lm",
    )
    load_local_state_dict(model, shard)
    result.greedy[f"tp{tp}_pp{pp}"] = as_record(generate(model, prompts, lengths, GREEDY, VOCAB))
    result.stats[f"tp{tp}_pp{pp}"] = stats(model)
    if (tp, pp) == (2, 2):
        result.tp2_pp2_turns_kept = turns(model, session_slots=4)
        result.tp2_pp2_turns_open = open_turns(model, 2, (5, 0, 2, 9))
        result.tp2_pp2_eos = as_record(generate(model, prompts, lengths, with_eos, VOCAB))
        seen, patches = watching_decode_steps()
        with contextlib.ExitStack() as watching:
            for patch in patches:
                watching.enter_context(patch)
            result.tp2_pp2_eos_by_3 = as_record(generate(model, prompts, lengths, with_eos, VOCAB, batch_size=3))
        result.decode_steps = seen
        # The engine's linears: oneDNN on packed weights by default (here every weight, however
        # small), torch's F.linear when asked.
        counted, counting = counting_packed_products()
        with counting, mock.patch.object(cpu_linears, "SMALLEST_PACKED_WEIGHT", 0):
            result.tp2_pp2_eos_packed = as_record(generate(model, prompts, lengths, with_eos, VOCAB))
            with mock.patch.dict(os.environ, {cpu_linears.KERNEL_VARIABLE: "torch"}):
                result.tp2_pp2_eos_torch_linears = as_record(generate(model, prompts, lengths, with_eos, VOCAB))
        result.packed_products = counted[0]
        result.megatron_products_restored = not any("_forward_impl" in m.__dict__ for m in model.modules())
        sampling = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, pad_id=0)
        result.sampled = as_record(generate(model, prompts, lengths, sampling, VOCAB, seeds=torch.arange(4) + 7))
save(result)
