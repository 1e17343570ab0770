"""EMS behaviours on one process: idempotent moves, host buffers reused across round trips,
refusal to free gradients mid-accumulation, phase needs, and RSS actually released on CPU."""

import torch
from common import save, setup, tiny_arch
from tests.workers.findings import EMSUnits, RSSDrop

from megatron_rlhf.config.schema import RoleConfig
from megatron_rlhf.memory import GRADS, MAIN_PARAMS, OPTIMIZER_STATE, WEIGHTS, GradientsInUse
from megatron_rlhf.models.decoder import build_model
from megatron_rlhf.models.pipeline import forward_backward
from megatron_rlhf.models.training import next_token_loss, wrap_for_training
from megatron_rlhf.roles.base import assemble_role
from megatron_rlhf.runtime import get_platform

parallel = setup(1, 1)
result = EMSUnits.to_fill()




def make_role(arch, precision="bf16", **switches):
    rc = RoleConfig(precision=precision, lr=1e-3, **switches)
    model, optimizer = wrap_for_training(build_model(arch, parallel, "lm", precision=precision), rc)
    return assemble_role("ppo_policy", rc, model, optimizer)


arch = tiny_arch()
role = make_role(arch, free_memory=True)
mbs = [{"tokens": torch.randint(0, arch.vocab_size, (2, 16))} for _ in range(2)]
with role.resident("training"):
    role.train_step(mbs, next_token_loss)
memory = role.memory

# Idempotence and reuse: a second offload moves nothing; host arenas survive round trips and hold
# exactly the bytes offloaded.
memory.onload()
moved = sum(memory.resident_bytes()[k] for k in (WEIGHTS, MAIN_PARAMS, OPTIMIZER_STATE))
memory.offload()
result.offloaded_and_host_bytes = (moved, memory.host_bytes())
host_ptrs = memory._movers[OPTIMIZER_STATE]._arena.data_ptr()
host_bytes = memory.host_bytes()
memory.offload()
result.idempotent_offload_host_bytes = (host_bytes, memory.host_bytes())
with role.resident("training"):
    weights = {n: p.detach().clone() for n, p in role.model.named_parameters()}
    memory.onload()  # onloading what is resident is a no-op
    result.onload_twice_same = all(torch.equal(weights[n], p) for n, p in role.model.named_parameters())
result.host_buffers_reused = host_ptrs == memory._movers[OPTIMIZER_STATE]._arena.data_ptr() \
    and memory.host_bytes() == host_bytes

# An inference phase brings back the weights alone, and only reads them: its offload copies nothing.
# A phase that may write them (training, or a plain onload) makes the next offload copy again.
copied = memory.copied_bytes()
with role.resident("inference"):
    result.inference_resident = memory.resident_bytes()
result.copied_by_inference_offload = memory.copied_bytes() - copied
memory.onload([WEIGHTS])
memory.offload()
result.copied_after_plain_onload = memory.copied_bytes() - copied

# Gradients mid-accumulation are never silently discarded.
with role.resident("training"):
    role.model.zero_grad_buffer()
    forward_backward(role.model, mbs, next_token_loss, forward_only=False)  # backward, no step yet
    try:
        memory.offload([GRADS])
        result.grads_in_use = "offloaded"
    except GradientsInUse as e:
        result.grads_in_use = str(e)
    result.grads_kept = memory.resident_bytes()[GRADS]
    role.train_step(mbs, next_token_loss)  # a completed step consumes them: freeing is allowed again
memory.offload([GRADS])
result.grads_freed_after_step = memory.resident_bytes()[GRADS]

# The leak guard: a parameter re-pointed to a storage of its own while the role is on the device
# (a tensor kept on the device across an offload) is reported after the offload, as a warning or an
# error; a clean offload reports nothing.
import warnings  # noqa: E402

from megatron_rlhf.memory import MemoryLeak, MemoryLeakWarning, MemoryLedger  # noqa: E402

leaky = make_role(arch, free_memory=True)
ledger = MemoryLedger(guard="warn")
ledger.track(leaky.memory)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with leaky.resident("training"):
        leaky.train_step(mbs, next_token_loss)
    result.clean_offload_reports = list(ledger.leaks)
    with leaky.resident("inference"):
        planted = next(p for p in leaky.model.parameters() if p.dim() == 2)
        planted.data = planted.data.clone()
result.leak_warning = [str(w.message) for w in caught if issubclass(w.category, MemoryLeakWarning)]
result.planted_bytes = planted.untyped_storage().nbytes()
ledger.guard = "error"
try:
    with leaky.resident("inference"):
        pass
    result.leak_error = "nothing raised"
except MemoryLeak as e:
    result.leak_error = str(e)

# A model built with settings that need fixed device addresses is refused by EMS, not by EMS off.
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402

from megatron_rlhf.memory import EMSSwitches, FixedAddressesNeeded, RoleMemory  # noqa: E402

plain = build_model(arch, parallel, "lm")
gathering = DistributedDataParallel(plain.config, DistributedDataParallelConfig(
    use_distributed_optimizer=True, overlap_param_gather=True), plain)
try:
    RoleMemory("ppo_policy", gathering, None, EMSSwitches(offload_weights=True))
    result.fixed_addresses = "accepted"
except FixedAddressesNeeded as e:
    result.fixed_addresses = str(e)
result.fixed_addresses_without_ems = RoleMemory("ppo_policy", gathering, None, EMSSwitches()).switches.kinds()

# RSS: freeing grad buffers and optimizer state (host buffers already allocated by a first round
# trip) gives their bytes back to the OS.
import gc

big = tiny_arch(hidden_size=512, ffn_hidden_size=1536, num_attention_heads=8, num_query_groups=4, vocab_size=4096)
role = make_role(big, precision="bf16", free_grad_buffers=True, offload_optimizer_state=True)
big_mbs = [{"tokens": torch.randint(0, big.vocab_size, (1, 16))}]
for _ in range(2):
    with role.resident("training"):
        role.train_step(big_mbs, next_token_loss)
platform = get_platform()
gc.collect()
role.memory.onload()
platform.empty_cache()
before_bytes = role.memory.resident_bytes()
rss_before = platform.memory_stats()["rss"]
role.memory.offload()
gc.collect()
platform.empty_cache()
rss_after = platform.memory_stats()["rss"]
freed = sum(before_bytes[k] for k in (GRADS, MAIN_PARAMS, OPTIMIZER_STATE))
result.rss = RSSDrop(before=rss_before, after=rss_after, freed_state_bytes=freed, by_kind=before_bytes,
                     after_kinds=role.memory.resident_bytes())
save(result)
