"""Roles at layouts of their own, end to end: one PPO iteration of the tiny demo (fp32) on 2
processes at the run's TP=2, once with every role at TP=2 and once with the policy and the value at
TP=1 (DP=2, served by resharding from ppo_policy and ppo_value) and the reference at PP=2 (loaded
from a TP=2 checkpoint of its own starting weights). Greedy and sampled (the same streams), and the
mixed layouts with EMS on and off; the LoRA demo with its policy at TP=1 (the adapters resharded
after each update). Saves per rank each run's rollout columns and metrics."""

import copy
import os

import torch.distributed as dist
from common import OUT_DIR, capture_rollouts, save, setup
from tests.workers.findings import LoRAServed, RoleLayoutRun, RoleLayouts

from megatron.core import parallel_state as ps

from megatron_rlhf.checkpoint import run_checkpoint
from megatron_rlhf.checkpoint.model_files import save_shard, write_model_meta
from megatron_rlhf.config.validation import validate
from megatron_rlhf.controller import PPOController
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.models.decoder import groups_of, local_state_dict, unwrap
from megatron_rlhf.models.lora import is_adapter
from megatron_rlhf.rewards.pool import RewardPool
from megatron_rlhf.runtime import init_distributed
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args
from megatron_rlhf.run_loop import checkpoint_state, resume

os.environ.update(TP="2", ITERATIONS="1", ROLLOUT_BATCH_SIZE="8", PRECISION="fp32")
prepared = prepare(parse_args(["--config", "examples/tiny/rlhf.yaml", "--output-dir", OUT_DIR]),
                   int(os.environ["WORLD_SIZE"]))
base = prepared.config
# The value loss's clip fraction counts ties (new value == old value) in the first step: exact at one
# layout, off by rounding at two. The clip is off here so that every reported figure is continuous.
base.ppo.value_clip = None
init_distributed(base.parallel, seed=base.seed)
CHECKPOINT = os.path.join(OUT_DIR, "reference_tp2")


def without_times(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def mixed(config):
    """The policy and value at TP=1 (DP=2), the reference at PP=2 from the TP=2 checkpoint."""
    config = copy.deepcopy(config)
    config.policy.parallel.tensor_model_parallel_size = 1
    config.value.parallel.tensor_model_parallel_size = 1
    config.reference.parallel.tensor_model_parallel_size = 1
    config.reference.parallel.pipeline_model_parallel_size = 2
    config.reference.load = CHECKPOINT
    validate(config, dist.get_world_size())
    return config


def iteration(config, greedy: bool, free_memory: bool = True, source=prepared):
    config = copy.deepcopy(config)
    config.generation.greedy = greedy
    for role in config.model_roles:
        config.role(role).free_memory = free_memory
    scorer = RewardPool(source.reward_functions, num_workers=1) if ps.get_model_parallel_group().rank() == 0 else None
    controller = PPOController(config, copy.deepcopy(source.dataset), source.tokenizer, scorer, MemoryLedger(None))
    captured = capture_rollouts(controller)
    metrics = controller.step()
    r = captured["rollout"]
    columns = {k: getattr(r, k).cpu() for k in ("tokens", "response_lengths", "old_log_probs", "ref_log_probs",
                                                "old_values", "action_mask", "scores", "routes") if getattr(r, k) is not None}
    layouts = {name: (groups_of(role.model).tp.size(), groups_of(role.model).pp.size(), groups_of(role.model).ep.size())
               for name, role in controller.roles.items()}
    return controller, RoleLayoutRun(columns=columns, metrics=metrics, layouts=layouts)


result = RoleLayouts.to_fill()
result.same, result.mixed, result.lora = {}, {}, {}
controller, result.same["greedy"] = iteration(base, greedy=True)
# The reference's starting weights at TP=2, written as a checkpoint the mixed run loads at PP=2.
reference = controller.roles["reference"]
with reference.resident("inference"):
    save_shard(CHECKPOINT, dist.get_rank(), 0, 1, local_state_dict(reference.model))
if dist.get_rank() == 0:
    write_model_meta(CHECKPOINT, base.reference.model, "lm", next(reference.model.parameters()).dtype, 2, 1)
dist.barrier()
_, result.same["sampled"] = iteration(base, greedy=False)
_, result.mixed["greedy"] = iteration(mixed(base), greedy=True)
_, result.mixed["sampled"] = iteration(mixed(base), greedy=False)
_, result.mixed_ems_off = iteration(mixed(base), greedy=False, free_memory=False)

# Resume: a checkpoint after the first iteration, loaded by a fresh controller, continues the run;
# the policy at its own layout is served the restored weights, not its starting ones.
interrupted, _ = iteration(mixed(base), greedy=False)
path = run_checkpoint.save_checkpoint(interrupted.roles, checkpoint_state(interrupted, None), OUT_DIR)
result.resume_whole = without_times(interrupted.step())
resumed = PPOController(mixed(base), copy.deepcopy(prepared.dataset), prepared.tokenizer, interrupted.collector.scorer.reward_pool,
                        MemoryLedger(None))
resume(resumed, path)
result.resume_resumed = without_times(resumed.step())

# LoRA (the GRPO LoRA demo): the policy at TP=1 (DP=2), served ppo_policy's frozen base once and its
# adapters after each update by resharding, against every role at TP=2; two iterations, greedy.
lora = prepare(parse_args(["--config", "examples/tiny/grpo_lora.yaml", "--output-dir", os.path.join(OUT_DIR, "lora")]),
               int(os.environ["WORLD_SIZE"]))
lora_mixed = copy.deepcopy(lora.config)
lora_mixed.policy.parallel.tensor_model_parallel_size = 1
validate(lora_mixed, dist.get_world_size())
for name, config in (("same", lora.config), ("mixed", lora_mixed)):
    controller, first = iteration(config, greedy=True, source=lora)
    captured = capture_rollouts(controller)
    second = without_times(controller.step())
    rollout = captured["rollout"]
    policy = dict(unwrap(controller.roles["policy"].model).named_parameters())
    result.lora[name] = LoRAServed(tokens=rollout.tokens.cpu(), old_log_probs=rollout.old_log_probs.cpu(),
                                   action_mask=rollout.action_mask.cpu(), layouts=first.layouts,
                                   metrics=[without_times(first.metrics), second],
                                   bytes={kind: sum(p.numel() * p.element_size() for n, p in policy.items()
                                                    if is_adapter(n) == (kind == "adapters")) for kind in ("adapters", "base")})
    del controller

# A mixture of experts (the MoE demo: GRPO, routing replayed from the rollout): the run at TP=1 x EP=2
# (DP=2), the policy at EP=1 (every expert on every rank), served by resharding.
os.environ.update(TP="1", EP="2")
moe = prepare(parse_args(["--config", "examples/tiny/moe.yaml", "--output-dir", os.path.join(OUT_DIR, "moe")]),
              int(os.environ["WORLD_SIZE"]))
setup(1, 1, ep=2, seed=moe.config.seed)
moe_mixed = copy.deepcopy(moe.config)
moe_mixed.policy.parallel.expert_model_parallel_size = 1
validate(moe_mixed, dist.get_world_size())
for mode, greedy in (("greedy", True), ("sampled", False)):
    _, result.same[f"moe/{mode}"] = iteration(moe.config, greedy, source=moe)
    _, result.mixed[f"moe/{mode}"] = iteration(moe_mixed, greedy, source=moe)
save(result)
