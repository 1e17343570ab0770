"""Tools for agents (megatron_rlhf/agents): function tools and their schemas, the call parsers, the
tool environment, the prompt with the tools block, a scripted tool-using trajectory through the
environment workers and the chat template (the Python sandbox: tests/test_sandbox.py)."""

import sys
import types

import pytest
import torch

from megatron_rlhf.data.tokenizer import HFTokenizer
from megatron_rlhf.agents.protocol import Turn
from megatron_rlhf.agents.function import argument_problem, function_tool, load_tools
from megatron_rlhf.agents.parsers import CallProblem, ToolCall, make_parser
from tests.helpers.hf_tokenizer import byte_level_tokenizer_dir
from tests.test_multiturn import _ScriptedCollector

# ChatML with Qwen2.5's tool block and tool responses, and a Llama-3.1-style template with tools in
# the system turn and tool results from "ipython" (written for these tests after the models' formats).
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{%- else %}You are a helpful assistant.{%- endif %}"
    "\n\n# Tools\n\nYou may call one or more functions.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "\n</tools>\n\nReturn each call as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{%- elif messages[0].role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{%- endif %}"
    "{%- elif not (m.role == 'system' and loop.first and tools) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
LLAMA31_TOOLS_TEMPLATE = (
    "<|begin_of_text|>"
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "Use these functions:\n{%- for tool in tools %}{{ tool | tojson }}\n{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- set role = 'ipython' if m.role == 'tool' else m.role %}"
    "<|start_header_id|>{{ role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
FORMATS = {
    "qwen": (["<|im_start|>", "<|im_end|>", "<|pad|>"], "<|im_end|>", QWEN_TOOLS_TEMPLATE),
    "llama31": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"],
                "<|eot_id|>", LLAMA31_TOOLS_TEMPLATE),
}


def byte_tokenizer_dir(path, name):
    """A byte-level BPE tokenizer with the special tokens and template of ``name``."""
    specials, eos, template = FORMATS[name]
    corpus = 'user assistant tool system what is two plus three the answer is five {"name": "add", "arguments"}'
    return byte_level_tokenizer_dir(path, specials, eos, template, corpus)


TOOLS_PY = '''
import time

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b

def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"

def broken(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise KeyError(x)

def no_docstring(x: str):
    return x
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_PY)
    return path


# -- function tools -----------------------------------------------------------------------------

def test_a_tool_s_schema_comes_from_its_signature_and_docstring_and_its_arguments_are_checked(tools_file):
    add, slow, broken = load_tools([f"{tools_file}:add", f"{tools_file}:slow", f"{tools_file}:broken"], "/")
    assert add.spec == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first."},
                                                        "b": {"type": "integer", "description": "The second."}},
                       "required": ["a", "b"]}}}
    assert argument_problem(add, {"a": 1, "b": 2}) is None
    assert argument_problem(add, {"a": 1}) == "invalid arguments for add: 'b' is a required property"
    assert argument_problem(add, {"a": "one", "b": 2}) == "invalid arguments for add at a: 'one' is not of type 'integer'"
    assert "must be a JSON object" in argument_problem(add, [1, 2])
    with pytest.raises(ValueError, match="no_docstring: no schema can be made from its signature and docstring"):
        load_tools([f"{tools_file}:no_docstring"], "/")
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        load_tools([f"{tools_file}:add", f"{tools_file}:add"], "/")
    given = types.SimpleNamespace(tool_spec={"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}})
    assert function_tool(given).name == "search"


# -- parsers --------------------------------------------------------------------------------------

HERMES_CASES = [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', [("add", {"a": 1, "b": 2})], []),
    ('I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>'
     '{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call> and then wait',
     [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})], []),
    ('<tool_call>{"name": "echo", "arguments": {"text": "a } brace { inside"}}</tool_call>',
     [("echo", {"text": "a } brace { inside"})], []),
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', [], ["not valid JSON"]),
    ('<tool_call>{"arguments": {}}</tool_call>', [], ['a tool call is {"name"']),
    ('<tool_call>{"name": "add", "arguments": {"a": 1', [], ["not closed"]),
    ("The answer is 4.", [], []),
]
LLAMA_CASES = [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', [("add", {"a": 1, "b": 2})], []),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "echo", "parameters": {"text": "}"}}<|eom_id|>',
     [("add", {"a": 1, "b": 2}), ("echo", {"text": "}"})], []),
    ('{"name": "add", "parameters": {"a": 1', [], ["not valid JSON"]),
    ("The answer is 4.", [], []),
]


@pytest.mark.parametrize("parser, text, calls, problems",
                         [("hermes", *c) for c in HERMES_CASES] + [("llama3_json", *c) for c in LLAMA_CASES])
def test_parsers_read_the_calls_models_write_and_name_what_they_cannot(parser, text, calls, problems):
    parsed = make_parser(parser, []).parse(text)
    assert parsed.calls == [ToolCall(n, a) for n, a in calls]
    assert len(parsed.problems) == len(problems) and all(p in got.message for p, got in zip(problems, parsed.problems))


def test_the_tags_parser_calls_a_tool_with_its_one_string_argument_and_stops_at_the_closing_tag(tools_file):
    python = function_tool(__import__("megatron_rlhf.agents.sandbox", fromlist=["python"]).python)
    parser = make_parser("tags", [python])
    assert parser.stop == ("</python>",)
    parsed = parser.parse("Let me compute.\n<python>\nprint(2 + 3)\n</python>")
    assert parsed.calls == [ToolCall("python", {"code": "print(2 + 3)"})]
    assert parser.parse("<python>print(1)").problems == [CallProblem("unclosed", "<python> was not closed with </python>")]
    assert not parser.parse("five").wants_tools
    with pytest.raises(ValueError, match="tags calls a tool with its one required string argument; add requires"):
        make_parser("tags", load_tools([f"{tools_file}:add"], "/"))


# -- the tool environment -------------------------------------------------------------------------

def test_the_tool_environment_answers_every_call_and_counts_what_went_wrong(tools_file):
    from megatron_rlhf.agents.tool_environment import ToolEnvironment

    env = ToolEnvironment([f"{tools_file}:{n}" for n in ("add", "slow", "broken")], "hermes", max_parallel_calls=4,
                          tool_timeout_s=0.5)
    assert env.start({"prompt": "x"}) is None

    def call(name, arguments):
        return '<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % (name, arguments)

    text = (call("add", '{"a": 2, "b": 3}') + call("nope", "{}") + call("add", '{"a": "x"}') + call("broken", '{"x": "k"}')
            + call("slow", '{"seconds": 5}') + "<tool_call>{bad json}</tool_call>")
    result = env.step(Turn(text, [], 0, True))
    replies = [m["content"] for m in result.observation]
    assert all(m["role"] == "tool" for m in result.observation) and not result.done
    assert replies[0].startswith("error: the tool call is not valid JSON")  # problems of reading come first
    assert replies[1] == "5"
    assert replies[2] == "error: there is no tool 'nope'; the tools are add, slow, broken"
    assert replies[3].startswith("error: invalid arguments for add")
    assert replies[4] == "error: broken raised KeyError: 'k'"
    assert replies[5] == "error: slow did not answer within 0.5s"
    counts = result.info["counts"]
    assert counts["tool_calls"] == 3 and counts["tool_calls/add"] == 1 and counts["tool_errors"] == 5
    assert counts["tool_timeouts"] == 1 and 0.5 <= counts["tool_s"] < 3
    answered = env.step(Turn("The sum is 5.", [], 1, True))
    assert answered.done and answered.observation is None and answered.info["counts"]["tool_calls"] == 0


# -- the prompt, and a trajectory through the workers and the template ------------------------------

@pytest.mark.parametrize("name", ["qwen", "llama31"])
def test_the_prompt_shows_the_tools_as_the_model_family_s_template_does(tmp_path, tools_file, name):
    from megatron_rlhf.data.prompts import PromptDataset
    from megatron_rlhf.data.rows import open_rows

    tok = HFTokenizer(byte_tokenizer_dir(tmp_path / name, name))
    specs = [t.spec for t in load_tools([f"{tools_file}:add"], "/")]
    messages = [{"role": "user", "content": "what is two plus three"}]
    expected = tok._tok.apply_chat_template(messages, tools=specs, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert tok.encode_prompt(messages, True, specs) == expected
    assert '"name": "add"' in tok.decode(expected)
    (tmp_path / "rows.jsonl").write_text('{"prompt": [{"role": "user", "content": "what is two plus three"}]}\n')
    dataset = PromptDataset(open_rows(str(tmp_path / "rows.jsonl"), "prompt"), tok, 4096, 0, chat=True, tools=specs)
    batch = dataset.batch_of([0])
    assert batch["tokens"][0, : batch["lengths"][0]].tolist() == expected


@pytest.mark.parametrize("name", ["qwen", "llama31"])
def test_a_tool_using_trajectory_is_the_template_applied_once_with_the_model_s_tokens_trained(tmp_path, tools_file, name):
    """A scripted policy calls add, reads the result, answers: through the environment workers, the
    real tool and the template. The trajectory's ids are the template applied once to the whole
    conversation (tools block included); loss mask 1 exactly on the model's two turns."""
    from megatron_rlhf.config.schema import RLHFConfig
    from megatron_rlhf.generation import SamplingParams
    from megatron_rlhf.rollout.multiturn import MultiTurn

    tok = HFTokenizer(byte_tokenizer_dir(tmp_path / name, name))
    config = RLHFConfig()
    config.rollout.tools, config.rollout.tool_parser = [f"{tools_file}:add"], "hermes" if name == "qwen" else "llama3_json"
    config.origin["rollout.tools"] = str(tmp_path / "run.yaml")
    config.data.max_prompt_length = 4096
    call = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' if name == "qwen"
            else '{"name": "add", "parameters": {"a": 2, "b": 3}}')
    conversation = [{"role": "user", "content": "what is two plus three"}, {"role": "assistant", "content": call},
                    {"role": "tool", "content": "5"}, {"role": "assistant", "content": "the answer is five"}]
    specs = [t.spec for t in load_tools([f"{tools_file}:add"], "/")]

    def rendered(messages, generation_prompt):
        ids = tok._tok.apply_chat_template(messages, tools=specs, add_generation_prompt=generation_prompt, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    once = rendered(conversation, False)
    prompt, before_answer = rendered(conversation[:1], True), rendered(conversation[:3], True)
    assert once[: len(before_answer)] == before_answer and once[: len(prompt)] == prompt
    ends = [i + 1 for i in range(len(prompt), len(once)) if once[i] in tok.eos_ids]
    first_turn, second_turn = once[len(prompt) : ends[0]], once[len(before_answer) : ends[-1]]
    assert call[:10] in tok.decode(first_turn) and "five" in tok.decode(second_turn)
    turns = MultiTurn(config, tok, "megatron_rlhf.agents.tool_environment:ToolEnvironment", chat=True)
    mine = {"tokens": torch.tensor([prompt]), "prompt_lengths": torch.tensor([len(prompt)]), "seeds": torch.tensor([1]),
            "prompt_index": torch.tensor([0])}
    try:
        rows, metrics = turns.run(_ScriptedCollector([first_turn, second_turn], slots=1), mine, ["q"], [{}],
                                  SamplingParams(max_new_tokens=64, eos_ids=tok.eos_ids, pad_id=tok.pad_id))
    finally:
        turns.close()
    # The trajectory ends with the model's last token (what the template writes after it is not generated).
    assert rows["tokens"][0].tolist() == once[: ends[-1]]
    model = [0] * len(prompt) + [1] * len(first_turn) + [0] * (len(before_answer) - len(prompt) - len(first_turn)) \
        + [1] * len(second_turn)
    assert rows["action_mask"][0].tolist() == [float(m) for m in model[1:]]
    assert metrics["rollout/tool_calls"] == 1 and metrics["rollout/tool_calls/add"] == 1 and metrics["rollout/tool_errors"] == 0
    assert metrics["rollout/turns_mean"] == 2 and metrics["rollout/env_failures"] == 0 and "time/tool_s" in metrics


def test_a_policy_that_writes_a_call_nested_1200_deep_is_answered_and_its_trajectory_goes_on(tmp_path, tools_file):
    """The hostile call of a policy through the environment workers: answered with the problem (its
    depth named), counted by kind, and the model's next turn is read as any other."""
    from megatron_rlhf.config.schema import RLHFConfig
    from megatron_rlhf.generation import SamplingParams
    from megatron_rlhf.rollout.multiturn import MultiTurn

    tok = HFTokenizer(byte_tokenizer_dir(tmp_path / "qwen", "qwen"))
    config = RLHFConfig()
    config.rollout.tools, config.rollout.tool_parser = [f"{tools_file}:add"], "hermes"
    config.origin["rollout.tools"] = str(tmp_path / "run.yaml")
    config.data.max_prompt_length = config.rollout.max_trajectory_tokens = config.generation.max_new_tokens = 20000
    deep = '<tool_call>{"name": "add", "arguments": {"a": %s}}</tool_call>' % ("[" * 1200 + "]" * 1200)
    turns_text = [deep, "the answer is five"]
    prompt = tok.encode_prompt([{"role": "user", "content": "what is two plus three"}], True,
                               [t.spec for t in load_tools([f"{tools_file}:add"], "/")])
    turns = MultiTurn(config, tok, "megatron_rlhf.agents.tool_environment:ToolEnvironment", chat=True)
    mine = {"tokens": torch.tensor([prompt]), "prompt_lengths": torch.tensor([len(prompt)]), "seeds": torch.tensor([1]),
            "prompt_index": torch.tensor([0])}
    try:
        rows, metrics = turns.run(_ScriptedCollector([tok.encode_text(t) + [tok.eos_ids[0]] for t in turns_text], slots=1),
                                  mine, ["q"], [{}], SamplingParams(max_new_tokens=20000, eos_ids=tok.eos_ids,
                                                                    pad_id=tok.pad_id))
    finally:
        turns.close()
    assert metrics["rollout/tool_errors"] == 1 and metrics["rollout/tool_errors/depth"] == 1
    assert metrics["rollout/tool_calls"] == 0 and metrics["rollout/env_failures"] == 0 and metrics["rollout/turns_mean"] == 2
    shown = tok.show(rows["tokens"][0].tolist())
    assert "error: the tool call is nested 1202 levels deep; at most 100 are read" in shown
    assert shown.endswith("the answer is five<|im_end|>")


# -- MCP servers ------------------------------------------------------------------------------------

MCP_SERVER = '''
import os
import sys
from mcp.server.mcpserver import MCPServer

app = MCPServer("tiny")

@app.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b

@app.tool()
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()

@app.tool()
def crash() -> str:
    """End the server."""
    os._exit(1)

if __name__ == "__main__":
    app.run()
'''


def test_an_mcp_server_s_tools_are_listed_and_called_and_a_server_that_dies_is_started_again(tmp_path):
    from megatron_rlhf.agents.tool_environment import ToolEnvironment

    (tmp_path / "server.py").write_text(MCP_SERVER)
    env = ToolEnvironment([], "hermes", tool_timeout_s=20, mcp_servers=[f"{sys.executable} server.py"],
                          mcp_dir=str(tmp_path))
    assert sorted(env.tools) == ["crash", "multiply", "shout"]
    assert env.tools["multiply"].parameters["required"] == ["a", "b"]

    def call(name, arguments):
        result = env.step(Turn('<tool_call>{"name": "%s", "arguments": %s}</tool_call>' % (name, arguments), [], 0, True))
        return [m["content"] for m in result.observation], result.info["counts"]

    assert call("multiply", '{"a": 6, "b": 7}') == (["42"], {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0,
                                                            "tool_s": pytest.approx(0, abs=5), "tool_calls/multiply": 1})
    assert call("shout", '{"text": "hi"}')[0] == ["HI"]
    assert call("multiply", '{"a": "six"}')[0][0].startswith("error: invalid arguments for multiply")
    replies, counts = call("crash", "{}")
    assert replies[0].startswith("error: crash: the MCP server") and "started again" in replies[0]
    assert counts["tool_errors"] == 1
    assert call("multiply", '{"a": 2, "b": 3}')[0] == ["6"]  # a fresh server
