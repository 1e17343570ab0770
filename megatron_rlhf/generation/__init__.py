"""Sampling responses from a Megatron policy (KV cache, TP, PP)."""

from megatron_rlhf.generation.generate import Generated, generate, right_pad
from megatron_rlhf.generation.sampling import SamplingParams, filter_logits, sample_next

__all__ = ["Generated", "SamplingParams", "filter_logits", "generate", "right_pad", "sample_next"]
