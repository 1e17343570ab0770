"""All six roles of the tiny example in one process group (TP=2), one mini-iteration each way:
inference roles forward, trainable roles a step; the ledger records every move. Args: "on" and/or
"off" (free_memory for every role, through the example's env variables), each run in turn."""

import os

import torch
import torch.distributed as dist
from common import ARGS, OUT_DIR, save, setup
from tests.workers.findings import EMSSixRoles, SixRolesRun

from megatron_rlhf.config import PPO_ROLES, load_config
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.roles import build_role
from megatron_rlhf.models.training import next_token_loss, scalar_regression_loss


def run(mode: str) -> SixRolesRun:
    flag = "True" if mode == "on" else "False"
    for role in PPO_ROLES:
        os.environ[f"free_memory_{role}"] = flag
    config = load_config("examples/tiny/rlhf.yaml", world_size=int(os.environ["WORLD_SIZE"]))
    config.reward.type, config.reward.function = "model", None  # the demo scores by rule; here a network
    config.reward.free_memory = flag == "True"
    setup(config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size)
    path = os.path.join(OUT_DIR, f"memory_{mode}_rank{dist.get_rank()}.jsonl")
    ledger = MemoryLedger(path)
    roles = {}
    for name in PPO_ROLES:
        roles[name] = build_role(name, config)
        ledger.track(roles[name].memory)
    ledger.record("built", "setup")
    full_bytes = {}
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    for iteration in range(2):
        ledger.iteration = iteration
        for name in ("policy", "reference", "reward", "value"):
            with roles[name].resident("inference"):
                roles[name].forward([{"tokens": tokens}])
                full_bytes.setdefault(name, roles[name].memory.resident_bytes())
        for name in ("ppo_policy", "ppo_value"):
            loss = next_token_loss if roles[name].head == "lm" else scalar_regression_loss
            with roles[name].resident("training"):
                roles[name].train_step([{"tokens": t} for t in tokens.split(2)], loss)
                full_bytes[name] = roles[name].memory.resident_bytes()
        ledger.record("phase_end", "iteration")
    return SixRolesRun(records=ledger.records, full_bytes=full_bytes, path=path, peak=ledger.peak_resident_bytes())


save(EMSSixRoles(runs={mode: run(mode) for mode in ARGS}))
