"""Parsers of the tool calls models write, one per format (``rollout.tool_parser``).

A parser turns a model turn's text into its calls (name and JSON arguments) and the problems of
the calls it could not read (shown to the model as the tool's reply, counted), and names the
strings that end a turn right after a call (``stop``; none where the model's own end token does).

- ``hermes``: Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn; the turn ends at the model's end token.
- ``llama3_json``: Llama-3.1's JSON tool calls: the turn is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``, several separated by ``;``); anything else is an answer.
- ``tags``: a plain stop-string protocol for custom environments: ``<python>code</python>`` calls
  the tool ``python`` with its one string argument set to ``code``; one call per turn, the turn
  ends right after a closing tag.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_rlhf.config.names import TOOL_PARSERS, registry


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # a JSON object when well formed (checked against the tool's schema later)


@dataclasses.dataclass(frozen=True)
class CallProblem:
    """Why a call could not be read: ``kind`` (one of PROBLEM_KINDS, counted as
    ``tool_errors/<kind>``) and the message the model is shown."""

    kind: str
    message: str


# What can be wrong with a call as written, each counted by this name.
PROBLEM_KINDS = ("unclosed", "json", "shape", "depth", "digits", "encoding")

# Bounds on what a call's JSON may hold, each said to the model when passed: deeper nesting would
# exhaust the stack of json, jsonschema or pickle on the way to the tool; longer integers are
# refused by Python's own int parser (sys.get_int_max_str_digits, 4300 by default).
MAX_JSON_DEPTH = 100
MAX_INT_DIGITS = 4300
_QUOTED = 120  # characters of a call quoted back in a message


@dataclasses.dataclass
class ParsedTurn:
    """``calls`` in order; ``problems``: one per call that could not be read."""

    calls: List[ToolCall] = dataclasses.field(default_factory=list)
    problems: List[CallProblem] = dataclasses.field(default_factory=list)

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.problems)


def json_depth(text: str) -> int:
    """The deepest nesting of brackets in ``text`` outside JSON strings, in one pass over the
    brackets, quotes and backslashes (linear for any text, however it is nested or quoted)."""
    depth = deepest = 0
    in_string, escaped_at = False, -1
    for match in _JSON_SPECIAL.finditer(text):
        char, at = match.group(), match.start()
        if at == escaped_at:
            continue
        if in_string:
            if char == "\\":
                escaped_at = at + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(depth - 1, 0)
    return deepest


_JSON_SPECIAL = re.compile(r'[\[\]{}"\\]')


class _LongInteger(ValueError):
    def __init__(self, digits: int):
        self.digits = digits


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _LongInteger(digits)
    return int(text)


def _lone_surrogate(value: Any) -> Optional[str]:
    """A lone UTF-16 surrogate in any string of a decoded JSON value (keys too), as ``\\udXXX``, or
    None: JSON's escapes can write one, but no text encoding can, so no tool or tokenizer reads it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            found = LONE_SURROGATE.search(item)
            if found:
                return f"\\u{ord(found.group()):04x}"
    return None


# A UTF-16 surrogate on its own: JSON escapes can write one into a str, but no encoding can write it out.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _quoted(text: str) -> str:
    """The start of ``text``, as the model is shown it (lone surrogates as U+FFFD: the reply is tokenised)."""
    return LONE_SURROGATE.sub("\ufffd", text[:_QUOTED])


def depth_problem(text: str) -> Optional[CallProblem]:
    deepest = json_depth(text)
    if deepest <= MAX_JSON_DEPTH:
        return None
    return CallProblem("depth", f"the tool call is nested {deepest} levels deep; at most {MAX_JSON_DEPTH} are read")


def read_json(text: str, position: int = 0) -> Tuple[Any, int, Optional[CallProblem]]:
    """One JSON value of ``text`` from ``position`` whose nesting depth_problem passed: (value,
    where it ends, None), or (None, -1, the problem) for text that is not JSON or passes a bound
    (digits, encoding). Never raises."""
    try:
        value, end = _DECODER.raw_decode(text, position)
    except _LongInteger as e:
        return None, -1, CallProblem("digits", f"the tool call holds an integer of {e.digits} digits; at most "
                                               f"{MAX_INT_DIGITS} are read")
    except json.JSONDecodeError as e:
        return None, -1, CallProblem("json", f"the tool call is not valid JSON ({e.msg} at column {e.colno}): "
                                             f"{_quoted(text[position:])}")
    surrogate = _lone_surrogate(value)
    if surrogate:
        return None, -1, CallProblem("encoding", f"the tool call holds a lone surrogate {surrogate}, which is not "
                                                 "text any encoding can write")
    return value, end, None


_DECODER = json.JSONDecoder(parse_int=_bounded_int)


def read_json_text(text: str) -> Tuple[Any, Optional[CallProblem]]:
    """``text`` as one JSON value (whitespace around it aside): (value, None) or (None, the problem)."""
    text = text.strip()
    problem = depth_problem(text)
    value, end, problem = (None, -1, problem) if problem else read_json(text)
    if problem is None and text[end:].strip():
        return None, CallProblem("json", f"the tool call is not valid JSON (extra data at column {end + 1}): "
                                         f"{_quoted(text)}")
    return value, problem


def _call_of(obj: Any, arguments_key: str) -> Tuple[Optional[ToolCall], Optional[CallProblem]]:
    """A decoded JSON call -> (call, None) or (None, the problem)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, CallProblem("shape", f'a tool call is {{"name": ..., "{arguments_key}": {{...}}}}, got '
                                          f"{_quoted(json.dumps(obj))}")
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments, problem = read_json_text(arguments)
        if problem:
            return None, CallProblem(problem.kind, f"the arguments of {_quoted(obj['name'])} are a string that does "
                                                   f"not read as JSON: {problem.message}")
    return ToolCall(obj["name"], arguments), None


class HermesParser:
    stop: Tuple[str, ...] = ()
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn()
        for match in self._block.finditer(text):
            body, closed = match.group(1), bool(match.group(2))
            if not closed:
                out.problems.append(CallProblem("unclosed", "a <tool_call> was not closed with </tool_call>"))
                continue
            obj, problem = read_json_text(body)
            if problem is None:
                call, problem = _call_of(obj, "arguments")
            out.calls.append(call) if problem is None else out.problems.append(problem)
        return out


class Llama3JsonParser:
    stop: Tuple[str, ...] = ()

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn()
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].lstrip()
        for marker in ("<|eom_id|>", "<|eot_id|>"):
            body = body.replace(marker, "")
        if not body.startswith("{"):
            return out  # an answer, not a call
        problem = depth_problem(body)
        if problem:
            out.problems.append(problem)
            return out
        position = 0
        while position < len(body):
            obj, end, problem = read_json(body, position)
            if problem is None:
                call, problem = _call_of(obj, "parameters")
            if problem is not None:
                out.problems.append(problem)
                if end < 0:
                    break
            else:
                out.calls.append(call)
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return out


class TagParser:
    """``<name>body</name>`` for each tool ``name`` (its one string argument: ``argument_of``)."""

    def __init__(self, argument_of: Dict[str, str]):
        self.argument_of = dict(argument_of)
        self.stop = tuple(f"</{name}>" for name in self.argument_of)
        names = "|".join(re.escape(n) for n in self.argument_of)
        self._block = re.compile(rf"<({names})>(.*?)(</\1>|$)", re.DOTALL) if names else None

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn()
        match = self._block.search(text) if self._block else None
        if match is None:
            return out
        name, body, closed = match.group(1), match.group(2), bool(match.group(3))
        if not closed:
            out.problems.append(CallProblem("unclosed", f"<{name}> was not closed with </{name}>"))
        else:
            out.calls.append(ToolCall(name, {self.argument_of[name]: body.strip("\n")}))
        return out


def _tag_parser(tools: Sequence) -> TagParser:
    """The tags parser for ``tools`` (FunctionTool): each must take one required string argument."""
    argument_of = {}
    for tool in tools:
        required = tool.parameters.get("required", [])
        kinds = [tool.parameters.get("properties", {}).get(r, {}).get("type") for r in required]
        if len(required) != 1 or kinds != ["string"]:
            raise ValueError(f"rollout.tool_parser: tags calls a tool with its one required string argument; "
                             f"{tool.name} requires {required or 'none'}")
        argument_of[tool.name] = required[0]
    return TagParser(argument_of)


PARSERS = registry(TOOL_PARSERS, "rollout.tool_parser", {
    "hermes": lambda tools: HermesParser(),
    "llama3_json": lambda tools: Llama3JsonParser(),
    "tags": _tag_parser,
})


def make_parser(name: str, tools: Sequence):
    """The parser ``name`` for ``tools``."""
    return PARSERS[name](tools)
