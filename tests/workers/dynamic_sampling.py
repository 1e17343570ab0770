"""Dynamic sampling end to end: one GRPO iteration of the tiny demo at DP=2 (2 processes, TP=1)
with a reward that gives every response to a prompt before 'n' the same score (no signal) and
distinct scores to the others. Saves, per rank, the rollout's prompts and scores, the iteration's
metrics and the prompts the dataset served, in order."""

import copy
import os

from common import OUT_DIR, REWARDS_FOR_TESTS, capture_rollouts, reward_pool, save
from tests.workers.findings import DynamicSampling

from megatron_rlhf.controller import PPOController
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.rollout import collector as collector_module
from megatron_rlhf.runtime import init_distributed
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args

os.environ.update(TP="1", DYNAMIC_SAMPLING="True", ITERATIONS="1")
prepared = prepare(
    parse_args(["--config", "examples/tiny/grpo.yaml", "--output-dir", OUT_DIR]), int(os.environ["WORLD_SIZE"]))
config, tokenizer, dataset = prepared.config, prepared.tokenizer, prepared.dataset
untouched = copy.deepcopy(dataset)


init_distributed(config.parallel, seed=config.seed)
controller = PPOController(config, dataset, tokenizer, reward_pool(f"{REWARDS_FOR_TESTS}:signal_after_n"), MemoryLedger(None))
captured = capture_rollouts(controller)
collector_module.SAMPLES_SHOWN = 10**6  # every kept row's prompt, in order
metrics = controller.step()
served = []
while untouched.consumed < dataset.consumed:
    served += untouched.next_batch(config.ppo.rollout_batch_size, 0, 1)["texts"]
rollout = captured["rollout"]
save(DynamicSampling(prompts=[s["prompt"] for s in controller.samples], scores=rollout.scores.cpu(), metrics=metrics,
                     served=served, advantages=rollout.advantages.cpu(), mask=rollout.action_mask.cpu()))
