"""A model of another layout than the run's, on its own process groups, served by megatron-core's
resharding. Run with 2 processes: the run's layout is TP=2; the serving models are at TP=1 (DP=2)
and at PP=2. Saves per rank: the full weights of the TP=2 model (its shards gathered), each serving
model's weights after a sync, before and after the trained model changed, and logits of both."""

import torch
import torch.distributed as dist
from common import save, setup, tiny_arch
from tests.workers.findings import Layouts

from megatron_rlhf.config.schema import ParallelConfig
from megatron_rlhf.models.decoder import build_model, local_state_dict
from megatron_rlhf.models.pipeline import gather_vocab_parallel
from megatron_rlhf.models.sharding import merge_state_dicts
from megatron_rlhf.roles.weight_sync import reshard_weights
from megatron_rlhf.runtime.layouts import layout_groups

ARCH = tiny_arch(num_layers=4)
VOCAB = ARCH.padded_vocab_size(2)  # one padded vocabulary for every layout that exchanges weights
tokens = torch.randint(3, ARCH.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
positions = torch.arange(12).unsqueeze(0).expand(3, -1)


def full_weights(model):
    """The TP=2 model's full weights: every rank's shard gathered and merged."""
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, {k: v.detach().clone() for k, v in local_state_dict(model).items()})
    return merge_state_dicts([shards], ARCH.num_layers, ARCH.vocab_size)


setup(2, 1, seed=5)
trained = build_model(ARCH, ParallelConfig(2, 1), "lm")
result = Layouts.to_fill()
result.rank, result.stages, result.full, result.served = dist.get_rank(), {}, {}, {}
servings = {}
for name, (tp, pp) in {"tp1": (1, 1), "pp2": (1, 2)}.items():
    groups = layout_groups(tp, pp)
    servings[name] = build_model(ARCH, ParallelConfig(tp, pp), "lm", pg_collection=groups, padded_vocab=VOCAB)
    result.stages[name] = groups.pp.rank()

for when in ("start", "changed"):
    if when == "changed":  # the trained weights move (as an optimizer step moves them); sync again
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(torch.randn_like(p) * 0.01)
    result.full[when] = full_weights(trained)
    for name, serving in servings.items():
        reshard_weights(trained, serving)
        result.served[(when, name)] = {k: v.detach().clone() for k, v in local_state_dict(serving).items()}
with torch.no_grad():
    result.logits_trained = gather_vocab_parallel(trained(tokens, positions, None))
    result.logits_tp1 = servings["tp1"](tokens, positions, None)
save(result)
