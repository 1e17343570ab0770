"""Prompt data (JSONL or Parquet rows, chat templates, the row's other columns) and tokenizers."""

from megatron_rlhf.data.prompts import PromptDataset
from megatron_rlhf.data.rows import open_rows
from megatron_rlhf.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = ["CharTokenizer", "HFTokenizer", "PromptDataset", "Tokenizer", "build_tokenizer", "open_rows"]
