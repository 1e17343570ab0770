"""Measured resident bytes by kind (the ledger's counting) of a trainable and an inference role
under several layouts, next to the planner's figures. Run with 4 processes."""

import os

import torch
from common import save, setup
from megatron.core import parallel_state as ps

from megatron_rlhf.config import load_config
from megatron_rlhf.memory import LEDGER_KINDS
from megatron_rlhf.memory.planner import state_bytes
from megatron_rlhf.models.training import next_token_loss
from megatron_rlhf.roles import build_role

# Tied embeddings (under PP the last stage's own copy), QKV bias, q/k norm, heads of another width.
FEATURES = dict(tie_word_embeddings=True, qkv_bias=True, qk_norm=True, head_dim=24)
LAYOUTS = [  # tp, pp, distributed optimizer, precision, architecture features
    (2, 1, True, "fp32", {}),
    (1, 2, True, "bf16", {}),
    (2, 2, True, "bf16", {}),
    (1, 1, False, "fp32", {}),
    (1, 1, True, "bf16", {}),
    (1, 1, False, "bf16", {}),
    (2, 1, True, "fp32", FEATURES),
    (1, 2, True, "bf16", FEATURES),
]
tokens = torch.randint(3, 30, (4, 16), generator=torch.Generator().manual_seed(0))
result = []
for tp, pp, dist_opt, precision, features in LAYOUTS:
    os.environ.update(TP=str(tp), PP=str(pp))
    config = load_config("examples/tiny/rlhf.yaml", world_size=int(os.environ["WORLD_SIZE"]))
    setup(tp, pp)
    dp, dp_rank, pp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    for name in ("ppo_policy", "value"):
        rc = config.role(name)
        rc.precision, rc.use_distributed_optimizer, rc.free_memory = precision, dist_opt, True
        for key, value in features.items():
            setattr(rc.model, key, value)
        role = build_role(name, config)
        if role.trainable:
            with role.resident("training"):
                role.train_step([{"tokens": t} for t in tokens.split(2)], next_token_loss)
                measured = {k: v for k, v in role.memory.resident_bytes().items() if k in LEDGER_KINDS}
        else:
            with role.resident("inference"):
                measured = {k: v for k, v in role.memory.resident_bytes().items() if k in LEDGER_KINDS}
        planned = state_bytes(rc, role.head, role.trainable, tp, pp, dp, pp_rank, dp_rank)
        result.append({"layout": (tp, pp, dist_opt, precision, sorted(features)), "role": name, "measured": measured, "planned": planned})
        del role
save({"result": result})
