"""A PPO checkpoint save that dies midway (an exception inside the writer) leaves the previous
checkpoint complete, `latest` pointing to it, and loadable. Run with 1 process (TP=1)."""

import os

import torch
from common import OUT_DIR, reward_pool, save
from tests.workers.findings import PPOCheckpointCrash

from megatron_rlhf.checkpoint import ppo_state
from megatron_rlhf.checkpoint.background import CheckpointSaves
from megatron_rlhf.controller import PPOController
from megatron_rlhf.errors import RunError
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.runtime import init_distributed
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args

os.environ["TP"] = "1"
prepared = prepare(parse_args(["--config", "examples/tiny/rlhf.yaml", "--output-dir", OUT_DIR]), 1)
config, tokenizer, dataset = prepared.config, prepared.tokenizer, prepared.dataset
config.ppo.rollout_batch_size = 8
init_distributed(config.parallel, seed=config.seed)
controller = PPOController(config, dataset, tokenizer, reward_pool(prepared.reward_functions), MemoryLedger(None))
controller.step()
first = ppo_state.save_ppo_checkpoint(controller.roles, controller.state_dict(), OUT_DIR)
controller.step()

real_save = torch.save


def failing_save(obj, path, *args, **kwargs):
    if "ppo_value" in str(path) and "optim" in str(path):
        raise OSError("disk full (simulated)")
    return real_save(obj, path, *args, **kwargs)


ppo_state.torch.save = failing_save
error = None
try:
    ppo_state.save_ppo_checkpoint(controller.roles, controller.state_dict(), OUT_DIR)
except RunError as e:
    error = str(e)
# The same full disk met by the background writer (trainer.async_save): said when the save is drained.
background_error = None
background = CheckpointSaves(in_background=True)
background.save(controller.roles, controller.state_dict(), OUT_DIR)
try:
    background.drain()
except RunError as e:
    background_error = str(e)
ppo_state.torch.save = real_save

latest = ppo_state.latest_checkpoint(OUT_DIR)
fresh = PPOController(config, dataset, tokenizer, controller.collector.scorer.reward_pool, MemoryLedger(None))
real_load, map_locations = torch.load, []


def recording_load(*args, **kwargs):
    map_locations.append(kwargs.get("map_location"))
    return real_load(*args, **kwargs)


ppo_state.torch.load = recording_load
fresh.load_state_dict(ppo_state.load_ppo_checkpoint(fresh.roles, latest))
ppo_state.torch.load = real_load
save(PPOCheckpointCrash(error=error, background_error=background_error, first=first, latest=latest, resumed_iteration=fresh.iteration,
                        listing=sorted(os.listdir(os.path.join(OUT_DIR, "checkpoints"))), map_locations=map_locations))
