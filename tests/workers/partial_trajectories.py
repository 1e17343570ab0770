"""Partial rollouts with an environment (rollout/partial_turns.py): examples/tiny_agent/grpo_partial.yaml
(2x over-sampling, TIS, a turn per chunk) with the demo's game over 1 to 4 moves
(environments_for_tests.py:UnevenEchoGame: every reply depends on the moves before it), 3
iterations of 4 prompts x 4 trajectories. On 2
processes (DP=2) the policy also generates at its own layout (TP=2) and no role's memory is freed.

- lr0: ppo_policy's learning rate 0 (the weights never change): every trained trajectory (all
  ranks'), and the same trajectories played in one go from their prompts and seeds;
- resume: trained; a checkpoint after iteration 2 (unfinished trajectories held in it), and a new
  controller that loads it and runs iteration 3.

The outcome is the responses' vowel fraction (the game alone rewards nothing in the first
iteration): a step whose true gradient is zero has a gradient of rounding alone where the layouts
differ (the policy's TP=2 log-probs against TP=1's, ~1e-10), which Adam (eps 1e-8) turns into a
step of about 1% of the learning rate on every weight; with a signal in every step the runs agree
to 1e-7."""

import copy
import os

import torch
from common import OUT_DIR, capture_partial_rows, computed_metrics, reward_pool, save, setup
from tests.workers.findings import FrozenRun, PartialTrajectories, ResumedRun

from megatron_rlhf.checkpoint.run_checkpoint import save_checkpoint
from megatron_rlhf.controller import PPOController
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.rollout.collector import _prompt_columns
from megatron_rlhf.rollout.multiturn import MultiTurn
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args
from megatron_rlhf.run_loop import checkpoint_state, resume

WORLD = int(os.environ["WORLD_SIZE"])
GAME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "environments_for_tests.py") + ":UnevenEchoGame"
os.environ.update(TP="1", ITERATIONS="3", ROLLOUT_BATCH_SIZE="4", SAMPLES_PER_PROMPT="4")
if WORLD == 2:
    os.environ.update({"POLICY_TP": "2", **{f"free_memory_{r}": "False" for r in ("policy", "reference", "ppo_policy")}})


def controller_for(name: str, lr=None):
    prepared = prepare(parse_args(["--config", "examples/tiny_agent/grpo_partial.yaml", "--output-dir",
                                   os.path.join(OUT_DIR, name), "--overwrite",
                                   "reward.function=examples/tiny/reward.py:vowel_fraction"]), WORLD)
    config = prepared.config
    config.rollout.environment = GAME
    if lr is not None:
        config.ppo_policy.lr = lr
    setup(tp=1, seed=config.seed)
    turns = MultiTurn(config, prepared.tokenizer, GAME, False)
    controller = PPOController(config, copy.deepcopy(prepared.dataset), prepared.tokenizer,
                               reward_pool(prepared.reward_functions), MemoryLedger(None), turns=turns)
    return prepared, controller


def in_one_go(controller, dataset, rows: dict) -> dict:
    """The trajectories of ``rows`` played in one go from their prompts and seeds."""
    collector = controller.collector
    beyond = torch.arange(rows["tokens"].shape[1])[None, :] >= rows["prompt_lengths"][:, None]
    mine = {"tokens": rows["tokens"].masked_fill(beyond, collector.sampling.pad_id), "prompt_lengths": rows["prompt_lengths"],
            "seeds": rows["seeds"], "prompt_index": rows["prompt_index"]}
    texts, fields = _prompt_columns(dataset, rows["prompt_index"])
    with controller.role_set.resident("policy", "inference"):
        out, _ = collector.turns.run(collector, mine, texts, fields, collector.sampling, record_log_probs=True)
    return {k: out[k].cpu() for k in ("tokens", "action_mask", "behaviour_log_probs", "response_lengths")}


prepared, frozen = controller_for("lr0", lr=0.0)
trained = capture_partial_rows(frozen)
metrics = [computed_metrics(frozen.step()) for _ in range(3)]
lr0 = FrozenRun(metrics=metrics, rows=trained, one_go=[in_one_go(frozen, prepared.dataset, rows) for rows in trained])

prepared, whole = controller_for("whole")
steps = [computed_metrics(whole.step()) for _ in range(2)]
checkpoint = save_checkpoint(whole.roles, checkpoint_state(whole, prepared.run), prepared.output_dir)
held = whole.collector.partial.held or []
steps.append(computed_metrics(whole.step()))
_, resumed = controller_for("resumed")
resume(resumed, checkpoint)
save(PartialTrajectories(lr0=lr0, resume=ResumedRun(whole=steps, resumed=[computed_metrics(resumed.step())],
                                                    held_groups=len(held) // 4,
                                                    held_unfinished=sum(not h["state"]["done"] for h in held))))
