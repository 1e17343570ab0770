"""Sampling responses from a Megatron policy: a continuous-batching engine (TP, PP)."""

from megatron_rlhf.generation.generate import EngineStats, Generated, generate, right_pad
from megatron_rlhf.generation.open_run import OpenRun
from megatron_rlhf.generation.session import CacheSession
from megatron_rlhf.generation.sampling import SamplingParams, filter_logits, sample_next, stream_seeds

__all__ = ["CacheSession", "EngineStats", "Generated", "OpenRun", "SamplingParams", "filter_logits", "generate", "right_pad", "sample_next",
           "stream_seeds"]
