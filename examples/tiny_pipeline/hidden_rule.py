"""The pipeline demo's measure, independent of the reward model: the hidden rule's score (the share
of vowels, make_data.vowel_share) of a policy checkpoint's sampled answers to held-out prompts.

    torchrun --nproc_per_node=1 examples/tiny_pipeline/hidden_rule.py [--alphabet A] POLICY [POLICY ...]

Each POLICY is a policy's model checkpoint (an SFT or DPO run's checkpoints/iter_N/policy, a
PPO run's checkpoints/iter_N/ppo_policy), or ``initial:CONFIG``: the seeded policy a run of CONFIG
(at TP=1) starts from, built as that run builds it. ``--alphabet``: the character tokenizer's (the
judge demo's has digits); prints one line per policy.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_data import vowel_share  # noqa: E402

from megatron_rlhf.checkpoint import load_model_shard  # noqa: E402
from megatron_rlhf.checkpoint.model_files import read_model_meta  # noqa: E402
from megatron_rlhf.config.schema import ParallelConfig  # noqa: E402
from megatron_rlhf.data import CharTokenizer  # noqa: E402
from megatron_rlhf.generation import SamplingParams, generate  # noqa: E402
from megatron_rlhf.models.decoder import build_model, load_local_state_dict  # noqa: E402
from megatron_rlhf.runtime import init_distributed  # noqa: E402

PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pairs_val.jsonl")  # never trained on by PPO
SAMPLES_PER_PROMPT = 4


def policy_model(policy: str, parallel: ParallelConfig):
    """The network of a policy checkpoint, or of ``initial:CONFIG``'s seeded policy (roles/base.build_role)."""
    if policy.startswith("initial:"):
        from megatron_rlhf.config import load_config
        from megatron_rlhf.roles.base import build_role

        role = build_role("policy", load_config(policy.partition(":")[2], world_size=1))
        role.memory.onload()
        return role.model
    arch, meta = read_model_meta(policy)
    model = build_model(arch, parallel, "lm")
    load_local_state_dict(model, load_model_shard(policy, arch, "lm", 1, 0, 1, 0))
    return model


def score(policy: str, tokenizer: CharTokenizer, parallel: ParallelConfig) -> float:
    model = policy_model(policy, parallel)
    model.eval()
    with open(PROMPTS, encoding="utf-8") as f:
        prompts = [tokenizer.encode_prompt(json.loads(line)["prompt"], chat=False) for line in f]
    prompts = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros((len(prompts), int(lengths.max())), dtype=torch.long)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = torch.tensor(p)
    params = SamplingParams(max_new_tokens=16, eos_ids=tokenizer.eos_ids, pad_id=tokenizer.pad_id)
    seeds = torch.arange(len(prompts))  # the same sampling streams for every checkpoint
    out = generate(model, tokens, lengths, params, tokenizer.vocab_size, seeds=seeds)
    answers = [tokenizer.decode(out.tokens[r, n : n + int(out.response_lengths[r])].tolist())
               for r, n in enumerate(lengths.tolist())]
    return sum(vowel_share(a) for a in answers) / len(answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alphabet", default="abcdefghijklmnopqrstuvwxyz ")
    parser.add_argument("policies", nargs="+")
    args = parser.parse_args()
    parallel = ParallelConfig()
    init_distributed(parallel, seed=0)
    tokenizer = CharTokenizer(args.alphabet)
    for policy in args.policies:
        print(f"hidden rule (vowel share) {score(policy, tokenizer, parallel):.3f}: {policy}", flush=True)


if __name__ == "__main__":
    main()
