"""Tokenizers (character, Hugging Face directory with a chat template, bare tokenizer.json) and
prompt data (JSONL and Parquet rows, prompt keys, fields, overlong prompts, batches over DP)."""

import json

import pytest

from megatron_rlhf.config.schema import DataConfig, TokenizerConfig
from megatron_rlhf.data import CharTokenizer, PromptDataset, build_tokenizer, open_rows
from tests.helpers.hf_tokenizer import CHAT_TEMPLATE, make_tokenizer_dir


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("ab ")
    assert tok.vocab_size == 6 and (tok.pad_id, tok.bos_id, tok.eos_ids) == (0, 1, (2,))
    assert tok.encode("ab a") == [3, 4, 5, 3] and tok.encode_prompt("ab", chat=False) == [1, 3, 4]
    assert tok.decode([1, 3, 4, 2, 0]) == "ab"
    with pytest.raises(ValueError, match="'z' is not in the tokenizer alphabet"):
        tok.encode("az")
    with pytest.raises(ValueError, match="the char tokenizer has no chat template"):
        tok.encode_prompt([{"role": "user", "content": "ab"}], chat=True)


def test_a_hugging_face_directory_renders_chats_as_transformers_does(tmp_path):
    from transformers import AutoTokenizer

    directory = make_tokenizer_dir(tmp_path / "tok", generation_eos=["<|endoftext|>", "<|im_end|>"])
    tok = build_tokenizer(TokenizerConfig(type="hf"), str(directory))
    theirs = AutoTokenizer.from_pretrained(directory)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 3?"}]
    expected = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert tok.encode_prompt(chat, chat=True) == expected
    text = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and theirs(text, add_special_tokens=False)["input_ids"] == expected
    # End tokens: the tokenizer's own and generation_config.json's list; pad: the tokenizer's.
    ids = theirs.convert_tokens_to_ids
    assert tok.eos_ids == (ids("<|im_end|>"), ids("<|endoftext|>")) and tok.pad_id == ids("<|pad|>")
    assert tok.encode_prompt("what is 2 + 3?", chat=False) == theirs("what is 2 + 3?")["input_ids"]
    assert tok.decode(expected).startswith("system")  # special tokens dropped
    with pytest.raises(ValueError, match="token '<pad>' is not in the vocabulary"):
        build_tokenizer(TokenizerConfig(type="hf", pad_token="<pad>"), str(directory))
    with pytest.raises(ValueError, match="not a readable Hugging Face tokenizer"):
        build_tokenizer(TokenizerConfig(type="hf"), str(tmp_path / "missing.json"))


def test_a_bare_tokenizer_json_needs_its_end_token(tmp_path):
    directory = make_tokenizer_dir(tmp_path / "tok")
    bare = str(directory / "tokenizer.json")
    with pytest.raises(ValueError, match="names no end-of-sequence token and data.tokenizer.eos_token is not set"):
        build_tokenizer(TokenizerConfig(type="hf"), bare)
    tok = build_tokenizer(TokenizerConfig(type="hf", eos_token="<|im_end|>"), bare)
    assert len(tok.eos_ids) == 1 and not tok.has_chat_template


def test_prompt_files_name_file_and_line_of_each_problem(tmp_path):
    path = tmp_path / "p.jsonl"
    cases = {
        '{"prompt": "ok"}\n{"text": "no prompt key"}\n': r"p\.jsonl:2: no 'prompt' \(a string\) or 'messages' \(a chat\) column; columns: text",
        '{"prompt": "ok"}\nnot json\n': r"p\.jsonl:2: not valid JSON",
        '{"prompt": "ok", "messages": [{"role": "user", "content": "hi"}]}\n': r"p\.jsonl:1: has both 'prompt' and 'messages'",
        '{"prompt": "  "}\n': r"p\.jsonl:1: empty 'prompt'",
        '{"messages": [{"role": "user"}]}\n': r"p\.jsonl:1: 'messages' message 0: content must be a string",
        '{"messages": 3}\n': r"p\.jsonl:1: 'messages' must be a string or a list of",
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}\n':
            r"p\.jsonl:1: 'messages' message 1: role 'robot' is not one of system, user, assistant, tool",
    }
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            open_rows(str(path), None)
    # OpenAI-style rows: an assistant message with tool_calls and no content.
    path.write_text('{"messages": [{"role": "user", "content": "add"}, {"role": "assistant", "content": null, '
                    '"tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{}"}}]}, '
                    '{"role": "tool", "content": "3"}]}\n')
    assert len(open_rows(str(path), None)) == 1
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xae"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:2: not UTF-8 text"):
        open_rows(str(path), None)
    path.write_text('{"question": "q", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl:1: no 'query' column \(data.prompt_key\); columns: answer, question"):
        open_rows(str(path), "query")
    assert open_rows(str(path), "question").prompt_and_fields(0) == ("q", {"answer": "1"})


def test_parquet_rows_and_a_file_that_is_not_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "ground_truth": str(i), "data_source": "s"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=2)
    table = open_rows(str(tmp_path / "d.parquet"), None)
    assert len(table) == 5 and table.key == "prompt"
    assert table.prompt_and_fields(3) == ([{"role": "user", "content": "q3"}], {"ground_truth": "3", "data_source": "s"})
    (tmp_path / "fake.parquet").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"fake\.parquet: not a Parquet file"):
        open_rows(str(tmp_path / "fake.parquet"), None)
    pq.write_table(pa.Table.from_pylist([{"question": "q"}]), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"other\.parquet: no 'prompt' \(a string\) or 'messages'"):
        open_rows(str(tmp_path / "other.parquet"), None)


def test_a_verl_format_parquet_file_runs_the_math_recipe_as_verl_writes_it(tmp_path, monkeypatch):
    """Rows as verl's data preprocessing writes them (a chat under 'prompt', the ground truth under
    'reward_model.ground_truth', 'ability' and 'extra_info' beside): the math demo's config takes the
    file as it is (start-up checks pass), its verifiers score against that ground truth, and a row
    whose two ground truths differ is refused by file and row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_rlhf.config import ConfigError
    from megatron_rlhf.rewards.contract import call
    from megatron_rlhf.rewards.verifiers import gsm8k
    from megatron_rlhf.startup import prepare
    from megatron_rlhf.train import parse_args
    from tests.conftest import REPO

    source = [json.loads(line) for line in (REPO / "examples" / "tiny_math" / "train.jsonl").read_text().splitlines()]
    verl = [{"data_source": row["data_source"], "prompt": row["messages"], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": row["ground_truth"]},
             "extra_info": {"split": "train", "index": i}} for i, row in enumerate(source)]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "train.parquet")
    monkeypatch.setenv("PROMPT_FILE", str(tmp_path / "train.parquet"))
    args = ["--config", str(REPO / "examples" / "tiny_math" / "grpo.yaml"), "--output-dir", str(tmp_path / "out"),
            "--check-only"]
    prepared = prepare(parse_args(args), 2)
    prompt, fields = prepared.dataset.rows.prompt_and_fields(0)
    assert prompt == source[0]["messages"] and fields["ground_truth"] == source[0]["ground_truth"]
    assert fields["extra_info"] == {"split": "train", "index": 0} and fields["ability"] == "math"
    right = f"#### {source[0]['ground_truth']}"
    assert call(gsm8k, ["q", "q"], [right, "#### 999"], [fields, fields]) == [{"score": 1.0}, {"score": 0.0}]
    for i, row in enumerate(verl):  # both columns, agreeing but in row 4
        row["ground_truth"] = "not the same" if i == 3 else row["reward_model"]["ground_truth"]
    pq.write_table(pa.Table.from_pylist(verl), tmp_path / "train.parquet")
    with pytest.raises((ConfigError, ValueError), match=r"train.parquet: row 4: 'ground_truth' 'not the same' and "
                                                        r"'reward_model.ground_truth' '.*' differ"):
        prepare(parse_args(args), 2)


TRL_STYLE = """
def exact_answer(completions, ground_truth, **kwargs):
    # TRL's convention: every argument by keyword; verl's ground truth arrives as the column.
    return [float(completion.strip().endswith(str(truth))) for completion, truth in zip(completions, ground_truth)]
"""


def test_the_math_demo_runs_on_verl_parquet_scored_by_a_trl_style_function_given_on_the_command_line(tmp_path):
    """End to end under torchrun (2 processes, 2 iterations): the math demo's rows as verl writes
    them, a TRL-style reward function added by key=value after the command: every call of it
    scored (no failure), its figure logged beside the verifiers'."""
    import os
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import REPO, _free_port

    rows = [json.loads(line) for line in (REPO / "examples" / "tiny_math" / "train.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist([{"prompt": r["messages"], "data_source": r["data_source"],
                                          "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]}}
                                         for r in rows]), tmp_path / "train.parquet")
    (tmp_path / "trl_reward.py").write_text(TRL_STYLE)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
               "-m", "megatron_rlhf.train", "--config", str(REPO / "examples" / "tiny_math" / "grpo.yaml"),
               "--output-dir", str(tmp_path / "out"), "--iterations", "2",
               f"reward.functions={{{tmp_path}/trl_reward.py:exact_answer: 0.5}}", "trainer.val_before_train=false",
               "generation.batch_size=auto"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PROMPT_FILE": str(tmp_path / "train.parquet"),
                               "PROGRESS_BAR": "False", "TENSORBOARD": "False"})
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2]
    # generation.batch_size: auto, chosen at start-up from the free memory (the host's here: every row).
    chosen = json.loads((tmp_path / "out" / "generation_batch_size_auto.json").read_text())
    assert chosen["slots"] == chosen["rows"] and f"generation.batch_size: auto: {chosen['reason']}" in done.stdout
    assert all(m["reward/failures"] == 0 and "reward/exact_answer" in m and "reward/gsm8k" in m for m in metrics)


def test_batches_split_over_data_parallel_ranks_and_reshuffle_each_pass(tmp_path):
    prompts = [f"{'a' * (1 + i % 4)}" for i in range(10)]
    tok = CharTokenizer("a")
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "n": i} for i, p in enumerate(prompts)])
    data = DataConfig(max_prompt_length=3, overlong_prompts="truncate")
    make = lambda: PromptDataset.from_file(path, tok, data, seed=5)  # noqa: E731
    ranks = [make(), make()]
    served = []
    for _ in range(4):  # 2 batches of 4 per pass over 10 prompts; the last 2 of a pass are skipped
        parts = [d.next_batch(4, rank, 2) for rank, d in enumerate(ranks)]
        assert not set(parts[0]["indices"]) & set(parts[1]["indices"])
        served.extend(parts[0]["indices"] + parts[1]["indices"])
        for part in parts:
            assert [f["n"] for f in part["fields"]] == part["indices"]  # the row's other columns
            for row, n, i in zip(part["tokens"], part["lengths"], part["indices"]):
                expected = ([tok.bos_id] + tok.encode(prompts[i]))[-3:]  # long prompts keep their end
                assert row[:n].tolist() == expected and (row[n:] == tok.pad_id).all()
    first_pass, second_pass = served[:8], served[8:]
    assert len(set(first_pass)) == 8 and len(set(second_pass)) == 8
    assert first_pass != second_pass  # a new order each pass
    restored = make()
    restored.load_state_dict(ranks[0].state_dict())
    assert restored.next_batch(4, 0, 2)["indices"] == ranks[0].next_batch(4, 0, 2)["indices"]


def test_overlong_prompts_are_filtered_and_counted_alike_on_every_rank(tmp_path):
    prompts = ["a" * (1 + i % 5) for i in range(20)]  # with bos: 2..6 tokens
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompts])
    tok = CharTokenizer("a")
    ranks = [PromptDataset.from_file(path, tok, DataConfig(max_prompt_length=4), seed=3) for _ in range(2)]
    assert ranks[0].check_encodes() == 8  # the 5- and 6-token prompts
    parts = [d.next_batch(6, r, 2) for r, d in enumerate(ranks)]
    kept = parts[0]["indices"] + parts[1]["indices"]
    assert len(set(kept)) == 6 and all(len(prompts[i]) + 1 <= 4 for i in kept)
    assert ranks[0].filtered == ranks[1].filtered > 0 and ranks[0].consumed == ranks[1].consumed
    assert ranks[0].usable_indices() == [i for i, p in enumerate(prompts) if len(p) < 4]
    never = PromptDataset.from_file(path, tok, DataConfig(max_prompt_length=1), seed=3)
    with pytest.raises(ValueError, match="every prompt is longer than data.max_prompt_length=1"):
        never.next_batch(2, 0, 1)


def test_a_system_prompt_leads_the_chat(tmp_path):
    directory = make_tokenizer_dir(tmp_path / "tok")
    tok = build_tokenizer(TokenizerConfig(type="hf"), str(directory))
    path = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "2 + 2?"}]}, {"prompt": "1 + 1?"}][:1])
    data = DataConfig(apply_chat_template=True, system_prompt="answer with ####", max_prompt_length=200)
    dataset = PromptDataset.from_file(path, tok, data, seed=0)
    ids = dataset.next_batch(1, 0, 1)["tokens"][0].tolist()
    assert tok.decode(ids).startswith("system\nanswer with ####") and "user\n2 + 2?" in tok.decode(ids)
    assert CHAT_TEMPLATE


def test_the_math_recipe_prepares_gsm8k_and_math_rows_and_its_config_loads(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    script = Path(__file__).resolve().parent.parent / "examples" / "qwen2.5" / "prepare_math_data.py"
    spec = importlib.util.spec_from_file_location("prepare_math_data", script)
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    pq.write_table(pa.Table.from_pylist([{"question": "2 + 2?", "answer": "Add them.\n#### 1,004"}]), tmp_path / "test.parquet")
    pq.write_table(pa.Table.from_pylist([{"problem": "Half?", "solution": r"It is $\boxed{\frac{1}{2}}$."}]), tmp_path / "m.parquet")
    assert prepare.main(["gsm8k", str(tmp_path / "test.parquet"), str(tmp_path / "g.parquet")]) == 0
    assert prepare.main(["math", str(tmp_path / "m.parquet"), str(tmp_path / "mo.parquet")]) == 0
    rows = open_rows(str(tmp_path / "g.parquet"), None)
    prompt, fields = rows.prompt_and_fields(0)
    assert prompt[0]["content"].startswith("2 + 2? Let's think step by step") and fields["ground_truth"] == "1004"
    assert fields["data_source"] == "gsm8k" and fields["extra_info"] == {"split": "test", "index": 0}
    assert open_rows(str(tmp_path / "mo.parquet"), None).prompt_and_fields(0)[1]["ground_truth"] == r"\frac{1}{2}"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "no marker"}]), tmp_path / "bad.parquet")
    assert prepare.main(["gsm8k", str(tmp_path / "bad.parquet"), str(tmp_path / "x.parquet")]) == 2

    from megatron_rlhf.config.loader import read_config

    monkeypatch.setenv("POLICY_PRESET", "qwen2.5-7b")
    config, problems = read_config("examples/qwen2.5/grpo_gsm8k.yaml")
    assert not problems and config.reward.type == "function" and config.data.apply_chat_template
    assert set(config.reward.functions) == {"megatron_rlhf.rewards.verifiers:gsm8k", "megatron_rlhf.rewards.verifiers:answer_format"}


# -- a real tokenizer's inputs (issue 43): a ChatML template with two end tokens -------------------

@pytest.fixture
def chatml(tmp_path):
    return make_tokenizer_dir(tmp_path / "chatml", generation_eos=["<|im_end|>", "<|endoftext|>"])


def test_the_end_tokens_are_the_union_of_every_source_and_an_end_like_token_left_out_is_named(tmp_path, chatml):
    full = build_tokenizer(TokenizerConfig(type="hf"), str(chatml))
    assert full.end_tokens() == ["<|im_end|> (2)", "<|endoftext|> (0)"] and not full.unused_end_like_tokens()
    bare = str(chatml / "tokenizer.json")  # no generation_config.json: only what is named ends a response
    one = build_tokenizer(TokenizerConfig(type="hf", eos_token="<|im_end|>"), bare)
    assert one.eos_ids == (2,) and one.unused_end_like_tokens() == ["<|endoftext|>"]
    both = build_tokenizer(TokenizerConfig(type="hf", eos_tokens=["<|im_end|>", "<|endoftext|>"]), bare)
    assert both.eos_ids == (2, 0)
    with pytest.raises(ValueError, match="data.tokenizer.eos_tokens: token '<|eot_id|>' is not in the vocabulary"):
        build_tokenizer(TokenizerConfig(type="hf", eos_tokens=["<|eot_id|>"]), bare)


def test_a_chat_ending_with_an_assistant_message_is_continued_and_the_reward_sees_the_question(tmp_path, chatml):
    from megatron_rlhf.data.prompts import prompt_text

    tok = build_tokenizer(TokenizerConfig(type="hf"), str(chatml))
    chat = [{"role": "user", "content": "2 + 2 = ?"}, {"role": "assistant", "content": "#### "}]
    text = tok.show(tok.encode_prompt(chat, True))
    assert text.rstrip().endswith("####") and text.count("<|im_start|>") == 2 and text.count("<|im_end|>") == 1
    assert prompt_text(chat) == "2 + 2 = ?"


def test_a_tools_column_reaches_the_chat_template(tmp_path):
    from tests.test_tools import byte_tokenizer_dir

    tok = build_tokenizer(TokenizerConfig(type="hf"), byte_tokenizer_dir(tmp_path / "qwen", "qwen"))
    spec = {"type": "function", "function": {"name": "lookup", "description": "Look up.",
                                             "parameters": {"type": "object", "properties": {}}}}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "tools": json.dumps([spec])}) + "\n"
                    + json.dumps({"prompt": [{"role": "user", "content": "hi"}], "tools": "not json"}) + "\n")
    dataset = PromptDataset(open_rows(str(path), None), tok, 4096, 0, chat=True)
    batch = dataset.batch_of([0])
    assert '"name": "lookup"' in tok.show(batch["tokens"][0, : batch["lengths"][0]].tolist())
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: its 'tools' column is not valid JSON"):
        dataset.batch_of([1])


def test_truncating_a_chat_keeps_the_template_and_cuts_the_start_of_the_last_user_message(tmp_path, chatml):
    tok = build_tokenizer(TokenizerConfig(type="hf"), str(chatml))
    path = tmp_path / "rows.jsonl"
    long = "what is the answer " * 6 + "2 + 2 = ?"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": long}]}) + "\n")
    whole = len(tok.encode_prompt([{"role": "user", "content": long}], True))
    dataset = PromptDataset(open_rows(str(path), None), tok, whole - 6, 0, chat=True, system_prompt="be brief",
                            overlong="truncate")
    assert dataset.check_encodes() == 1
    batch = dataset.batch_of([0])
    ids = batch["tokens"][0, : batch["lengths"][0]].tolist()
    text = tok.show(ids)
    assert len(ids) <= whole - 6 and text.startswith("<|im_start|> system\nbe brief<|im_end|>")
    assert "<|im_start|> user\n" in text and text.rstrip().endswith("<|im_start|> assistant") and "2 + 2 = ?" in text
    assert dataset.truncated == 1
    tight = PromptDataset(open_rows(str(path), None), tok, 8, 0, chat=True, system_prompt="be brief", overlong="truncate")
    with pytest.raises(ValueError, match=r"rows\.jsonl:1: the chat does not fit in data.max_prompt_length=8 tokens even"):
        tight.check_encodes()


def test_a_damaged_parquet_row_group_and_a_template_that_raises_are_named(tmp_path, chatml):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"question number {i} " * 20, "ground_truth": str(i)} for i in range(40)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=20, compression="NONE")
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data[start + 20 : start + 200] = b"\xff" * 180  # the second row group's page header
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"(?s)d\.parquet: row group 1 \(from row 21\) cannot be read .*; the file is damaged"):
        open_rows(str(path), None)
    config = json.loads((chatml / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turn') }}{% endif %}x"
    (chatml / "tokenizer_config.json").write_text(json.dumps(config))
    (chatml / "chat_template.jinja").unlink(missing_ok=True)
    tok = build_tokenizer(TokenizerConfig(type="hf"), str(chatml))
    (tmp_path / "p.jsonl").write_text('{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}\n')
    dataset = PromptDataset(open_rows(str(tmp_path / "p.jsonl"), None), tok, 64, 0, chat=True)
    with pytest.raises(ValueError, match=r"p\.jsonl:1: .*: the chat template failed on this chat \(.*no system turn\)"):
        dataset.check_encodes()


def test_a_tools_column_of_names_shows_and_allows_only_those_of_the_runs_tools(tmp_path):
    from megatron_rlhf.agents.protocol import Turn
    from megatron_rlhf.agents.tool_environment import ToolEnvironment
    from tests.test_tools import byte_tokenizer_dir

    tok = build_tokenizer(TokenizerConfig(type="hf"), byte_tokenizer_dir(tmp_path / "qwen", "qwen"))
    (tmp_path / "t.py").write_text('def lookup(term: str) -> str:\n    """Look up.\n\n    Args:\n        term: What.\n'
                                   '    """\n    return term.upper()\n')
    run_tools = ToolEnvironment([f"{tmp_path / 't.py'}:lookup", "megatron_rlhf.agents.sandbox:python"], "hermes")
    specs = [t.spec for t in run_tools.tools.values()]
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "tools": ["lookup"]},
            {"prompt": [{"role": "user", "content": "hi"}]},
            {"prompt": [{"role": "user", "content": "hi"}], "tools": ["search"]},
            {"prompt": [{"role": "user", "content": "hi"}], "tools": []}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = PromptDataset(open_rows(str(path), None), tok, 4096, 0, chat=True, tools=specs)
    shown = [tok.show(dataset.batch_of([i])["tokens"][0].tolist()) for i in (0, 1)]
    assert '"name": "lookup"' in shown[0] and '"name": "python"' not in shown[0]  # the row's subset only
    assert '"name": "lookup"' in shown[1] and '"name": "python"' in shown[1]  # no column: every tool
    none = tok.show(dataset.batch_of([3])["tokens"][0].tolist())
    assert '"name": "lookup"' not in none and '"name": "python"' not in none  # an empty list: no tool shown
    with pytest.raises(ValueError, match=r"rows\.jsonl:3: its 'tools' column names 'search', which the run's tools do "
                                         r"not have \(rollout.tools and rollout.mcp_servers give: lookup, python\)"):
        dataset.check_encodes()
    # The row without the python tool cannot call it: answered as an unknown tool and counted.
    run_tools.start(rows[0])
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    result = run_tools.step(Turn(call, [], 0, True))
    assert result.observation[0]["content"] == "error: there is no tool 'python'; the tools are lookup"
    assert result.info["counts"]["tool_errors"] == 1 and result.info["counts"]["tool_calls"] == 0
    run_tools.start(rows[1])
    assert run_tools.step(Turn(call, [], 0, True)).observation[0]["content"] == "1\n"
    run_tools.start(rows[3])  # "tools": [] allows none (it allowed every tool)
    assert run_tools.step(Turn(call, [], 0, True)).observation[0]["content"] == \
        "error: there is no tool 'python'; this row has no tools"
