"""The reward model, the process reward model and DPO (examples/tiny_pipeline's rm.yaml, prm.yaml and
dpo.yaml, on the pipeline demo's pairs and stepwise rows; validated on 32 held-out ones) cut many ways in one launch of 2 processes: DP=2 with 1 and
token-packed pairs per micro-batch, TP=2 and PP=2 (each DP=1, 2 pairs per micro-batch), EMS off, and
a run stopped after two of its three steps and resumed from its checkpoint by newly built roles (EMS
off and the resumed run at the uncut run's 1 pair per micro-batch); DPO also with its reference's
log-probs precomputed. Each stage's cuts start from the same checkpoint (written first at DP=2).
Results are keyed "STAGE:CUT"."""

import os

import torch
from common import OUT_DIR, rank, save, setup
from tests.workers.findings import StageInvariance, StageRun

from megatron_rlhf.checkpoint.model_files import full_tensors, save_shard, write_model_meta
from megatron_rlhf.checkpoint.run_checkpoint import latest_checkpoint, save_checkpoint
from megatron_rlhf.config import load_config
from megatron_rlhf.config.schema import ROLE_HEADS
from megatron_rlhf.data import build_tokenizer
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.models.decoder import local_state_dict
from megatron_rlhf.roles.role_set import RoleSet
from megatron_rlhf.run_loop import checkpoint_state, resume, steps_class
from megatron_rlhf.stages import read_rows

PIPELINE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny_pipeline")
STEPS = 3
CUTS = {  # name -> (TP, PP, environment)
    "dp2_mb1": (1, 1, {"MICRO_BATCH_SIZE": "1"}),
    "dp2_packed": (1, 1, {"MICRO_BATCH_SIZE": "auto", "MAX_TOKENS_PER_MICRO_BATCH": "200"}),
    "tp2": (2, 1, {"MICRO_BATCH_SIZE": "2"}),
    "pp2": (1, 2, {"MICRO_BATCH_SIZE": "2"}),
    "ems_off": (1, 1, {"MICRO_BATCH_SIZE": "1", "FREE_MEMORY": "False"}),
}
EXTRA_CUTS = {"dpo": {"precompute": (1, 1, {"MICRO_BATCH_SIZE": "1", "REFERENCE_LOGPS": "precompute"})}}
LOAD = {"rm": "REWARD_LOAD", "prm": "REWARD_LOAD", "dpo": "POLICY_LOAD"}
VALIDATION = {"rm": "pairs_val.jsonl", "prm": "steps_val.jsonl", "dpo": "pairs_val.jsonl"}
CUT_SETTINGS = ("MICRO_BATCH_SIZE", "MAX_TOKENS_PER_MICRO_BATCH", "FREE_MEMORY", "REFERENCE_LOGPS")


def validation_file(stage_name) -> str:
    """The stage's first 32 held-out rows: every cut validates on them."""
    path = os.path.join(OUT_DIR, VALIDATION[stage_name])
    if not os.path.exists(path) and rank() == 0:
        with open(os.path.join(PIPELINE, VALIDATION[stage_name])) as f, open(path + ".tmp", "w") as out:
            out.writelines(f.readlines()[:32])
        os.replace(path + ".tmp", path)
    return path


def built(stage_name, tp, pp, environment):
    """The stage's config, roles, Stage and step order at this cut."""
    for name in CUT_SETTINGS:  # the last cut's
        os.environ.pop(name, None)
    os.environ.update({"TP": str(tp), "PP": str(pp), "GLOBAL_BATCH_SIZE": "16", "TENSORBOARD": "False",
                       "VAL_FILE": validation_file(stage_name), **environment})
    setup(tp, pp)
    config = load_config(os.path.join(PIPELINE, f"{stage_name}.yaml"), world_size=2)
    tokenizer = build_tokenizer(config.data.tokenizer)
    roles = RoleSet(config, MemoryLedger(None), tokenizer.pad_id)
    stage = steps_class(stage_name)(config, roles, tokenizer, read_rows(config, "data.train_file", tokenizer),
                                    read_rows(config, "data.val_file", tokenizer))
    return roles, stage


def saved(stage, output):
    save_checkpoint(stage.role_set.roles, checkpoint_state(stage, None), output)
    return latest_checkpoint(output)


def weights(checkpoint, trained):
    return dict(full_tensors(os.path.join(checkpoint, trained))) if rank() == 0 else None


def seed_checkpoint(role, root):
    """The role's seeded network as a model checkpoint (TP=1, PP=1), for every cut to load."""
    if rank() == 0:
        state = {k: v.detach().clone() for k, v in local_state_dict(role.model).items()}
        save_shard(root, 0, 0, 1, state)
        write_model_meta(root, role.config.model, ROLE_HEADS[role.name], next(iter(state.values())).dtype, 1, 1)
    torch.distributed.barrier()
    return root


def run(stage_name, name, tp, pp, environment, stop_at=None):
    """STEPS steps at this cut (with ``stop_at``: that many, a checkpoint, newly built roles that
    load it, then the rest), validation and the trained weights."""
    roles, stage = built(stage_name, tp, pp, environment)
    steps = [stage.step(i) for i in range(1, (stop_at or STEPS) + 1)]
    if stop_at:
        checkpoint = saved(stage, os.path.join(OUT_DIR, stage_name, "stopped"))
        roles, stage = built(stage_name, tp, pp, environment)
        resume(stage, checkpoint)
        steps += [stage.step(i) for i in range(stop_at + 1, STEPS + 1)]
    validation = stage.validate()
    checkpoint = saved(stage, os.path.join(OUT_DIR, stage_name, name))
    return StageRun(steps=steps, validation=validation, weights=weights(checkpoint, stage.trained))


result = StageInvariance(runs={})
setup(1, 1)
for stage_name in LOAD:
    validation_file(stage_name)
torch.distributed.barrier()
for stage_name in LOAD:
    roles, stage = built(stage_name, 1, 1, {"MICRO_BATCH_SIZE": "1"})
    with roles.resident(stage.trained, "inference"):
        os.environ[LOAD[stage_name]] = seed_checkpoint(stage.role, os.path.join(OUT_DIR, stage_name, "start"))
    for name, (tp, pp, environment) in {**CUTS, **EXTRA_CUTS.get(stage_name, {})}.items():
        result.runs[f"{stage_name}:{name}"] = run(stage_name, name, tp, pp, environment)
    result.runs[f"{stage_name}:resumed"] = run(stage_name, "resumed", 1, 1, {"MICRO_BATCH_SIZE": "1"}, stop_at=2)
save(result)
