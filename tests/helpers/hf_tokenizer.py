"""The tiny math demo's tokenizer maker (examples/tiny_math/make_data.py), for tests that need a
Hugging Face tokenizer directory with a chat template and several end tokens."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "tiny_math_make_data", Path(__file__).resolve().parents[2] / "examples" / "tiny_math" / "make_data.py")
_make_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_make_data)

CHAT_TEMPLATE = _make_data.CHAT_TEMPLATE


def make_tokenizer_dir(path, generation_eos=None) -> Path:
    """A BPE tokenizer directory (eos <|im_end|>, pad <|pad|>, ChatML template) at ``path``."""
    return Path(_make_data.make_tokenizer(str(path), generation_eos))


def byte_level_tokenizer_dir(path, specials, eos, template, corpus, bos=None, vocab_size=320) -> str:
    """A byte-level BPE tokenizer (every string encodes) trained on ``corpus`` with ``specials``,
    end token ``eos``, pad ``<|pad|>`` and chat ``template``, saved the Hugging Face way at ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus] * 8, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token="<|pad|>")
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return str(path)
