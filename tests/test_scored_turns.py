"""A reward model is read where it was trained: the rm stage scores a conversation at the last token
the chat template renders for it, RL a generated response (which stops at the end token) with the
template's close of the turn written after it (rollout/scoring.closed_turns)."""

import pytest
import torch

from megatron_rlhf.config.schema import TokenizerConfig
from megatron_rlhf.data.exchanges import encode_exchange
from megatron_rlhf.data.tokenizer import build_tokenizer
from megatron_rlhf.rollout.scoring import closed_turns
from tests.helpers.hf_tokenizer import byte_level_tokenizer_dir

CORPUS = "user assistant system what is two plus two the answer is four"
TEMPLATES = {
    # Qwen's ChatML: a newline after <|im_end|>
    "qwen": (["<|im_start|>", "<|im_end|>", "<|pad|>"], "<|im_end|>", None,
             "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "\n"),
    # Llama 3: nothing after <|eot_id|>
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"], "<|eot_id|>",
               "<|begin_of_text|>",
               "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}", ""),
    # Mistral: the answer then </s>
    "mistral": (["<s>", "</s>", "<|pad|>"], "</s>", "<s>",
                "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}", ""),
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_rl_scores_a_generated_response_at_the_token_the_rm_stage_scored(tmp_path, family):
    specials, eos, bos, template, tail_text = TEMPLATES[family]
    path = byte_level_tokenizer_dir(tmp_path / family, specials, eos, template, CORPUS, bos=bos)
    tok = build_tokenizer(TokenizerConfig(type="hf", path=path), None)
    assert tok.turn_tail() == (tok.encode_text(tail_text) if tail_text else [])
    prompt = [{"role": "user", "content": "what is two plus two"}]
    trained = encode_exchange(tok, prompt, "the answer is four", chat=True, max_length=256)  # the rm stage's row
    response = trained.ids[trained.prompt_length:]
    generated = response[: next(i for i, t in enumerate(response) if t in tok.eos_ids) + 1]  # stops at the end token
    cut = response[:3]  # a response cut at the length limit has no end token: scored where it stops
    width = len(trained.ids) + 2
    rows = torch.full((2, width), tok.pad_id)
    for row, ids in enumerate((generated, cut)):
        rows[row, : trained.prompt_length + len(ids)] = torch.tensor(trained.ids[: trained.prompt_length] + ids)
    tokens, last = closed_turns(rows, torch.tensor([trained.prompt_length] * 2), torch.tensor([len(generated), 3]),
                                tok.turn_tail(), tok.eos_ids, tok.pad_id)
    assert tokens[0, : int(last[0]) + 1].tolist() == trained.ids  # the same tokens, scored at the same last one
    assert int(last[1]) == trained.prompt_length + 2 and torch.equal(tokens[1], rows[1])
