"""Our SFT, reward-model and DPO losses on converted tiny models (1 process): each case's loss, its
metrics and every parameter's gradient under its Hugging Face name, for the test to hold against
TRL's trainers and transformers' own loss on the same weights and tokens.
Args: POLICY_DIR REFERENCE_DIR REWARD_DIR BATCH_FILE (torch.save of {"pairs": [(prompt, chosen,
rejected, margin)], "cases": {name: settings}})."""

import dataclasses

import torch
from common import ARGS, hf_grads, save, setup
from tests.workers.findings import PreferenceLosses

from megatron_rlhf import preference
from megatron_rlhf.checkpoint import load_model_shard
from megatron_rlhf.checkpoint.model_files import read_model_meta
from megatron_rlhf.config.schema import DPOConfig, RMConfig, RoleConfig
from megatron_rlhf.data.exchanges import Encoded
from megatron_rlhf.data.preferences import Pair
from megatron_rlhf.models.decoder import build_model, load_local_state_dict
from megatron_rlhf.models.pipeline import model_forward
from megatron_rlhf.models.vocab_parallel import next_token_log_probs
from megatron_rlhf.stages.batches import pair_micro_batches, row_micro_batches
from megatron_rlhf.stages.losses import MEANS, dpo_loss_fn, reward_loss_fn, sft_loss_fn

policy_dir, reference_dir, reward_dir, batch_file = ARGS
batch = torch.load(batch_file)
parallel = setup(1, 1)


def loaded(root):
    arch, meta = read_model_meta(root)
    model = build_model(arch, parallel, meta["head"])
    load_local_state_dict(model, load_model_shard(root, arch, meta["head"], 1, 0, 1, 0))
    return model, arch, meta["head"]


def sequence(prompt, response):
    return Encoded(prompt + response, [0] * len(prompt) + [1] * len(response), len(prompt))


def run(model, arch, head, mb, loss_fn, name):
    model.zero_grad()
    loss_sum, count, metrics = loss_fn(model_forward(model, mb), mb)
    (loss_sum / count).backward()
    result.losses[name] = float(loss_sum / count)
    result.metrics[name] = {k: float(v) / float(metrics[MEANS[k]]) for k, v in metrics.items() if k in MEANS}
    result.grads[name] = hf_grads(model, arch, head)


result = PreferenceLosses(losses={}, metrics={}, grads={})
pairs = [Pair(sequence(p, c), sequence(p, r), m) for p, c, r, m in batch["pairs"]]
whole = dataclasses.replace(RoleConfig(), micro_batch_size=len(pairs))
policy, arch, head = loaded(policy_dir)
reference = loaded(reference_dir)[0]
vocab = arch.vocab_size

# SFT: the chosen responses as demonstrations
mb = row_micro_batches(whole, [p.chosen for p in pairs], False, 0, "cpu")[0]
run(policy, arch, head, mb, sft_loss_fn(vocab), "sft")

# DPO: the reference's sequence log-probs, then each variant
mb = pair_micro_batches(whole, pairs, False, 0, "cpu")[0]
with torch.no_grad():
    mb["ref_logps"] = preference.sequence_log_probs(
        next_token_log_probs(model_forward(reference, mb), mb, vocab), mb["action_mask"])
chosen_tokens = sum(p.chosen.response_tokens for p in pairs)
for name, settings in batch["cases"].items():
    if name.startswith("dpo"):
        run(policy, arch, head, mb, dpo_loss_fn(vocab, DPOConfig(**settings), len(pairs) / chosen_tokens), name)

# The reward model: Bradley-Terry with the rows' margins and TRL's centring
reward, reward_arch, reward_head = loaded(reward_dir)
run(reward, reward_arch, reward_head, mb, reward_loss_fn(RMConfig(**batch["cases"]["rm"])), "rm")
save(result)
