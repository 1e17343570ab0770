"""Tokenizers: a Hugging Face ``tokenizers`` file, or a built-in character tokenizer for the demo."""

from __future__ import annotations

import string
from typing import List, Optional, Protocol

from megatron_rlhf.config.schema import TokenizerConfig

PRINTABLE = "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: Optional[int]
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> List[int]: ...

    def decode(self, ids: List[int]) -> str: ...


class CharTokenizer:
    """One id per character: pad 0, bos 1, eos 2, then the alphabet in order. Characters outside
    the alphabet are an error (the demo's data is generated within it)."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: Optional[str] = None):
        alphabet = PRINTABLE if alphabet is None else alphabet
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"char tokenizer alphabet must be non-empty without repeats, got {alphabet!r}")
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}
        self.vocab_size = len(self.SPECIALS) + len(alphabet)

    def encode(self, text: str) -> List[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}") from None

    def decode(self, ids: List[int]) -> str:
        first = len(self.SPECIALS)
        return "".join(self.alphabet[i - first] for i in ids if first <= i < self.vocab_size)


class HFTokenizer:
    """A ``tokenizers`` JSON file (the ``tokenizer.json`` of a Hugging Face model directory)."""

    def __init__(self, path: str, bos_token: Optional[str], eos_token: Optional[str], pad_token: Optional[str]):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises plain Exceptions with its own message
            raise ValueError(f"{path}: not a readable tokenizers JSON file ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        def token_id(key: str, token: Optional[str]) -> Optional[int]:
            if token is None:
                return None
            tid = self._tok.token_to_id(token)
            if tid is None:
                raise ValueError(f"{path}: data.tokenizer.{key}: token {token!r} is not in the vocabulary")
            return tid

        self.bos_id = token_id("bos_token", bos_token)
        eos = token_id("eos_token", eos_token)
        if eos is None:
            raise ValueError(f"{path}: data.tokenizer.eos_token: generation needs an end-of-sequence token")
        self.eos_id = eos
        pad = token_id("pad_token", pad_token)
        self.pad_id = eos if pad is None else pad

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: List[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def build_tokenizer(config: TokenizerConfig, path: Optional[str] = None) -> Tokenizer:
    """``path``: the tokenizer file resolved against the config file (config.path_of)."""
    if config.type == "char":
        return CharTokenizer(config.alphabet)
    return HFTokenizer(path or config.path, config.bos_token, config.eos_token, config.pad_token)
