"""Checkpoints: Hugging Face <-> Megatron model conversion, model checkpoint files, PPO save/resume."""

from megatron_rlhf.checkpoint.model_files import CheckpointError, load_model_shard

__all__ = ["CheckpointError", "load_model_shard"]
