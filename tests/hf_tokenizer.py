"""The tiny math demo's tokenizer maker (examples/tiny_math/make_data.py), for tests that need a
Hugging Face tokenizer directory with a chat template and several end tokens."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "tiny_math_make_data", Path(__file__).resolve().parent.parent / "examples" / "tiny_math" / "make_data.py")
_make_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_make_data)

CHAT_TEMPLATE = _make_data.CHAT_TEMPLATE


def make_tokenizer_dir(path, generation_eos=None) -> Path:
    """A BPE tokenizer directory (eos <|im_end|>, pad <|pad|>, ChatML template) at ``path``."""
    return Path(_make_data.make_tokenizer(str(path), generation_eos))
