"""Partial rollouts on the GRPO demo (examples/tiny/grpo_partial.yaml: 2x over-sampling, TIS) at
TP=1 over the world's data-parallel ranks, 3 iterations of 8 prompts x 4 responses. On 2 processes
(DP=2) the work is cut otherwise too: the policy generates at its own layout (TP=2, its weights
resharded from ppo_policy's), every role stays resident (EMS off), ppo_policy's micro-batches hold
4 rows (the demo's: 2).

- lr0: ppo_policy's learning rate 0 (the weights never change): every trained row (all ranks'),
  and the same responses generated in one go by the policy from their seeds;
- resume: trained; a checkpoint after iteration 2 (unfinished groups held in it), and a new
  controller that loads it and runs iteration 3.

Saves per rank: each run's metrics per iteration (times and sync bytes left out), the trained rows, the one-go
tokens and log-probs, the held groups at the checkpoint."""

import copy
import os

import torch
from common import OUT_DIR, capture_partial_rows, computed_metrics, reward_pool, save, setup
from tests.workers.findings import FrozenRun, PartialRollouts, ResumedRun

from megatron_rlhf.checkpoint.run_checkpoint import save_checkpoint
from megatron_rlhf.controller import PPOController
from megatron_rlhf.generation import generate
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args
from megatron_rlhf.run_loop import checkpoint_state, resume

WORLD = int(os.environ["WORLD_SIZE"])
os.environ.update(TP="1", ITERATIONS="3", PRECISION="fp32")
if WORLD == 2:
    os.environ.update({"POLICY_TP": "2", **{f"free_memory_{r}": "False" for r in ("policy", "reference", "ppo_policy")}})


def controller_for(name: str, lr=None):
    prepared = prepare(parse_args(["--config", "examples/tiny/grpo_partial.yaml", "--output-dir",
                                   os.path.join(OUT_DIR, name), "--overwrite"]), WORLD)
    if lr is not None:
        prepared.config.ppo_policy.lr = lr
    if WORLD == 2:
        prepared.config.ppo_policy.micro_batch_size = 4
    setup(tp=1, seed=prepared.config.seed)
    controller = PPOController(prepared.config, copy.deepcopy(prepared.dataset), prepared.tokenizer,
                               reward_pool(prepared.reward_functions), MemoryLedger(None))
    return prepared, controller


def in_one_go(controller, rows: dict) -> dict:
    """The responses of ``rows`` generated in one call (their seeds, generation.max_new_tokens)."""
    collector = controller.collector
    beyond = torch.arange(rows["tokens"].shape[1])[None, :] >= rows["prompt_lengths"][:, None]
    prompts = rows["tokens"].masked_fill(beyond, collector.sampling.pad_id)
    with controller.role_set.resident("policy", "inference"):
        gen = generate(controller.roles["policy"].model, prompts, rows["prompt_lengths"], collector.sampling,
                       collector.vocab_size, rows["seeds"], record_log_probs=True)
    return {"tokens": gen.tokens.cpu(), "response_lengths": gen.response_lengths.cpu(), "log_probs": gen.log_probs.cpu()}


# lr 0: resumed responses against one go.
_, frozen = controller_for("lr0", lr=0.0)
trained = capture_partial_rows(frozen)
lr0 = FrozenRun(metrics=[computed_metrics(frozen.step()) for _ in range(3)], rows=trained,
                one_go=[in_one_go(frozen, rows) for rows in trained])

# Resume from a checkpoint holding unfinished groups.
prepared, whole = controller_for("whole")
steps = [computed_metrics(whole.step()) for _ in range(2)]
checkpoint = save_checkpoint(whole.roles, checkpoint_state(whole, prepared.run), prepared.output_dir)
held = whole.collector.partial.held
steps.append(computed_metrics(whole.step()))
_, resumed = controller_for("resumed")
resume(resumed, checkpoint)
save(PartialRollouts(lr0=lr0, resume=ResumedRun(whole=steps, resumed=[computed_metrics(resumed.step())],
                                                held_groups=0 if held is None else len(held["seeds"]) // 4,
                                                held_unfinished=0 if held is None else int((held["ended"] == 0).sum()))))
