"""Routing replay on a tiny Qwen3-MoE (4 experts, top-2, a dense first layer), at EP = the world
size and at PP = the world size (the first stage has no experts). The policy generates (recording its routing), the old-log-prob pass records its own, then
optimizer steps at a high learning rate move the router; later forwards (inference and training)
run with the record replayed and without. What each forward actually routed is read from the
routers' outputs by a forward hook, independently of the replay machinery."""

import os

import torch
from common import save, setup, tiny_arch
from tests.workers.findings import Replayed, RoutingReplay
from megatron.core import parallel_state as ps

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.generation import SamplingParams, generate
from megatron_rlhf.models import routing
from megatron_rlhf.models.batches import length_grouped, ungrouped
from megatron_rlhf.models.decoder import build_model
from megatron_rlhf.models.training import next_token_loss, train_step, wrap_for_training
from megatron_rlhf.roles import inference
from megatron_rlhf.roles.base import assemble_role

ARCH = tiny_arch(family="qwen3_moe", qk_norm=True, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                 moe_dense_layers=[0])
ROWS = 6


class RoutedExperts:
    """The routing map [T, E] of every router call, in call order (per stage: its own layers)."""

    def __init__(self, model):
        self.maps = []
        for router in routing.routers(model):
            router.register_forward_hook(lambda module, args, output: self.maps.append(output[1].detach().clone()))

    def as_rows(self, batch: int, seq: int, layers: int) -> torch.Tensor:
        """The calls of one forward of a [b, s] batch -> [b, s, L, E] (bool)."""
        maps, self.maps = self.maps[len(self.maps) - layers:], []
        if not maps:
            return torch.zeros(batch, seq, 0, ARCH.num_experts, dtype=torch.bool)
        return torch.stack([m.reshape(-1, batch, m.shape[-1]).transpose(0, 1) for m in maps], dim=2)


def case(pp: int, ep: int) -> Replayed:
    parallel = setup(1, pp, seed=3, ep=ep)
    model = build_model(ARCH, parallel, "lm")
    routing.enable(model)
    ddp, optimizer = wrap_for_training(model, RoleConfig(precision="fp32", lr=0.05, use_distributed_optimizer=False))
    role = assemble_role("ppo_policy", RoleConfig(precision="fp32", micro_batch_size=2), ddp, optimizer)
    seen = RoutedExperts(ddp)
    layers = len(routing.routers(ddp))  # 0 on a stage without experts

    rng = torch.Generator().manual_seed(7 + ps.get_data_parallel_rank())
    prompt_lengths = torch.randint(3, 8, (ROWS,), generator=rng)
    prompts = torch.randint(3, ARCH.vocab_size, (ROWS, 8), generator=rng)
    params = SamplingParams(max_new_tokens=12, eos_ids=(1,), pad_id=0)
    out = generate(ddp, prompts, prompt_lengths, params, ARCH.vocab_size, batch_size=4, record_routes=True,
                   seeds=torch.arange(ROWS) + 100 * ps.get_data_parallel_rank())
    tokens, lengths = out.tokens, out.total_lengths

    def routed(run_micro_batch, routes):
        """What every position of every row was routed to, [B, S, L, E] (uint8; 0 at trimmed
        positions), a micro-batch of 2 rows at a time through ``run_micro_batch`` (replaying ``routes``)."""
        columns = {"tokens": tokens} if routes is None else {"tokens": tokens, routing.ROUTES: routes}
        grouped, order = length_grouped(2, lengths, **columns)
        parts = []
        for mb in grouped:
            seen.maps.clear()
            run_micro_batch(mb)
            parts.append(seen.as_rows(*mb["tokens"].shape, layers).to(torch.uint8))
        return ungrouped(parts, order, tokens.shape[1])

    recorded = []
    inference.log_probs(role, tokens, lengths, ARCH.vocab_size, routes_out=recorded)
    # The experts the old-log-prob pass used, seen by the hooks: the record is what was routed.
    result = Replayed(engine=out.routes, record=recorded[0], lengths=lengths, layers=layers, routed={},
                      recorded_inference=routed(lambda mb: role.forward([mb]), None))
    # Optimizer steps on the generated rows move the router.
    for _ in range(3):
        train_step(ddp, optimizer, length_grouped(2, lengths, tokens=tokens)[0], next_token_loss)
    for name, routes in (("replayed", recorded[0]), ("free", None)):
        result.routed[(name, "inference")] = routed(lambda mb: role.forward([mb]), routes)
        # Each training micro-batch is an optimizer step of its own: the router keeps moving.
        result.routed[(name, "training")] = routed(lambda mb: train_step(ddp, optimizer, [mb], next_token_loss), routes)
    return result


world = int(os.environ["WORLD_SIZE"])
save(RoutingReplay(experts=ARCH.num_experts, ep2=case(1, world), pp2=case(world, 1)))
