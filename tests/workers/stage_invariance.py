"""A stage before RL (rm or dpo) on the pipeline demo's pairs, cut many ways (2 processes): DP=2
with 1, 4 and token-packed pairs per micro-batch, TP=2 and PP=2 (each DP=1), EMS off, and a run
stopped after two steps and resumed from its checkpoint by newly built roles (EMS off and
the resumed run at the uncut run's 1 pair per micro-batch). Every cut starts from
the same checkpoint (written first at DP=2). Args: STAGE [SETTING=VALUE ...] (environment overrides
of examples/tiny_pipeline/STAGE.yaml; CUTS=a,b: only those cuts)."""

import os

import torch
from common import ARGS, OUT_DIR, rank, save, setup
from tests.workers.findings import StageInvariance, StageRun

from megatron_rlhf.checkpoint.model_files import full_tensors, save_shard, write_model_meta
from megatron_rlhf.checkpoint.ppo_state import latest_checkpoint, load_ppo_checkpoint, save_ppo_checkpoint
from megatron_rlhf.config import load_config
from megatron_rlhf.config.schema import ROLE_HEADS
from megatron_rlhf.data import build_tokenizer
from megatron_rlhf.data.epochs import EpochOrder
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.models.decoder import local_state_dict
from megatron_rlhf.roles.role_set import RoleSet
from megatron_rlhf.stages import read_rows, stage_class

STAGE, SETTINGS = ARGS[0], dict(arg.split("=", 1) for arg in ARGS[1:])
ONLY = SETTINGS.pop("CUTS", "").split(",") if "CUTS" in SETTINGS else None  # CUTS=a,b: those cuts, no resume
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny_pipeline", f"{STAGE}.yaml")
STEPS = 4
CUTS = {  # name -> (TP, PP, environment)
    "dp2_mb1": (1, 1, {"MICRO_BATCH_SIZE": "1"}),
    "dp2_mb4": (1, 1, {"MICRO_BATCH_SIZE": "4"}),
    "dp2_packed": (1, 1, {"MICRO_BATCH_SIZE": "auto", "MAX_TOKENS_PER_MICRO_BATCH": "200"}),
    "tp2": (2, 1, {"MICRO_BATCH_SIZE": "2"}),
    "pp2": (1, 2, {"MICRO_BATCH_SIZE": "2"}),
    "ems_off": (1, 1, {"MICRO_BATCH_SIZE": "1", "FREE_MEMORY": "False"}),
}
LOAD = {"rm": "REWARD_LOAD", "dpo": "POLICY_LOAD"}[STAGE]


def built(tp, pp, environment):
    """The stage's config, roles and Stage at this cut."""
    for name in ("MICRO_BATCH_SIZE", "MAX_TOKENS_PER_MICRO_BATCH", "FREE_MEMORY"):  # the last cut's
        os.environ.pop(name, None)
    os.environ.update({"TP": str(tp), "PP": str(pp), "GLOBAL_BATCH_SIZE": "16", "TENSORBOARD": "False",
                       **SETTINGS, **environment})
    setup(tp, pp)
    config = load_config(CONFIG, world_size=2)
    tokenizer = build_tokenizer(config.data.tokenizer)
    roles = RoleSet(config, MemoryLedger(None), tokenizer.pad_id)
    stage = stage_class(STAGE)(config, roles, tokenizer, read_rows(config, "data.train_file", tokenizer),
                               read_rows(config, "data.val_file", tokenizer))
    order = EpochOrder(len(stage.data), 16, 1, None, config.seed, config.data.shuffle)
    return config, roles, stage, order


def saved(roles, output, step):
    save_ppo_checkpoint(roles.roles, {"iteration": step, "run": {}}, output)
    return latest_checkpoint(output)


def weights(checkpoint, trained):
    return dict(full_tensors(os.path.join(checkpoint, trained))) if rank() == 0 else None


def seed_checkpoint(role, root):
    """The role's seeded network as a model checkpoint (TP=1, PP=1), for every cut to load."""
    if rank() == 0:
        weights = {k: v.detach().clone() for k, v in local_state_dict(role.model).items()}
        save_shard(root, 0, 0, 1, weights)
        write_model_meta(root, role.config.model, ROLE_HEADS[role.name], next(iter(weights.values())).dtype, 1, 1)
    torch.distributed.barrier()
    return root


config, roles, stage, _ = built(1, 1, {"MICRO_BATCH_SIZE": "1"})
with roles.resident(stage.trained, "inference"):
    os.environ[LOAD] = seed_checkpoint(stage.role, os.path.join(OUT_DIR, "start"))
result = StageInvariance(runs={})
for name, (tp, pp, environment) in ((n, c) for n, c in CUTS.items() if ONLY is None or n in ONLY):
    config, roles, stage, order = built(tp, pp, environment)
    steps = [stage.step(order.step_rows(i), i + 1) for i in range(STEPS)]
    validation = stage.validate()
    checkpoint = saved(roles, os.path.join(OUT_DIR, name), STEPS)
    result.runs[name] = StageRun(steps=steps, validation=validation, weights=weights(checkpoint, stage.trained))

# Resume: two steps, a checkpoint, newly built roles that load it, two more steps.
if ONLY is None:
    config, roles, stage, order = built(1, 1, {"MICRO_BATCH_SIZE": "1"})
    first = [stage.step(order.step_rows(i), i + 1) for i in range(2)]
    checkpoint = saved(roles, os.path.join(OUT_DIR, "stopped"), 2)
    config, roles, stage, order = built(1, 1, {"MICRO_BATCH_SIZE": "1"})
    load_ppo_checkpoint(roles.roles, checkpoint)
    steps = first + [stage.step(order.step_rows(i), i + 1) for i in range(2, STEPS)]
    validation = stage.validate()
    result.runs["resumed"] = StageRun(steps=steps, validation=validation,
                                      weights=weights(saved(roles, os.path.join(OUT_DIR, "resumed"), STEPS), stage.trained))
save(result)
