"""megatron-rlhf: PPO-based RLHF on megatron-core with Efficient Memory Sharing (EMS)."""

__version__ = "0.1.0"
