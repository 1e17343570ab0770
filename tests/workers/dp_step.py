"""Training steps of the tiny model on one global batch of 8 samples, split over however many
data-parallel ranks the world has, for each variant named in the arguments: "dist" or "local" (the
distributed optimizer on or off), "+recompute" (full activation recomputation), "+local_attention"
(megatron's own core attention instead of the fused default), fp32."""

import torch
from common import ARGS, save, setup, tiny_arch
from tests.workers.findings import DPRun, DPStep
from megatron.core import parallel_state as ps

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.models.decoder import build_model, unwrap
from megatron_rlhf.models.training import next_token_loss, train_step, wrap_for_training

arch = tiny_arch()


def steps(variant: str) -> DPRun:
    use_dist_opt, recompute = variant.split("+")[0] == "dist", variant.endswith("+recompute")
    attention = "local" if variant.endswith("+local_attention") else "fused"
    parallel = setup(1, 1, seed=7)  # same seed on every rank: the same initial weights everywhere
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    global_batch = torch.randint(0, arch.vocab_size, (8, 16), generator=torch.Generator().manual_seed(3))
    mine = global_batch.chunk(dp)[dp_rank]
    micro_batches = [{"tokens": mine[i : i + 2]} for i in range(0, mine.shape[0], 2)]
    model = build_model(arch, parallel, "lm", precision="fp32", recompute_activations=recompute,
                        attention=attention)
    ddp, optimizer = wrap_for_training(model, RoleConfig(precision="fp32", lr=1e-3, use_distributed_optimizer=use_dist_opt))

    def snapshot():
        return {k: v.detach().float().clone() for k, v in unwrap(ddp).state_dict().items() if not k.endswith("_extra_state")}

    initial = snapshot()
    grad_norms = [float(train_step(ddp, optimizer, micro_batches, next_token_loss)["grad_norm"]) for _ in range(3)]
    params = snapshot()
    moved = max((params[k] - initial[k]).abs().max().item() for k in params)
    core = type(unwrap(ddp).decoder.layers[0].self_attention.core_attention).__name__
    return DPRun(params=params, moved=moved, recompute=unwrap(ddp).config.recompute_granularity, core_attention=core,
                 grad_norms=grad_norms)


runs = {variant: steps(variant) for variant in ARGS}
save(DPStep(dp=ps.get_data_parallel_world_size(), runs=runs))
