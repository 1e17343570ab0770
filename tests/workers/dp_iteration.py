"""One iteration of the PPO demo, the GRPO demo (also with LoRA; on 2 processes with EMS off and
micro-batches of 4 rows besides) and the agent demo (multi-turn) at TP=1 over however many
data-parallel ranks the world has (1, 2 or 4 processes; at 4 the PPO and GRPO demos only); each
epoch has several optimizer steps (32 samples, steps of 8). On 2 processes also the agent demo at TP=2 (DP=1) from the TP=1 run's
starting weights (written as checkpoints and loaded). Saves per rank each run's metrics (times
left out) and a digest of ppo_policy's weights after the update (the sum of each full tensor)."""

import copy
import os

import torch
import torch.distributed as dist
from common import OUT_DIR, reward_pool, save, setup
from tests.workers.findings import DPIteration, Iteration

from megatron_rlhf.checkpoint.model_files import save_shard, write_model_meta
from megatron_rlhf.controller import PPOController
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.rollout.record import SCHEDULE_METRICS
from megatron_rlhf.models.decoder import groups_of, local_state_dict
from megatron_rlhf.models.sharding import merge_state_dicts
from megatron_rlhf.rollout.multiturn import MultiTurn
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args

WORLD = int(os.environ["WORLD_SIZE"])
STARTING_WEIGHTS = os.path.join(OUT_DIR, "starting_weights")


def full_weights(role) -> dict:
    """The role's whole tensors, merged from every TP rank (on every rank)."""
    with role.resident("inference"):
        mine = {k: v.detach().clone() for k, v in local_state_dict(role.model).items()}
    tp = groups_of(role.model).tp
    everyone = [None] * tp.size()
    dist.all_gather_object(everyone, mine, group=tp)
    arch = role.config.model
    return merge_state_dicts([everyone], arch.num_layers, arch.vocab_size, "lm")


def write_starting_weights(controller) -> None:
    """ppo_policy's and the reference's weights before the update, as checkpoints (TP=1: rank 0's)."""
    for name in ("ppo_policy", "reference"):
        role, path = controller.roles[name], os.path.join(STARTING_WEIGHTS, name)
        with role.resident("inference"):
            if dist.get_rank() == 0:
                save_shard(path, 0, 0, 1, local_state_dict(role.model))
                write_model_meta(path, role.config.model, "lm", next(role.model.parameters()).dtype, 1, 1)
    dist.barrier()


def cut_otherwise(config) -> None:
    """On 2 processes: every role resident (EMS off) and ppo_policy's micro-batches of 4 rows."""
    if WORLD == 2:
        for role in config.model_roles:
            config.role(role).free_memory = False
        config.ppo_policy.micro_batch_size = 4


def iteration(config_file: str, tp: int, name: str, loaded: bool = False, before_step=None, configure=None) -> Iteration:
    os.environ.update(TP=str(tp), ITERATIONS="1", PRECISION="fp32")
    prepared = prepare(parse_args(["--config", config_file, "--output-dir", os.path.join(OUT_DIR, name)]), WORLD)
    config = prepared.config
    if configure is not None:
        configure(config)
    # The value loss's clip fraction counts ties (new value == old value) in the first step: exact
    # at one layout, off by rounding at another. The clip is off so that every figure is continuous.
    config.ppo.value_clip = None
    if loaded:
        for role in ("policy", "reference", "ppo_policy"):
            config.role(role).load = os.path.join(STARTING_WEIGHTS, "reference" if role == "reference" else "ppo_policy")
    setup(tp=tp, seed=config.seed)
    turns = MultiTurn(config, prepared.tokenizer, prepared.environment, False) if prepared.environment else None
    controller = PPOController(config, copy.deepcopy(prepared.dataset), prepared.tokenizer,
                               reward_pool(prepared.reward_functions), MemoryLedger(None), turns=turns)
    if before_step is not None:
        before_step(controller)
    metrics = controller.step()
    if turns is not None:
        turns.close()
    digest = {k: float(v.double().sum()) for k, v in full_weights(controller.roles["ppo_policy"]).items()}
    return Iteration(metrics={k: v for k, v in metrics.items() if not k.startswith("time/") and k not in SCHEDULE_METRICS},
                     weights=digest)


result = DPIteration.to_fill()
result.ppo = iteration("examples/tiny/rlhf.yaml", 1, "ppo")
result.grpo = iteration("examples/tiny/grpo.yaml", 1, "grpo")
if WORLD <= 2:  # DP=4 (4 processes): the PPO and GRPO demos only
    result.grpo_lora = iteration("examples/tiny/grpo_lora.yaml", 1, "grpo_lora", configure=cut_otherwise)
    result.game = iteration("examples/tiny_agent/grpo.yaml", 1, "game",
                            before_step=write_starting_weights if WORLD == 2 else None)
if WORLD == 2:
    result.game_tp2 = iteration("examples/tiny_agent/grpo.yaml", 2, "game_tp2", loaded=True)
save(result)
