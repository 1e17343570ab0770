"""Train a role for several steps with a full offload/onload of every kind between steps, and the
same run without EMS: losses, parameters and optimizer state must be bit-identical.
Covers TP=2 and DP=2 (2 processes; one process: TP=1), distributed optimizer on and off, fp32 and bf16."""

import os

import torch
from common import save, setup, tiny_arch
from tests.workers.findings import EMSBitExact, EMSOnAndOff, EMSTrained
from megatron.core import parallel_state as ps

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.memory import OFFLOAD_ORDER
from megatron_rlhf.models.decoder import build_model
from megatron_rlhf.models.training import next_token_loss, wrap_for_training
from megatron_rlhf.roles.base import assemble_role
from megatron_rlhf.runtime import get_platform, set_seed

arch = tiny_arch()




def optimizer_tensors(optimizer):
    out = {}
    for i, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        for j, (p, state) in enumerate(opt.optimizer.state.items()):
            for k, v in state.items():
                if torch.is_tensor(v):
                    out[f"{i}.{j}.{k}"] = v.detach().clone()
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for g, group in enumerate(getattr(opt, name, [])):
                for j, t in enumerate(group):
                    out[f"{i}.{name}.{g}.{j}"] = t.detach().clone()
    return out


def run(precision, dist_opt, ems):
    set_seed(11)
    rc = RoleConfig(precision=precision, lr=1e-3, use_distributed_optimizer=dist_opt, free_memory=ems)
    model = build_model(arch, parallel, "lm", precision=precision)
    model, optimizer = wrap_for_training(model, rc)
    role = assemble_role("ppo_policy", rc, model, optimizer)
    gen = torch.Generator().manual_seed(5)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    losses, moved = [], []
    for _ in range(4):
        batch = torch.randint(0, arch.vocab_size, (4, 16), generator=gen).chunk(dp)[dp_rank].to(get_platform().device)
        mbs = [{"tokens": t} for t in batch.split(1)]
        with role.resident("training"):
            step = role.train_step(mbs, next_token_loss)
        if ems:
            moved.append({k: role.memory.resident_bytes()[k] for k in OFFLOAD_ORDER})
        losses += [m["loss"].item() for m in step["metrics"]]
    with role.resident("training"):
        params = {n: p.detach().clone() for n, p in role.model.named_parameters()}
        state = optimizer_tensors(optimizer)
        resident = role.memory.resident_bytes()
    return EMSTrained(losses=losses, params=params, state=state, moved=moved, resident=resident)


result = EMSBitExact(runs={})
for tp in ((2, 1) if int(os.environ["WORLD_SIZE"]) == 2 else (1,)):  # TP=2 (DP=1), then DP=2
    parallel = setup(tp, 1)
    for precision in ("fp32", "bf16"):
        for dist_opt in (True, False):
            key = f"tp{tp}_dp{ps.get_data_parallel_world_size()}_{precision}_{'dist' if dist_opt else 'local'}"
            result.runs[key] = EMSOnAndOff(off=run(precision, dist_opt, False), on=run(precision, dist_opt, True))
save(result)
