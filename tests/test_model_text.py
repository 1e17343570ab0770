"""Every reader of text a model wrote answers any string with a call, an answer, a score or a named
problem, never an exception: the tool-call parsers, the judge's verdict parsers, the math verifiers'
answer extraction, the process reward model's step ends, the cut at a stop string and a tool's reply.

Searched with hypothesis over hostile strings (deep nesting, huge numbers, lone surrogates, NUL
bytes, unterminated and repeated tags, megabyte arguments), derandomized and with a bounded number
of examples so the suite stays fast; the malformed calls that once raised are kept as examples."""

import json
import pickle
import time
import types

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_rlhf.agents.function import argument_problem, function_tool, result_text
from megatron_rlhf.agents.parsers import MAX_JSON_DEPTH, PROBLEM_KINDS, CallProblem, ParsedTurn, ToolCall, make_parser
from megatron_rlhf.rewards import verifiers
from megatron_rlhf.rewards.verdicts import boxed_parser, choice_parser, number_parser

# Fixed seed, no example database on disk, a budget that keeps each search to about a second.
SEARCH = settings(derandomize=True, database=None, max_examples=100, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Any character a Python str can hold, lone surrogates and NUL included.
ANY_CHARACTER = st.characters(codec=None, exclude_categories=())
MARKERS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "<|eom_id|>", "<python>", "</python>", "\\boxed{", "}",
           "####", "{", "}", "[", "]", '"', "\\", ";", ":", ",", "\x00", "\ud800", "\udfff", "\\ud800", "\\u0000",
           '{"name": "add", "arguments": ', '{"name": "add", "parameters": ', '"arguments": "', "NaN", "1e999999",
           "-", "."]


def _nested(depth: int, kind: str) -> str:
    if kind == "arrays":
        return "[" * depth + "]" * depth
    if kind == "objects":
        return '{"a": ' * depth + "1" + "}" * depth
    if kind == "strings":  # JSON text in a string in JSON text ... (a call's arguments written as a string)
        text = "1"
        for _ in range(min(depth, 12)):
            text = json.dumps({"a": text})
        return text
    return "[" * depth  # never closed


# Nesting around the bound and far past it (the stack's own limit is near 1,000).
DEEP = st.builds(_nested, st.one_of(st.integers(0, 3000), st.sampled_from([99, 100, 101, 1200, 5000])),
                 st.sampled_from(["arrays", "objects", "strings", "open"]))
FRAGMENT = st.one_of(
    st.text(ANY_CHARACTER, max_size=40),
    st.sampled_from(MARKERS),
    DEEP,
    st.integers(1, 10000).map(lambda digits: "9" * digits),
    st.builds(lambda marker, times: marker * times, st.sampled_from(MARKERS), st.integers(2, 500)),
)
HOSTILE = st.lists(FRAGMENT, max_size=8).map("".join)
# A well-formed call around a hostile argument: the parsers must reach the argument to be tested by it.
HERMES_CALL = st.builds(lambda argument, close: '<tool_call>{"name": "add", "arguments": {"a": ' + argument + close,
                        st.one_of(DEEP, HOSTILE), st.sampled_from(["}}</tool_call>", "</tool_call>"]))
LLAMA_CALL = st.builds(lambda argument, close: '{"name": "add", "parameters": {"a": ' + argument + close,
                       st.one_of(DEEP, HOSTILE), st.sampled_from(["}}", "}}; {", ""]))

# The malformed calls that once raised (RecursionError, ValueError), and their kin: each with the
# problem's kind and what its message says (None: read as a call).
DEEP_ARRAYS = '{"name": "add", "arguments": {"a": %s}}' % _nested(1200, "arrays")
DEEP_OBJECTS = '{"name": "add", "arguments": %s}' % _nested(1200, "objects")
DEPTH = ("depth", "the tool call is nested 1202 levels deep; at most 100 are read")
DIGITS = ("digits", "the tool call holds an integer of 5000 digits; at most 4300 are read")
MALFORMED = [
    ("hermes", f"<tool_call>{DEEP_ARRAYS}</tool_call>", DEPTH),
    ("hermes", f"<tool_call>{DEEP_OBJECTS}</tool_call>", ("depth", "the tool call is nested 1201 levels deep")),
    ("llama3_json", DEEP_ARRAYS.replace("arguments", "parameters"), DEPTH),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": %s}"}</tool_call>' % _nested(1200, "arrays"),
     ("depth", "the arguments of add are a string that does not read as JSON: the tool call is nested 1201 levels")),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": %s}}</tool_call>' % ("9" * 5000), DIGITS),
    ("llama3_json", '{"name": "add", "parameters": {"a": %s}}' % ("9" * 5000), DIGITS),
    ("hermes", '<tool_call>{"name": "add\\ud800", "arguments": {}}</tool_call>',
     ("encoding", "the tool call holds a lone surrogate \\ud800")),
    ("hermes", "<tool_call>" * 1000, ("unclosed", "a <tool_call> was not closed with </tool_call>")),
    ("llama3_json", "{" * 100000, ("depth", "the tool call is nested 100000 levels deep")),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": "%s"}}</tool_call>' % ("x" * 2 ** 20), None),
]


def _assert_answered(parsed: ParsedTurn) -> None:
    """A parse's result is what the environment can use as it stands: calls whose arguments go to a
    worker process and through a JSON schema, problems with a kind and a message a tokenizer reads."""
    assert isinstance(parsed, ParsedTurn)
    for call in parsed.calls:
        assert isinstance(call, ToolCall) and isinstance(call.name, str)
        pickle.dumps(call.arguments)  # to the environment worker's tool
        json.dumps(call.arguments, ensure_ascii=False).encode("utf-8")  # no lone surrogate left in it
        argument_problem(ADD, call.arguments)
    for problem in parsed.problems:
        assert isinstance(problem, CallProblem) and problem.kind in PROBLEM_KINDS
        problem.message.encode("utf-8")
        assert len(problem.message) < 400


def add(a: int, b: int = 0) -> int:
    """Add.

    Args:
        a: One.
        b: The other.
    """
    return a + b


ADD = function_tool(add)
TAGS = make_parser("tags", [function_tool(__import__("megatron_rlhf.agents.sandbox", fromlist=["python"]).python)])


@pytest.mark.parametrize("name, text, expected", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_calls_are_answered_with_a_problem_that_names_the_bound(name, text, expected):
    started = time.perf_counter()
    parsed = make_parser(name, []).parse(text)
    assert time.perf_counter() - started < 2.0
    _assert_answered(parsed)
    if expected is None:  # a megabyte argument is an argument
        assert parsed.calls == [ToolCall("add", {"a": "x" * 2 ** 20})] and not parsed.problems
    else:
        assert not parsed.calls and {p.kind for p in parsed.problems} == {expected[0]}
        assert parsed.problems[0].message.startswith(expected[1]), parsed.problems[0].message


def test_nesting_at_the_bound_is_read_and_one_past_it_is_a_problem():
    at_bound = '{"name": "add", "arguments": {"a": %s}}' % _nested(MAX_JSON_DEPTH - 2, "arrays")
    assert make_parser("hermes", []).parse(f"<tool_call>{at_bound}</tool_call>").calls
    past = '{"name": "add", "arguments": {"a": %s}}' % _nested(MAX_JSON_DEPTH - 1, "arrays")
    assert [p.kind for p in make_parser("hermes", []).parse(f"<tool_call>{past}</tool_call>").problems] == ["depth"]
    # Brackets inside strings, escaped quotes included, are text, not nesting.
    quoted = '{"name": "add", "parameters": {"a": "%s\\"%s"}}' % ("[" * 500, "{" * 500)
    assert make_parser("llama3_json", []).parse(quoted).calls == [ToolCall("add", {"a": "[" * 500 + '"' + "{" * 500})]


@SEARCH
@given(HOSTILE)
@example("<tool_call>" + DEEP_ARRAYS + "</tool_call>")
def test_the_hermes_parser_answers_any_text(text):
    _assert_answered(make_parser("hermes", []).parse(text))


@SEARCH
@given(st.one_of(HOSTILE, LLAMA_CALL, HOSTILE.map(lambda t: "{" + t)))
@example(DEEP_ARRAYS.replace("arguments", "parameters"))
def test_the_llama3_json_parser_answers_any_text(text):
    _assert_answered(make_parser("llama3_json", []).parse(text))


@SEARCH
@given(st.one_of(HERMES_CALL, HOSTILE))
def test_the_hermes_parser_answers_any_call_arguments_and_the_tags_parser_any_text(text):
    _assert_answered(make_parser("hermes", []).parse(text))
    _assert_answered(TAGS.parse(text))


@SEARCH
@given(HOSTILE, st.sampled_from([(0.0, 10.0), (-1.0, 1.0), (1.0, 5.0)]))
def test_the_judge_s_verdict_parsers_answer_any_text_with_a_score_in_range_or_none(verdict, score_range):
    low, high = score_range
    for parse in (number_parser(low, high), boxed_parser(low, high), choice_parser({"A": 1.0, "B": 0.0, "AB": 0.5})):
        score = parse(verdict)
        assert score is None or (isinstance(score, float) and low <= score <= high or score in (0.0, 0.5, 1.0))


@SEARCH
@given(HOSTILE, st.one_of(st.just("72"), HOSTILE, st.lists(HOSTILE, max_size=3)))
@example("#### " + "9" * 400, "1")  # once an OverflowError (the float's infinity made an int)
@example("#### 1", "nan")
def test_the_gsm8k_verifier_and_the_format_reward_answer_any_response_with_zero_or_one(response, truth):
    assert verifiers.gsm8k(["q"], [response], [truth]) in ([0.0], [1.0])
    assert verifiers.answer_format(["q"], [response]) in ([0.0], [1.0])
    boxed = verifiers.last_boxed(response)
    assert boxed is None or boxed in response


def test_the_gsm8k_verifier_compares_numbers_exactly():
    responses = ["#### 1,000", "#### 2.50", "#### $3.", "#### 12345678901234567890", "#### " + "9" * 400]
    truths = ["1000", "2.5", "3", "12345678901234567891", "9" * 400]
    assert verifiers.gsm8k([""] * 5, responses, truths) == [1.0, 1.0, 1.0, 0.0, 1.0]


@settings(SEARCH, max_examples=25)
@given(st.lists(st.one_of(st.text(ANY_CHARACTER, max_size=20), st.sampled_from(MARKERS)), max_size=5).map("".join))
def test_the_math_verifier_answers_any_response_with_zero_or_one(response):
    assert verifiers.math(["q"], [response], ["1/2"]) in ([0.0], [1.0])


@SEARCH
@given(st.lists(st.integers(0, 9), max_size=60), st.integers(0, 20), st.lists(st.integers(0, 9), min_size=1,
                                                                             max_size=3))
def test_a_process_reward_model_s_step_ends_answer_any_tokens(ids, prompt_length, separator):
    from megatron_rlhf.rollout.scoring import step_ends

    prompt_length = min(prompt_length, len(ids))
    tokens = torch.tensor([ids + [0]])
    ends = step_ends(tokens, torch.tensor([prompt_length]), torch.tensor([len(ids) - prompt_length]), separator)
    found = ends[0].nonzero().flatten().tolist()
    assert all(prompt_length <= e < len(ids) for e in found)
    assert (found[-1] == len(ids) - 1) if len(ids) > prompt_length else not found


@SEARCH
@given(st.one_of(HOSTILE, st.integers(), st.lists(HOSTILE, max_size=3), st.dictionaries(HOSTILE, HOSTILE, max_size=3),
                 st.just(10 ** 5000), st.just(object()), st.just(float("nan"))))
def test_a_tool_s_reply_is_text_a_tokenizer_reads_whatever_the_tool_returned(value):
    result_text(value).encode("utf-8")


def test_a_reply_with_a_lone_surrogate_or_an_unwritable_value_is_still_said():
    assert result_text("a\ud800b") == "a\ufffdb"
    assert result_text(10 ** 5000).startswith("<a int that cannot be shown")


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    from megatron_rlhf.data.tokenizer import HFTokenizer
    from tests.test_tools import byte_tokenizer_dir

    return HFTokenizer(byte_tokenizer_dir(tmp_path_factory.mktemp("tok") / "qwen", "qwen"))


@settings(SEARCH, max_examples=50)
@given(st.lists(st.integers(0, 400), max_size=40), st.lists(st.sampled_from(["</python>", "STOP", "}", "\n"]),
                                                            min_size=1, max_size=2))
def test_a_turn_is_cut_after_its_first_stop_string_whatever_ids_the_model_wrote(qwen_tokenizer, ids, stops):
    """Ids past the tokenizer's vocabulary included (the padded rows of the output layer)."""
    from megatron_rlhf.rollout.multiturn import MultiTurn

    turns = types.SimpleNamespace(tokenizer=qwen_tokenizer, stop_strings=tuple(stops))
    cut = MultiTurn._cut_at_stop(turns, list(ids))
    assert cut == ids[: len(cut)]
    stopped = lambda n: any(s in qwen_tokenizer.decode(ids[:n]) for s in stops)  # noqa: E731
    assert len(cut) == len(ids) and not stopped(len(ids)) or stopped(len(cut)) and not stopped(len(cut) - 1)
