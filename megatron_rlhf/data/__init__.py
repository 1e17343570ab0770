"""Prompt data and tokenizers."""

from megatron_rlhf.data.prompts import PromptDataset, read_prompts
from megatron_rlhf.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = ["CharTokenizer", "HFTokenizer", "PromptDataset", "Tokenizer", "build_tokenizer", "read_prompts"]
