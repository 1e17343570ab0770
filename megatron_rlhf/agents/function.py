"""Function tools: a Python callable with a JSON schema, named in YAML (``rollout.tools``) and
called by name with JSON arguments.

The schema is the one transformers builds for ``apply_chat_template(tools=...)`` from the
callable's type hints and Google-style docstring (``transformers.utils.get_json_schema``), or
the callable's own ``tool_spec`` attribute (an OpenAI-style function spec) when it has one. The
specs go to the chat template, so the prompt shows the tools as the model family expects; the
model's arguments are checked against the schema (``jsonschema``) before a call.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional, Sequence

from megatron_rlhf.agents.parsers import LONE_SURROGATE


class ToolError(Exception):
    """Raised by a tool for a failure the model should read (its message is the tool's reply,
    counted in rollout/tool_errors; ``timed_out`` also in rollout/tool_timeouts)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


@dataclasses.dataclass(frozen=True)
class FunctionTool:
    """``parameters``: the JSON schema of the arguments (an object); ``fn(**arguments)``."""

    name: str
    description: str
    parameters: Dict[str, Any]
    fn: Callable[..., Any]

    @property
    def spec(self) -> Dict[str, Any]:
        """The OpenAI-style function spec a chat template's ``tools`` takes."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def function_tool(fn: Callable[..., Any], where: str = "") -> FunctionTool:
    """The tool of ``fn``: its ``tool_spec`` if it has one, else the schema transformers makes
    from its signature and docstring. ``where``: how the error names it."""
    from transformers.utils import get_json_schema

    where = where or getattr(fn, "__name__", repr(fn))
    spec = getattr(fn, "tool_spec", None)
    if spec is None:
        try:
            spec = get_json_schema(fn)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(f"tool {where}: no schema can be made from its signature and docstring ({e}); give it "
                             "type hints and a Google-style docstring with an Args: line per argument, or a "
                             "tool_spec attribute") from None
    function = spec.get("function", spec)
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(function.get("name"), str) or parameters.get("type") != "object":
        raise ValueError(f"tool {where}: its spec needs a name and parameters of type object, got {spec!r:.200}")
    check_schema(parameters, where)  # a broken schema stops the run here, not at the model's first call
    return FunctionTool(function["name"], function.get("description", ""), parameters, fn)


def load_tools(specs: Sequence[str], base: str) -> List[FunctionTool]:
    """The tools named ``module:callable`` or ``path/file.py:callable`` (relative to ``base``);
    two tools of one name are refused."""
    from megatron_rlhf.rewards.contract import load_reward_function

    tools: List[FunctionTool] = []
    for spec in specs:
        tool = function_tool(load_reward_function(spec, base, what="tool"), spec)
        if any(t.name == tool.name for t in tools):
            raise ValueError(f"rollout.tools: two tools are named {tool.name!r} ({spec}); tool names must differ")
        tools.append(tool)
    return tools


def check_schema(schema: Dict[str, Any], where: str):
    """Refuse a schema that is not valid JSON schema (once, where a tool is made)."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ValueError(f"tool {where}: its parameters are not a valid JSON schema ({e.message})") from None


def argument_problem(tool: FunctionTool, arguments: Any) -> Optional[str]:
    """Why ``arguments`` do not fit ``tool``'s schema (the message the model is shown), or None.
    The schema itself was checked when the tool was made."""
    import jsonschema

    if not isinstance(arguments, dict):
        return f"the arguments of {tool.name} must be a JSON object, got {json.dumps(arguments)[:80]}"
    error = next(iter(jsonschema.Draft202012Validator(tool.parameters).iter_errors(arguments)), None)
    if error is None:
        return None
    at = "/".join(str(p) for p in error.absolute_path)
    return f"invalid arguments for {tool.name}{f' at {at}' if at else ''}: {error.message}"


def result_text(value: Any) -> str:
    """A tool's return value as the text the model reads (JSON for anything but a string), whatever
    it returned: a value JSON cannot write is shown by its repr, one nothing can show is named by its
    type, and lone surrogates (no encoding writes them, no tokenizer reads them) become U+FFFD."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            try:
                value = repr(value)
            except Exception:  # an over-long int, a __repr__ that raises: the type is all that can be said
                value = f"<a {type(value).__name__} that cannot be shown as text>"
    return LONE_SURROGATE.sub("\ufffd", value)
