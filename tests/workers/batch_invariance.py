"""Batch-invariant mode (models/batch_invariant.py), one process, TP=1, fp32 and bf16: a row's
sampled tokens and behaviour log-probs alone and beside 1, 7 and 63 others (prefill and decode,
1, 8 and 64 slots), the training forward's logits of a row alone and in a batch of 64, the
behaviour log-probs against the training forward's log-probs of the same tokens, and the same
with the mode off (where they differ); again with keys read in several blocks (fp32). Then
through the run's entry (trainer.batch_invariant: true): a GRPO iteration with rollout
correction, and the agent game in bf16 in lockstep, without it, and in 2 slots."""

import os

import torch
from common import OUT_DIR, one_iteration, save, setup, tiny_arch
from tests.workers.findings import BatchInvariance

from megatron_rlhf.generation import SamplingParams, generate
from megatron_rlhf.models import batch_invariant as mode
from megatron_rlhf.models.batch_invariant import batch_invariant
from megatron_rlhf.models.decoder import build_model, load_local_state_dict, local_state_dict
from megatron_rlhf.models.pipeline import forward_backward
from megatron_rlhf.models.vocab_parallel import next_token_log_probs
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args

VOCAB, ROWS, NEW = 120, 64, 12
parallel = setup(1, 1)
arch = tiny_arch(vocab_size=VOCAB, hidden_size=128, ffn_hidden_size=344, num_attention_heads=8, num_query_groups=2)
gen = torch.Generator().manual_seed(3)
lengths = torch.randint(2, 100, (ROWS,), generator=gen)  # rows over one and two key blocks
prompts = torch.randint(3, VOCAB, (ROWS, 100), generator=gen)
SAMPLED = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.95, eos_ids=(5,), pad_id=0)
LENGTH = 100 + NEW  # the run's sequence length
seeds = torch.arange(ROWS) + 100
result = BatchInvariance.to_fill()
result.on, result.off = {}, {}


def rows_of(g, picked):
    """Per row of ``picked`` (indices into g's rows): its response tokens and behaviour log-probs."""
    out = []
    for r in picked:
        n, m = int(g.prompt_lengths[r]), int(g.response_lengths[r])
        out.append((g.tokens[r, n : n + m].clone(), g.log_probs[r, n - 1 : n - 1 + m].clone()))
    return out


def company(model):
    """Row 0's (tokens, log-probs) alone, then first among 1, 7 and 63 others (slots = rows), then
    among all 64 in 8 slots; and the whole batch's generation."""
    runs = []
    for others, slots in ((0, 1), (1, 2), (7, 8), (63, 64), (63, 8)):
        g = generate(model, prompts[: others + 1], lengths[: others + 1], SAMPLED, VOCAB, seeds=seeds[: others + 1],
                     batch_size=slots, record_log_probs=True)
        runs.append(rows_of(g, [0])[0])
    return runs, g


def training_log_probs(model, g):
    """The training forward's log-probs of each row's response tokens (one batch of every row)."""
    width = int(g.total_lengths.max())
    tokens = g.tokens[:, :width]
    logits = forward_backward(model, [{"tokens": tokens}])[0]["output"]
    logp = next_token_log_probs(logits, {"tokens": tokens}, VOCAB, SAMPLED.temperature)  # [B, S-1]
    return [logp[r, int(n) - 1 : int(n) - 1 + int(m)] for r, (n, m) in enumerate(zip(g.prompt_lengths, g.response_lengths))]


def forward_alone_and_in_batch(model):
    """Row 5's training-forward logits alone and as row 5 of 64 (the same width)."""
    tokens = prompts.clone()
    alone = forward_backward(model, [{"tokens": tokens[5:6]}])[0]["output"][0]
    batch = forward_backward(model, [{"tokens": tokens}])[0]["output"][5]
    return torch.equal(alone, batch)


def checks(precision: str, weights) -> dict:
    """The mode's figures for a model of ``precision`` with ``weights`` (built in the mode)."""
    model = build_model(arch, parallel, "lm", precision=precision)
    load_local_state_dict(model, weights)
    runs, g = company(model)
    behaviour = rows_of(g, range(ROWS))
    trained = training_log_probs(model, g)
    return {"company_tokens_equal": [torch.equal(runs[0][0], t) for t, _ in runs[1:]],
            "company_log_probs_equal": [torch.equal(runs[0][1], lp) for _, lp in runs[1:]],
            "behaviour_equals_training": sum(torch.equal(b[1], t) for b, t in zip(behaviour, trained)),
            "rows": ROWS, "tokens": sum(len(b[0]) for b in behaviour),
            "forward_row_alone_equals_in_batch": forward_alone_and_in_batch(model)}


def run_iteration(config_file: str, name: str, *overrides: str):
    """One iteration through the run's entry (prepare sets the mode from the config), TP=1."""
    os.environ.update(TP="1", ITERATIONS="1")
    prepared = prepare(parse_args(["--config", config_file, "--output-dir", os.path.join(OUT_DIR, name), *overrides]), 1)
    setup(tp=1, seed=prepared.config.seed)
    metrics, _, r = one_iteration(prepared, prepared.environment)
    return metrics, (r.tokens.cpu(), r.behaviour_log_probs.cpu() if r.behaviour_log_probs is not None else None)


weights = None
for precision in ("fp32", "bf16"):
    with batch_invariant(LENGTH):
        if weights is None:
            weights = local_state_dict(build_model(arch, parallel, "lm", precision="fp32"))
        result.on[precision] = checks(precision, weights)
    model = build_model(arch, parallel, "lm", precision=precision)  # the mode off: torch's own arithmetic
    load_local_state_dict(model, weights)
    g = generate(model, prompts, lengths, SAMPLED, VOCAB, seeds=seeds, batch_size=8, record_log_probs=True)
    off = rows_of(g, range(ROWS))
    result.off[precision] = {"behaviour_equals_training": sum(torch.equal(b[1], t) for b, t in zip(off, training_log_probs(model, g))),
                             "largest_gap": max(float((b[1] - t).abs().max()) for b, t in zip(off, training_log_probs(model, g)))}
# Rows longer than one key block (here 64 keys): the blocks combined with a running max and sum.
longest_block, mode.MAX_KEY_BLOCK = mode.MAX_KEY_BLOCK, 64
with batch_invariant(LENGTH):
    result.on["fp32, key blocks of 64"] = checks("fp32", weights)
mode.MAX_KEY_BLOCK = longest_block
# Through the run's entry: rollout correction reads exactly 1; the agent game's trajectories in bf16.
result.grpo = {on: run_iteration("examples/tiny/grpo.yaml", f"grpo_{on}", f"trainer.batch_invariant={on}",
                                 "algorithm.rollout_correction.mode=truncate")[0] for on in ("true", "false")}
os.environ["PRECISION"] = "bf16"
game = ("examples/tiny_agent/grpo.yaml", "trainer.batch_invariant=true", "algorithm.rollout_correction.mode=truncate")
result.game = {name: run_iteration(game[0], f"game_{name}", *game[1:], *extra)[1] for name, extra in
               (("overlap", ()), ("lockstep", ("rollout.overlap_turns=false",)), ("2 slots", ("generation.batch_size=2",)))}
del os.environ["PRECISION"]
save(result)
