"""The typed records a rollout is built in: the prompts of a batch expanded to their samples
(``Prompts``), and the experience of one iteration (``Rollout``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from megatron_rlhf.generation import stream_seeds


# The sample rows' column of the engine's log-probs of the tokens it sampled (the behaviour policy's).
BEHAVIOUR = "behaviour_log_probs"


@dataclasses.dataclass
class Prompts:
    """A batch of prompts, each repeated for its ``samples`` responses (adjacent rows): tokens
    [B, P] right-padded, prompt_lengths [B], seeds [B] (each response's sampling stream),
    prompt_index [B] (the dataset row), and per row the prompt as the reward sees it, the row's
    other columns, and the prompt as the data gave it (a string or a chat)."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    seeds: torch.Tensor
    prompt_index: torch.Tensor
    texts: List[str]
    fields: List[Dict[str, Any]]
    samples: int

    @classmethod
    def expand(cls, batch: Dict[str, Any], samples: int, seed: int, iteration: int, round_: int,
               device: torch.device) -> "Prompts":
        """``batch`` (PromptDataset.batch_of) with every prompt repeated ``samples`` times. Every
        response draws from its own stream, keyed by what it is (run, iteration, round, prompt,
        sample): the rollout does not depend on the DP layout or the decode batch."""
        indices = torch.tensor(batch["indices"]).repeat_interleave(samples)
        seeds = stream_seeds(seed, iteration, round_, indices, torch.arange(samples).repeat(len(batch["indices"])))
        return cls(batch["tokens"].repeat_interleave(samples, 0).to(device),
                   batch["lengths"].repeat_interleave(samples).to(device), seeds.to(device), indices.to(device),
                   [t for t in batch["texts"] for _ in range(samples)],
                   [f for f in batch["fields"] for _ in range(samples)], samples)

    def columns(self) -> Dict[str, torch.Tensor]:
        """The tensors the engine reads (rows of one layout's cut are recut from these)."""
        return {"tokens": self.tokens, "prompt_lengths": self.prompt_lengths, "seeds": self.seeds,
                "prompt_index": self.prompt_index}


@dataclasses.dataclass
class Rollout:
    """This data-parallel rank's share of one iteration's experience. [B, S] tokens (prompt, then
    the response: one turn of the model, or a trajectory of turns with the environment's replies
    between them); every per-token tensor is [B, S-1] over action positions (models/batches.py).
    ``action_mask`` is the loss mask: 1 where the action emitted a token the model wrote, 0 at the
    prompt, the environment's tokens and padding; every loss, KL, entropy, value and advantage
    counts those positions only. The responses to one prompt are adjacent rows; ``group_index`` [B]
    numbers those groups."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor  # positions after the prompt (the model's and the environment's)
    action_mask: torch.Tensor
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor
    scores: torch.Tensor  # [B], as the reward gave them (plus any overlong penalty)
    group_index: torch.Tensor
    old_values: Optional[torch.Tensor] = None  # GAE only
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None  # GAE only
    routes: Optional[torch.Tensor] = None  # [B, S, L, K], routing replay's record (models/routing.py)
    # [B, S-1]: the engine's log-probs of the tokens it sampled (rollout correction; ppo/correction.py)
    behaviour_log_probs: Optional[torch.Tensor] = None
    correction: Optional[Any] = None  # ppo.Correction: the policy loss's token weights and mask
    # [B, S-1]: a process reward model's step scores at the actions that ended the steps (reward.step_aggregation
    # token), the per-token rewards in place of the score at the last token
    step_rewards: Optional[torch.Tensor] = None

    @property
    def lengths(self) -> torch.Tensor:
        """[B] real tokens per row."""
        return self.prompt_lengths + self.response_lengths


# The rollout's metrics that are counts: added over scoring rounds and DP ranks (the others are
# means; times are added over rounds).
COUNTED_METRICS = ("reward/failures", "reward/timeouts", "rollout/env_calls", "rollout/env_failures",
                   "rollout/env_timeouts", "rollout/truncated_observations", "rollout/prefix_recomputed",
                   "rollout/context_truncated", "rollout/partial_dropped", "rollout/partial_resumed",
                   "rollout/env_replayed_calls", "judge/unparsed", "judge/too_long",
                   "judge/failures", "judge/timeouts")


# How the work was scheduled, not what it computed: they follow the layout, the decode slots and
# when each environment's reply came (like time/*), where every other metric stays the same.
SCHEDULE_METRICS = ("rollout/slot_occupancy",)

# An environment's own counts (agents/protocol.py: info["counts"]) are counts too.
COUNTED_PREFIXES = ("rollout/tool_", "rollout/env_")


def is_counted(key: str) -> bool:
    """Whether the metric ``key`` is a count (added over rounds and DP ranks, not averaged): the
    listed ones, an environment's, and a reward function's own failures (reward/<name>/failures)."""
    return (key in COUNTED_METRICS or key.startswith(COUNTED_PREFIXES)
            or key.startswith("reward/") and key.endswith("/failures"))


def merged_metrics(parts: List[Dict[str, float]]) -> Dict[str, float]:
    """The metrics of an iteration's rounds (generation, scoring): counts and times added, means averaged."""
    merged: Dict[str, float] = {}
    for key in sorted({k for part in parts for k in part}):
        values = [part[key] for part in parts if key in part]
        merged[key] = sum(values) if is_counted(key) or key.startswith("time/") else sum(values) / len(values)
    return merged


@dataclasses.dataclass
class Collected:
    """What collecting a rollout gives: the rollout, a few of its rows as the run shows them
    (prompt, response, score, ground truth), and the metrics of collecting it (sampling, rewards,
    turns; ``time/generate_s``)."""

    rollout: Rollout
    samples: List[Dict[str, Any]]
    metrics: Dict[str, float]
