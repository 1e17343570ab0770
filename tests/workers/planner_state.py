"""Measured resident bytes by kind (the ledger's counting) of a trainable and an inference role
under several layouts, dense and with experts, next to the planner's figures. Run with 4 processes."""

import os

import torch
from common import save, setup
from tests.workers.findings import PlannedRole, PlannedSync, PlannerState
from megatron.core import parallel_state as ps

from megatron_rlhf.config import load_config
from megatron_rlhf.memory import LEDGER_KINDS, RESHARD_BUFFERS, MemoryLedger
from megatron_rlhf.memory.planner import reshard_buffer_bytes, state_bytes
from megatron_rlhf.models.training import next_token_loss
from megatron_rlhf.models.decoder import groups_of
from megatron_rlhf.roles import build_role
from megatron_rlhf.roles.weight_sync import WeightSync

# Tied embeddings (under PP the last stage's own copy), QKV bias, q/k norm, heads of another width.
FEATURES = dict(tie_word_embeddings=True, qkv_bias=True, qk_norm=True, head_dim=24)
LAYOUTS = [  # tp, pp, distributed optimizer, precision, architecture features
    (2, 1, True, "fp32", {}),
    (1, 2, True, "bf16", {}),
    (2, 2, True, "bf16", {}),
    (1, 1, False, "fp32", {}),
    (1, 1, True, "bf16", {}),
    (1, 1, False, "bf16", {}),
    (2, 1, True, "fp32", FEATURES),
    (1, 2, True, "bf16", FEATURES),
]
# Mixtures of experts (the tiny MoE demo's model): experts in DDP's buffers of their own, sharded over
# the expert-data-parallel group: EP=2 of DP=4 (expert DP 2), EP=2 at PP=2 (expert DP 1), EP=4.
# The last: a Qwen2-MoE's shared expert (with its gate) in the dense buffer beside the attention.
QWEN2_MOE = dict(family="qwen2_moe", qkv_bias=True, qk_norm=False, moe_shared_expert_ffn_hidden_size=48)
MOE_LAYOUTS = [  # tp, pp, ep, distributed optimizer, precision, architecture features
    (1, 1, 2, True, "bf16", {}),
    (1, 2, 2, True, "fp32", {}),
    (1, 1, 4, True, "fp32", {}),
    (1, 1, 2, False, "bf16", {}),
    (1, 1, 2, True, "bf16", QWEN2_MOE),
]
# LoRA (rank 4 on every target): only the adapters (and a value model's score head) in DDP's buffer.
LORA_LAYOUTS = [(2, 1, True, "fp32"), (1, 2, True, "bf16"), (2, 2, True, "bf16"), (1, 1, False, "bf16")]
tokens = torch.randint(3, 30, (4, 16), generator=torch.Generator().manual_seed(0))
result = PlannerState(roles=[], syncs=[])
cases = [("examples/tiny/rlhf.yaml", tp, pp, 1, dist_opt, precision, features, ("ppo_policy", "value"))
         for tp, pp, dist_opt, precision, features in LAYOUTS]
cases += [("examples/tiny/moe.yaml", tp, pp, ep, dist_opt, precision, features, ("ppo_policy", "reference"))
          for tp, pp, ep, dist_opt, precision, features in MOE_LAYOUTS]
cases += [("examples/tiny/rlhf.yaml", tp, pp, 1, dist_opt, precision, {"lora": 4}, ("ppo_policy", "ppo_value"))
          for tp, pp, dist_opt, precision in LORA_LAYOUTS]
for config_file, tp, pp, ep, dist_opt, precision, features, roles in cases:
    os.environ.update(TP=str(tp), PP=str(pp), EP=str(ep))
    config = load_config(config_file, world_size=int(os.environ["WORLD_SIZE"]))
    setup(tp, pp, ep=ep)
    dp, dp_rank, pp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    edp_rank = ps.get_expert_data_parallel_rank()
    for name in roles:
        rc = config.role(name)
        rc.precision, rc.use_distributed_optimizer, rc.free_memory = precision, dist_opt, True
        for key, value in features.items():
            if key == "lora":
                rc.lora.rank = value
            else:
                setattr(rc.model, key, value)
        role = build_role(name, config)
        if role.trainable:
            with role.resident("training"):
                role.train_step([{"tokens": t} for t in tokens.split(2)], next_token_loss)
                measured = {k: v for k, v in role.memory.resident_bytes().items() if k in LEDGER_KINDS}
        else:
            with role.resident("inference"):
                measured = {k: v for k, v in role.memory.resident_bytes().items() if k in LEDGER_KINDS}
        planned = state_bytes(rc, role.head, role.trainable, tp, pp, dp, pp_rank, dp_rank, ep, edp_rank,
                              lora=config.lora_of(name))
        # Idle with every switch on: nothing of any kind left on the device, counted from every
        # parameter, main_grad and optimizer tensor (the leak guard's count; experts included).
        idle = {k: v for k, v in role.memory.resident_bytes().items() if k in LEDGER_KINDS and v}
        result.roles.append(PlannedRole(layout=(tp, pp, ep, dist_opt, precision, sorted(features)), role=name,
                                        measured=measured, planned=planned, idle={**idle, **role.memory.leftovers()}))
        del role
# Serving roles at layouts of their own (the run at TP=2): built on their own groups, planned at their
# layout with the run's padded vocabulary.
os.environ.update(TP="2", PP="1", EP="1")
setup(2, 1)
for name, (tp, pp) in {"policy": (1, 2), "reference": (1, 1), "value": (2, 2)}.items():
    config = load_config("examples/tiny/rlhf.yaml", world_size=int(os.environ["WORLD_SIZE"]), check_inputs=False)
    rc = config.role(name)
    rc.parallel.tensor_model_parallel_size, rc.parallel.pipeline_model_parallel_size = tp, pp
    rc.free_memory = True
    role = build_role(name, config)
    groups = groups_of(role.model)
    with role.resident("inference"):
        measured = {k: v for k, v in role.memory.resident_bytes().items() if k in LEDGER_KINDS}
    planned = state_bytes(rc, role.head, False, tp, pp, groups.dp.size(), groups.pp.rank(),
                          padded_vocab=config.padded_vocab(rc.model))
    idle = {k: v for k, v in role.memory.resident_bytes().items() if k in LEDGER_KINDS and v}
    result.roles.append(PlannedRole(layout=(tp, pp, 1, False, rc.precision, ["own layout"]), role=name, measured=measured,
                                    planned=planned, idle={**idle, **role.memory.leftovers()}))
    del role

# Weight sync into a role of its own layout: the buffers megatron's resharding allocates, as the
# ledger counts them, against the planner's. From TP=2 into TP=1 (receives only) and from TP=1 into
# TP=2 x PP=2 (the row-parallel slices are copied before they are sent).
for run_tp, (tp, pp) in ((2, (1, 1)), (1, (2, 2))):
    os.environ.update(TP=str(run_tp), PP="1", EP="1")
    setup(run_tp, 1)
    config = load_config("examples/tiny/rlhf.yaml", world_size=int(os.environ["WORLD_SIZE"]), check_inputs=False)
    config.policy.parallel.tensor_model_parallel_size, config.policy.parallel.pipeline_model_parallel_size = tp, pp
    ledger = MemoryLedger(None)
    roles = {name: build_role(name, config) for name in ("ppo_policy", "policy")}
    for role in roles.values():
        ledger.track(role.memory)
    WeightSync(roles["ppo_policy"], roles["policy"], share=False, reshard=True)
    recorded = max(r["bytes"][RESHARD_BUFFERS] for r in ledger.records if r["role"] == "policy")
    result.syncs.append(PlannedSync(layouts=(run_tp, tp, pp), recorded=recorded,
                                    planned=reshard_buffer_bytes(config, "policy", int(os.environ["WORLD_SIZE"])),
                                    stage=groups_of(roles["policy"].model).pp.rank()))
    del roles
save(result)
