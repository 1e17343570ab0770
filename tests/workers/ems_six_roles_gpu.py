"""On CUDA: six roles colocated, EMS on and then off, two passes each (the first creates Adam's
state; the second is measured). Per phase: what the allocator held before the onload and after it,
the active role's state bytes (ledger count) and the allocator's peak during the phase, all above
the level before any role was built."""

import gc

import torch
from common import save, setup, tiny_arch, warm_up_gpu_libraries
from tests.workers.findings import Colocated, ColocatedPhase, EMSSixRolesGPU

from megatron_rlhf.config.schema import ROLE_HEADS, PPO_ROLES, TRAINABLE_ROLES, RoleConfig
from megatron_rlhf.memory import LEDGER_KINDS
from megatron_rlhf.models.decoder import build_model
from megatron_rlhf.models.training import next_token_loss, scalar_regression_loss, wrap_for_training
from megatron_rlhf.roles.base import assemble_role

parallel = setup(1, 1)
arch = tiny_arch(hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16, num_query_groups=4,
                 num_layers=4, vocab_size=8192)
tokens = torch.randint(0, arch.vocab_size, (2, 256), device="cuda")
warm_up_gpu_libraries(arch, parallel, tokens)  # their workspaces are part of every baseline


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def requested() -> int:
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


def colocate(free_memory: bool) -> Colocated:
    gc.collect()
    torch.cuda.empty_cache()
    baseline = allocated()
    roles = {}
    for name in PPO_ROLES:
        rc = RoleConfig(precision="bf16", lr=1e-5, free_memory=free_memory)
        model, optimizer = build_model(arch, parallel, ROLE_HEADS[name], precision="bf16"), None
        if name in TRAINABLE_ROLES:
            model, optimizer = wrap_for_training(model, rc)
        roles[name] = assemble_role(name, rc, model, optimizer)
        roles[name].memory.offload()
    phases = []
    for _ in range(2):
        phases = []
        for name, role in roles.items():
            torch.cuda.reset_peak_memory_stats()
            start, asked = allocated(), requested()
            with role.resident("training" if role.trainable else "inference"):
                onloaded, asked = allocated(), requested() - asked
                state = sum(role.memory.resident_bytes()[k] for k in LEDGER_KINDS)
                if role.trainable:
                    role.train_step([{"tokens": tokens}], next_token_loss if role.head == "lm" else scalar_regression_loss)
                else:
                    role.forward([{"tokens": tokens}])
                torch.cuda.synchronize()
            phases.append(ColocatedPhase(role=name, start=start - baseline, onloaded=onloaded - baseline, state=state,
                                         requested=asked, peak=torch.cuda.max_memory_allocated() - baseline))
    with_all = {}
    for name, role in roles.items():
        role.memory.onload()
        with_all[name] = sum(role.memory.resident_bytes()[k] for k in LEDGER_KINDS)
    del roles, role
    gc.collect()
    torch.cuda.empty_cache()
    return Colocated(phases=phases, full_state=with_all)


save(EMSSixRolesGPU(on=colocate(True), off=colocate(False)))
