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
from typing import Any, Dict, List, Sequence, Tuple

from megatron_rlhf.config.names import TOOL_PARSERS, registry


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Any  # a JSON object when well formed (checked against the tool's schema later)


@dataclasses.dataclass
class ParsedTurn:
    """``calls`` in order; ``problems``: one message per call that could not be read."""

    calls: List[ToolCall] = dataclasses.field(default_factory=list)
    problems: List[str] = dataclasses.field(default_factory=list)

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.problems)


def _call_of(obj: Any, arguments_key: str) -> Tuple[ToolCall, str]:
    """A decoded JSON call -> (call, "") or (None, the problem)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, f'a tool call is {{"name": ..., "{arguments_key}": {{...}}}}, got {json.dumps(obj)[:120]}'
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            return None, f"the arguments of {obj['name']} are not valid JSON ({e.msg} at column {e.colno})"
    return ToolCall(obj["name"], arguments), ""


class HermesParser:
    stop: Tuple[str, ...] = ()
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        out = ParsedTurn()
        for match in self._block.finditer(text):
            body, closed = match.group(1).strip(), bool(match.group(2))
            if not closed:
                out.problems.append("a <tool_call> was not closed with </tool_call>")
                continue
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                out.problems.append(f"the tool call is not valid JSON ({e.msg} at column {e.colno}): {body[:120]}")
                continue
            call, problem = _call_of(obj, "arguments")
            out.calls.append(call) if call else out.problems.append(problem)
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
        decoder, position = json.JSONDecoder(), 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError as e:
                out.problems.append(f"the tool call is not valid JSON ({e.msg} at column {e.colno}): {body[position:][:120]}")
                break
            call, problem = _call_of(obj, "parameters")
            out.calls.append(call) if call else out.problems.append(problem)
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
            out.problems.append(f"<{name}> was not closed with </{name}>")
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
