import json

import pytest

from megatron_rlhf.config.schema import TokenizerConfig
from megatron_rlhf.data import CharTokenizer, PromptDataset, build_tokenizer, read_prompts


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("ab ")
    assert tok.vocab_size == 6 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("ab a") == [3, 4, 5, 3]
    assert tok.decode([1, 3, 4, 2, 0]) == "ab"
    with pytest.raises(ValueError, match="'z' is not in the tokenizer alphabet"):
        tok.encode("az")


def test_hugging_face_tokenizer_from_a_local_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(TokenizerConfig(type="hf"), str(tmp_path / "tokenizer.json"))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (5, 0, 1, 1)
    assert tok.encode("hello world") == [2, 3]
    with pytest.raises(ValueError, match="token '<pad>' is not in the vocabulary"):
        build_tokenizer(TokenizerConfig(type="hf", pad_token="<pad>"), str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="not a readable tokenizers JSON file"):
        build_tokenizer(TokenizerConfig(type="hf"), str(tmp_path / "missing.json"))


def test_prompt_file_errors_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: expected an object with a string \"prompt\""):
        read_prompts(str(path))
    path.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not valid JSON"):
        read_prompts(str(path))


def test_batches_split_over_data_parallel_ranks_and_reshuffle_each_pass(tmp_path):
    prompts = [f"{'a' * (1 + i % 4)}" for i in range(10)]
    tok = CharTokenizer("a")
    make = lambda: PromptDataset(read_prompts(write_prompts(tmp_path / "p.jsonl", prompts)), tok, 3, seed=5)  # noqa: E731
    ranks = [make(), make()]
    served = []
    for _ in range(4):  # 2 batches of 4 per pass over 10 prompts; the last 2 of a pass are skipped
        parts = [d.next_batch(4, rank, 2) for rank, d in enumerate(ranks)]
        assert not set(parts[0]["indices"]) & set(parts[1]["indices"])
        served.extend(parts[0]["indices"] + parts[1]["indices"])
        for part in parts:
            rows = part["tokens"]
            for row, n, i in zip(rows, part["lengths"], part["indices"]):
                expected = ([tok.bos_id] + tok.encode(prompts[i]))[-3:]  # long prompts keep their end
                assert row[:n].tolist() == expected and (row[n:] == tok.pad_id).all()
    first_pass, second_pass = served[:8], served[8:]
    assert len(set(first_pass)) == 8 and len(set(second_pass)) == 8
    assert first_pass != second_pass  # a new order each pass
    restored = make()
    restored.load_state_dict(ranks[0].state_dict())
    assert restored.next_batch(4, 0, 2)["indices"] == ranks[0].next_batch(4, 0, 2)["indices"]
