"""Training steps of the tiny model on one global batch of 8 samples, split over however many
data-parallel ranks the world has. Args: distributed optimizer on/off ("dist"/"local"), precision,
and optionally "recompute" (full activation recomputation)."""

import torch
from common import ARGS, save, setup, tiny_arch
from tests.workers.findings import DPStep
from megatron.core import parallel_state as ps

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.models.decoder import build_model, unwrap
from megatron_rlhf.models.training import next_token_loss, train_step, wrap_for_training

use_dist_opt = ARGS[0] == "dist"
precision = ARGS[1] if len(ARGS) > 1 else "fp32"
recompute = "recompute" in ARGS[2:]
arch = tiny_arch()
parallel = setup(1, 1, seed=7)  # same seed on every rank: the same initial weights everywhere
dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
gen = torch.Generator().manual_seed(3)
global_batch = torch.randint(0, arch.vocab_size, (8, 16), generator=gen)
mine = global_batch.chunk(dp)[dp_rank]
micro_batches = [{"tokens": mine[i : i + 2]} for i in range(0, mine.shape[0], 2)]

model = build_model(arch, parallel, "lm", precision=precision, recompute_activations=recompute)
ddp, optimizer = wrap_for_training(
    model, RoleConfig(precision=precision, lr=1e-3, use_distributed_optimizer=use_dist_opt)
)


def snapshot():
    return {k: v.detach().float().clone() for k, v in unwrap(ddp).state_dict().items() if not k.endswith("_extra_state")}


initial = snapshot()
for _ in range(3):
    train_step(ddp, optimizer, micro_batches, next_token_loss)
params = snapshot()
moved = max((params[k] - initial[k]).abs().max().item() for k in params)
save(DPStep(params=params, dp=dp, moved=moved, recompute=unwrap(ddp).config.recompute_granularity))
