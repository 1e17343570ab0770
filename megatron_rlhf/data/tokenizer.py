"""Tokenizers: a Hugging Face tokenizer (a model directory, the ecosystem's convention, loaded with
transformers' AutoTokenizer: its special tokens, chat template and end tokens come from its own
files), or a built-in character tokenizer for the demo.

A tokenizer turns a prompt into the ids the model reads (:meth:`encode_prompt`: a plain string with
the special tokens the tokenizer adds itself, or a chat with the template's generation prompt) and
knows every token that ends a response (``eos_ids``: Llama 3 and Qwen stop on more than one).
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, Union

from megatron_rlhf.config.schema import TokenizerConfig

PRINTABLE = "".join(c for c in string.printable if c not in "\t\n\r\x0b\x0c")
Messages = List[Dict[str, str]]  # [{"role": "user", "content": "..."}, ...]


class Tokenizer(Protocol):
    vocab_size: int
    eos_ids: Tuple[int, ...]  # every token that ends a response
    pad_id: int
    has_chat_template: bool
    # The most characters one token stands for: text of n x this many characters holds at least n
    # tokens (data/exchanges.py cuts a long text before encoding it by this).
    max_token_chars: int

    def encode_prompt(self, prompt: Union[str, Messages], chat: bool, tools: Optional[List[dict]] = None) -> List[int]: ...

    def encode_text(self, text: str) -> List[int]: ...

    def render_chat(self, messages: Messages, generation_prompt: bool) -> str: ...

    def encode_chat(self, messages: Messages) -> Tuple[List[int], List[int]]: ...

    def turn_tail(self) -> List[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def record(self) -> dict:
        """What a trained model's checkpoint records of the tokenizer it read: where it came from,
        its size, and a fingerprint of its token -> id mapping (two tokenizers of one size that
        spell their ids otherwise differ in it)."""
        ...


class CharTokenizer:
    """One id per character: pad 0, bos 1, eos 2, then the alphabet in order. Characters outside
    the alphabet are an error (the demo's data is generated within it). No chat template."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    has_chat_template = False
    max_token_chars = 1

    def __init__(self, alphabet: Optional[str] = None):
        alphabet = PRINTABLE if alphabet is None else alphabet
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"char tokenizer alphabet must be non-empty without repeats, got {alphabet!r}")
        self.alphabet = alphabet
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_ids = (self.eos_id,)
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}
        self.vocab_size = len(self.SPECIALS) + len(alphabet)

    def encode(self, text: str) -> List[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}") from None

    def encode_prompt(self, prompt: Union[str, Messages], chat: bool, tools: Optional[List[dict]] = None) -> List[int]:
        if chat or tools or not isinstance(prompt, str):
            raise ValueError("the char tokenizer has no chat template; give string prompts and apply_chat_template: false")
        return [self.bos_id] + self.encode(prompt)

    def encode_text(self, text: str) -> List[int]:
        """``text`` as ids, nothing added (an environment's reply in a trajectory)."""
        return self.encode(text)

    def render_chat(self, messages: Messages, generation_prompt: bool) -> str:
        raise ValueError("the char tokenizer has no chat template")

    def encode_chat(self, messages: Messages) -> Tuple[List[int], List[int]]:
        raise ValueError("the char tokenizer has no chat template; give string prompts and responses")

    def turn_tail(self) -> List[int]:
        return []  # no chat template

    def show(self, ids: Sequence[int]) -> str:
        """``ids`` as text with the special tokens written out."""
        return "".join(self.SPECIALS[i] if i < len(self.SPECIALS) else self.decode([i]) for i in ids)

    def end_tokens(self) -> List[str]:
        return [f"{self.SPECIALS[self.eos_id]} ({self.eos_id})"]

    def unused_end_like_tokens(self) -> List[str]:
        return []

    def record(self) -> dict:
        return _record(f"char:{self.alphabet}", self.vocab_size, [self.SPECIALS, self.alphabet])

    def decode(self, ids: Sequence[int]) -> str:
        first = len(self.SPECIALS)
        return "".join(self.alphabet[i - first] for i in ids if first <= i < self.vocab_size)


class HFTokenizer:
    """A Hugging Face tokenizer: a model directory (tokenizer.json or a slow tokenizer's files,
    tokenizer_config.json, optionally generation_config.json) or a bare tokenizer.json (which names
    no special tokens: then ``eos_token`` must be given). End tokens: the tokenizer's own, every id
    of generation_config.json's ``eos_token_id``, and ``eos_token``. Padding: ``pad_token``, else
    the tokenizer's own, else the first end token (padding is always masked)."""

    def __init__(self, path: str, eos_token: Optional[str] = None, pad_token: Optional[str] = None,
                 eos_tokens: Sequence[str] = ()):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            if os.path.isdir(path):
                self._tok = AutoTokenizer.from_pretrained(path)
            else:
                self._tok = PreTrainedTokenizerFast(tokenizer_file=path)
        except Exception as e:  # transformers and tokenizers raise many kinds for unreadable files
            raise ValueError(f"{path}: not a readable Hugging Face tokenizer ({type(e).__name__}: {e})") from None
        self.path = path
        self.vocab_size = len(self._tok)
        eos = ([self._tok.eos_token_id] + _generation_config_eos(path) + [self._token_id("eos_token", eos_token)]
               + [self._token_id("eos_tokens", t) for t in eos_tokens])
        self.eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
        if not self.eos_ids:
            raise ValueError(f"{path}: the tokenizer names no end-of-sequence token and data.tokenizer.eos_token is not "
                             "set: generation needs one (give the model directory, or set eos_token)")
        pad = self._token_id("pad_token", pad_token)
        self.pad_id = pad if pad is not None else self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_ids[0]
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        self._max_token_chars = self._record = None

    @property
    def max_token_chars(self) -> int:
        """The longest token's spelling in the vocabulary (a byte-level or SentencePiece token's
        characters are at least the text's characters it stands for; special tokens as written)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(len(t) for t in self._tok.get_vocab())
        return self._max_token_chars

    def record(self) -> dict:
        if self._record is None:  # the whole vocabulary hashed: once, for start-up's check and every save
            self._record = _record(self.path, self.vocab_size, sorted(self._tok.get_vocab().items()))
        return dict(self._record)

    def _token_id(self, key: str, token: Optional[str]) -> Optional[int]:
        if token is None:
            return None
        tid = self._tok.convert_tokens_to_ids(token)
        if tid is None or tid == self._tok.unk_token_id and token != self._tok.unk_token:
            raise ValueError(f"{self.path}: data.tokenizer.{key}: token {token!r} is not in the vocabulary")
        return tid

    def encode_prompt(self, prompt: Union[str, Messages], chat: bool, tools: Optional[List[dict]] = None) -> List[int]:
        """A string with the special tokens the tokenizer adds itself (Llama's BOS), or ``chat``: the
        messages (or the string as one user message) through the chat template, generation prompt
        added (a chat ending with an assistant message is continued instead: the model writes on
        from its text), ``tools`` (function specs) passed to it."""
        if not chat:
            if not isinstance(prompt, str):
                raise ValueError("a chat (a list of messages) needs data.apply_chat_template: true")
            return list(self._tok(prompt, add_special_tokens=True)["input_ids"])
        if not self.has_chat_template:
            raise ValueError(f"{self.path}: data.apply_chat_template is true but the tokenizer has no chat template")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        # A chat that ends with an assistant message is a prefix for the model to continue.
        continuing = messages[-1]["role"] == "assistant"
        try:
            ids = self._tok.apply_chat_template(messages, tools=tools, add_generation_prompt=not continuing,
                                                continue_final_message=continuing, tokenize=True)
        except Exception as e:  # jinja2's TemplateError kinds: the template refused or could not be read
            raise ValueError(f"{self.path}: the chat template failed on this chat ({type(e).__name__}: {e})") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def _template_ids(self, messages: Messages, generation_prompt: bool) -> List[int]:
        try:
            ids = self._tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        except Exception as e:  # jinja2's TemplateError kinds
            raise ValueError(f"{self.path}: the chat template failed on this chat ({type(e).__name__}: {e})") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def encode_chat(self, messages: Messages) -> Tuple[List[int], List[int]]:
        """A whole chat's ids (no generation prompt) and, per id, 1 where an assistant message wrote
        it: the tokens the template adds after the chat before it with its generation prompt, up to
        the end of that message's turn (its end-of-turn token included: the model learns to stop).
        A template that does not render each assistant turn as an extension of the chat before it
        (one that rewrites earlier turns) is refused."""
        full = self._template_ids(messages, generation_prompt=False)
        mask = [0] * len(full)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._template_ids(messages[:i], generation_prompt=True) if i else []
            upto = self._template_ids(messages[: i + 1], generation_prompt=False)
            if upto[: len(before)] != before or full[: len(upto)] != upto:
                raise ValueError(f"{self.path}: the chat template renders message {i} (an assistant's) so that the chat "
                                 "before it is not a prefix of the whole (it rewrites earlier turns); the response "
                                 "tokens cannot be told from the prompt's")
            mask[len(before) : len(upto)] = [1] * (len(upto) - len(before))
        return full, mask

    def turn_tail(self) -> List[int]:
        """The ids the chat template writes after an assistant turn's end token (ChatML's newline
        after <|im_end|>; none after Llama 3's <|eot_id|> or Mistral's </s>): a rendered conversation,
        as the rm stage scores it, ends with them; a generated response stops at the end token."""
        if not self.has_chat_template:
            return []
        chat = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        start = len(self._template_ids(chat[:1], generation_prompt=True))
        ids = self._template_ids(chat, generation_prompt=False)
        end = next((i for i in range(start, len(ids)) if ids[i] in self.eos_ids), None)
        return [] if end is None else ids[end + 1 :]

    def encode_text(self, text: str) -> List[int]:
        """``text`` as ids, no special tokens added (the special tokens it spells are parsed as such)."""
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def render_chat(self, messages: Messages, generation_prompt: bool) -> str:
        """The chat template's text of ``messages`` (the generation prompt added when asked)."""
        return self._tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def end_tokens(self) -> List[str]:
        """The end tokens as text, for the start-up line."""
        return [f"{self._tok.convert_ids_to_tokens(i)} ({i})" for i in self.eos_ids]

    def unused_end_like_tokens(self) -> List[str]:
        """Special tokens that end turns in common model families but do not end a response here
        (e.g. a Qwen tokenizer without generation_config.json: <|endoftext|>)."""
        vocabulary = self._tok.get_vocab()
        return [t for t in END_LIKE_TOKENS if t in vocabulary and vocabulary[t] not in self.eos_ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def show(self, ids: Sequence[int]) -> str:
        """``ids`` as text with the special tokens written out (what the model reads)."""
        return self._tok.decode(list(ids), skip_special_tokens=False)


# Tokens that end a turn or a document in the families the converter supports.
END_LIKE_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>",
                   "<end_of_turn>", "<|end|>")


def _generation_config_eos(path: str) -> List[int]:
    """generation_config.json's eos_token_id (an id or a list) of a model directory."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return []
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    return [value] if isinstance(value, int) else [int(v) for v in value or []]


def _record(source: str, vocab_size: int, mapping: Any) -> dict:
    digest = hashlib.sha256(json.dumps(mapping, ensure_ascii=False).encode()).hexdigest()[:16]
    return {"source": source, "vocab_size": vocab_size, "fingerprint": digest}


def build_tokenizer(config: TokenizerConfig, path: Optional[str] = None) -> Tokenizer:
    """``path``: the tokenizer directory or file resolved against the config file (config.path_of)."""
    if config.type == "char":
        return CharTokenizer(config.alphabet)
    return HFTokenizer(path or config.path, config.eos_token, config.pad_token, config.eos_tokens)
