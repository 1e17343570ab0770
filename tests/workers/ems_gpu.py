"""On CUDA: host buffers are pinned, and after every offload of a role that trained, the allocator's
allocated AND reserved bytes return to their level before the onload (empty_cache on)."""

import torch
from common import save, setup, tiny_arch, warm_up_gpu_libraries
from tests.workers.findings import EMSGPU, GPURound

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.models.decoder import build_model
from megatron_rlhf.models.training import next_token_loss, wrap_for_training
from megatron_rlhf.roles.base import assemble_role

parallel = setup(1, 1)
arch = tiny_arch(hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=16, num_query_groups=4,
                 num_layers=4, vocab_size=8192)
rc = RoleConfig(precision="bf16", lr=1e-5, free_memory=True)
model, optimizer = wrap_for_training(build_model(arch, parallel, "lm", precision="bf16"), rc)
role = assemble_role("ppo_policy", rc, model, optimizer)
role.memory.offload()
# Other tenants of the device (the idle roles' leftovers, activations of the caller): a fixed
# ballast, so that "the level before" is a real level.
ballast = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
tokens = torch.randint(0, arch.vocab_size, (2, 256), device="cuda")
warm_up_gpu_libraries(arch, parallel, tokens)  # their workspaces are part of "the level before"


def levels():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


rounds = []
for _ in range(3):
    torch.cuda.empty_cache()
    before = levels()
    with role.resident("training"):
        state = sum(role.memory.resident_bytes().values())  # while resident: after the offload it is 0
        role.train_step([{"tokens": tokens}], next_token_loss)
        during = levels()
    rounds.append(GPURound(before=before, during=during, after=levels(), state=state))
pinned = [m._arena.is_pinned() for m in role.memory._movers.values() if m._arena is not None]
save(EMSGPU(rounds=rounds, pinned=pinned))
