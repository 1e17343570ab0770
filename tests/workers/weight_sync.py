"""Weight sync between a trained role and its inference role, TP=2: shared storage when dtypes
match (no copy, counted once, moved together), a copy at start-up and after each step when they do not."""

import os

import torch
from common import save, setup
from tests.workers.findings import WeightSync as WeightSyncFindings

from megatron_rlhf.config import load_config
from megatron_rlhf.memory.manager import WEIGHTS
from megatron_rlhf.models.decoder import unwrap
from megatron_rlhf.models.training import next_token_loss
from megatron_rlhf.roles import build_role
from megatron_rlhf.roles.weight_sync import WeightSync

config = load_config("examples/tiny/rlhf.yaml", world_size=int(os.environ["WORLD_SIZE"]))
setup(config.parallel.tensor_model_parallel_size)
tokens = torch.randint(3, 30, (4, 12), generator=torch.Generator().manual_seed(0))
mbs = [{"tokens": t} for t in tokens.split(2)]


def params(role):
    return [p for p in unwrap(role.model).parameters()]


result = WeightSyncFindings.to_fill()
# Same dtype: shared storage.
ppo_policy, policy = build_role("ppo_policy", config), build_role("policy", config)
sync = WeightSync(ppo_policy, policy, share=config.weight_owner("policy") is not None)
result.shared = sync.shared
result.same_storage = all(
    a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for a, b in zip(params(ppo_policy), params(policy))
)
result.policy_weight_bytes = policy.memory.resident_bytes()[WEIGHTS]
with policy.resident("inference"):
    result.owner_onloaded_with_policy = ppo_policy.memory.is_resident(WEIGHTS)
result.owner_offloaded_after = not ppo_policy.memory.is_resident(WEIGHTS)
with ppo_policy.resident("training"):
    ppo_policy.train_step(mbs, next_token_loss)
sync()
with policy.resident("inference"), ppo_policy.resident("inference"):
    result.shared_equal_after_step = all(torch.equal(a, b) for a, b in zip(params(ppo_policy), params(policy)))

# Different dtypes (bf16 serving, fp32 training): copied after each step.
config.policy.precision = "bf16"
policy16 = build_role("policy", config)
ppo32 = build_role("ppo_policy", config)
with ppo32.resident("inference"), torch.no_grad():
    for p in params(ppo32):
        p.add_(0.01)  # the trained role starts elsewhere (its own checkpoint): serving must follow
sync16 = WeightSync(ppo32, policy16, share=config.weight_owner("policy") is not None)
result.copy_shared = sync16.shared
with policy16.resident("inference"), ppo32.resident("inference"):
    result.copied_at_start = all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(params(ppo32), params(policy16)))
with ppo32.resident("training"):
    ppo32.train_step(mbs, next_token_loss)
with policy16.resident("inference"), ppo32.resident("inference"):
    result.stale_before_sync = all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(params(ppo32), params(policy16)))
sync16()
with policy16.resident("inference"), ppo32.resident("inference"):
    result.copied = all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(params(ppo32), params(policy16)))
save(result)
