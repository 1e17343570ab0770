"""The GRPO demo with LoRA (examples/tiny/grpo_lora.yaml) at TP=1 on one process, 2 iterations:

- the reference is the base: its parameters are views of ppo_policy's base weights, it holds no
  weights of its own, and its log-probs equal those of a reference built separately (exact);
- ppo_policy's base weights are bit-identical after training, its adapters moved, and the
  optimizer holds state for the adapters only (counted);
- a checkpoint after iteration 1, loaded by a new controller: iteration 2 as uninterrupted;
- its ppo_policy exported as a PEFT adapter and named as load_lora: the same ppo_policy (exact).
Saves the findings."""

import copy
import os

import torch
from common import OUT_DIR, capture_rollouts, reward_pool, save, setup
from tests.workers.findings import LoRARun

from megatron_rlhf.checkpoint.peft import write_peft_adapter
from megatron_rlhf.checkpoint.run_checkpoint import save_checkpoint
from megatron_rlhf.controller import PPOController
from megatron_rlhf.memory import MemoryLedger
from megatron_rlhf.memory.manager import OPTIMIZER_STATE, WEIGHTS
from megatron_rlhf.models.decoder import unwrap
from megatron_rlhf.models.lora import is_adapter
from megatron_rlhf.roles import inference
from megatron_rlhf.roles.base import build_role
from megatron_rlhf.startup import prepare
from megatron_rlhf.train import parse_args
from megatron_rlhf.run_loop import checkpoint_state, resume

os.environ.update(TP="1", ITERATIONS="2", PRECISION="fp32")


def controller_for(name: str):
    prepared = prepare(parse_args(["--config", "examples/tiny/grpo_lora.yaml", "--output-dir",
                                   os.path.join(OUT_DIR, name), "--overwrite"]), 1)
    setup(tp=1, seed=prepared.config.seed)
    return prepared, PPOController(prepared.config, copy.deepcopy(prepared.dataset), prepared.tokenizer,
                                   reward_pool(prepared.reward_functions), MemoryLedger(None))


def figures(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}


def params(role) -> dict:
    with role.resident("inference"):
        return {n: p.detach().clone() for n, p in unwrap(role.model).named_parameters()}


result = LoRARun.to_fill()
prepared, whole = controller_for("whole")
roles = whole.roles
reference, trained = roles["reference"], roles["ppo_policy"]
with trained.resident("inference"):
    storages = {p.untyped_storage().data_ptr() for p in unwrap(trained.model).parameters()}
    result.reference_views = all(p.untyped_storage().data_ptr() in storages for p in unwrap(reference.model).parameters())
result.reference_owner = reference.memory.weights_owner is trained.memory
result.reference_weight_bytes = reference.memory.resident_bytes()[WEIGHTS] + reference.memory.host_bytes()
before = params(trained)
captured = capture_rollouts(whole)
steps = [figures(whole.step())]
rollout = captured["rollout"]
checkpoint = save_checkpoint(roles, checkpoint_state(whole, prepared.run), prepared.output_dir)
at_checkpoint = params(trained)
steps.append(figures(whole.step()))
after = params(trained)
result.base_unchanged = all(torch.equal(after[n], before[n]) for n in before if not is_adapter(n))
result.adapters_moved = all(not torch.equal(after[n], before[n]) for n in before if n.endswith("lora_b"))
adapter_numel = sum(p.numel() for n, p in after.items() if is_adapter(n))
result.adapter_tensors = sum(1 for n in after if is_adapter(n))
result.adapter_numel, result.base_numel = adapter_numel, sum(p.numel() for n, p in after.items() if not is_adapter(n))
with trained.resident("training"):
    result.optimizer_numel = sum(t.numel() for t in trained.memory.tensors(OPTIMIZER_STATE))

# The reference's log-probs of iteration 1's rows against a reference built on its own (no LoRA anywhere).
plain = copy.deepcopy(prepared.config)
plain.ppo_policy.lora.rank = 0
separate = build_role("reference", plain)
lengths = rollout.prompt_lengths + rollout.response_lengths
with separate.resident("inference"):
    theirs = inference.log_probs(separate, rollout.tokens, lengths, prepared.tokenizer.vocab_size)
result.reference_log_probs_equal = torch.equal(theirs, rollout.ref_log_probs)

# Its adapters exported as a PEFT adapter and started from (load_lora): ppo_policy as at the checkpoint.
write_peft_adapter(os.path.join(checkpoint, "ppo_policy"), os.path.join(OUT_DIR, "peft"))
os.environ["LOAD_LORA"] = os.path.join(OUT_DIR, "peft")
_, from_peft = controller_for("from_peft")
del os.environ["LOAD_LORA"]
loaded = params(from_peft.roles["ppo_policy"])
result.load_lora_equal = loaded.keys() == at_checkpoint.keys() and all(torch.equal(loaded[n], at_checkpoint[n])
                                                                       for n in loaded)
del from_peft

_, resumed = controller_for("resumed")
resume(resumed, checkpoint)
result.whole, result.resumed = steps, [figures(resumed.step())]
save(result)
