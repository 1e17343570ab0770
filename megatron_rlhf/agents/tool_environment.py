"""The built-in tool environment (``rollout.tools``): the model's turn is parsed for tool calls
(``rollout.tool_parser``); each call is checked against its tool's schema and run, side by side
(at most ``max_parallel_calls`` at once, each bounded by ``tool_timeout_s``); the results go back
as ``tool`` messages through the chat template, and the model writes again. A turn without a call
ends the trajectory (the model answered). A call that cannot be read, names no tool, has wrong
arguments, raises, or runs out of time is answered with the error as the tool's reply, and counted:
never a failed trajectory.

It runs in the environment workers (rollout/env_pool.py) like any environment; its step reports
``counts`` in its info: ``tool_calls`` (and ``tool_calls/<name>``), ``tool_errors`` (and
``tool_errors/<kind>`` for a call that could not be read, agents/parsers.py's PROBLEM_KINDS: a call
nested too deep, an over-long integer, a lone surrogate, ...), ``tool_timeouts``, ``tool_s`` (the
calls' wall time), and with ``rollout.sandbox.kind: unsafe_process`` ``tool_unsafe_calls``
(sandboxed calls run without isolation).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Dict, List, Optional, Sequence

from megatron_rlhf.config.schema import SandboxConfig
from megatron_rlhf.agents.protocol import StepResult, Turn
from megatron_rlhf.agents.sandbox import configure as configure_sandbox, take_unsafe_runs
from megatron_rlhf.agents.function import FunctionTool, ToolError, argument_problem, load_tools, result_text
from megatron_rlhf.agents.parsers import ParsedTurn, ToolCall, make_parser

SPEC = "megatron_rlhf.agents.tool_environment:ToolEnvironment"


def tool_options(config) -> Dict[str, Any]:
    """What the workers' ToolEnvironment is made with, from ``config.rollout`` (tool files absolute)."""
    import os

    from megatron_rlhf.rewards.contract import absolute_spec

    r = config.rollout
    base = config.base_dir_of("rollout.tools") if r.tools else ""
    servers_dir = config.base_dir_of("rollout.mcp_servers") if r.mcp_servers else ""
    return {"tools": [absolute_spec(spec, base) for spec in r.tools], "parser": r.tool_parser,
            "max_parallel_calls": r.max_parallel_calls, "tool_timeout_s": r.tool_timeout_s,
            "mcp_servers": list(r.mcp_servers), "mcp_dir": servers_dir, "sandbox": dataclasses.asdict(r.sandbox)}


@functools.lru_cache(maxsize=None)
def load_tool_set(specs: Sequence[str], parser: str, mcp_servers: Sequence[str] = (), mcp_dir: str = "",
                  timeout_s: float = 30.0, keep_servers: bool = True):
    """The tools of ``specs`` (absolute) and of the MCP servers (command lines, started in
    ``mcp_dir``) by name, and the parser for them; loaded once per process. ``keep_servers``:
    False lists the servers' tools and stops them (the prompts need only their schemas)."""
    import os

    from megatron_rlhf.agents.mcp_tools import load_mcp_tools

    tools = load_tools(specs, os.getcwd())
    tools += load_mcp_tools(list(mcp_servers), mcp_dir or os.getcwd(), timeout_s, keep=keep_servers)
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"rollout.tools / rollout.mcp_servers: two tools are named {', '.join(map(repr, twice))}; "
                         "tool names must differ")
    return {t.name: t for t in tools}, make_parser(parser, tools)


def tool_set_of(options: Dict[str, Any], keep_servers: bool = True):
    """load_tool_set for the ToolEnvironment ``options`` (tool_options)."""
    return load_tool_set(tuple(options["tools"]), options["parser"], tuple(options.get("mcp_servers", ())),
                         options.get("mcp_dir", ""), options.get("tool_timeout_s", 30.0), keep_servers)


_EXECUTORS: Dict[int, concurrent.futures.ThreadPoolExecutor] = {}  # this worker's, by max_parallel_calls


def _executor(workers: int, fresh: bool = False) -> concurrent.futures.ThreadPoolExecutor:
    """The threads tool calls run in; ``fresh``: new ones, the old left to the calls that hang in
    them (a thread cannot be stopped), so that a hung call never delays a later one."""
    if fresh or workers not in _EXECUTORS:
        old = _EXECUTORS.get(workers)
        _EXECUTORS[workers] = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tool")
        if old is not None:
            old.shutdown(wait=False)
    return _EXECUTORS[workers]


class ToolEnvironment:
    def __init__(self, tools: Sequence[str], parser: str, max_parallel_calls: int = 4,
                 tool_timeout_s: float = 30.0, mcp_servers: Sequence[str] = (), mcp_dir: str = "",
                 sandbox: Optional[Dict[str, Any]] = None):
        self.tools, self.parser = load_tool_set(tuple(tools), parser, tuple(mcp_servers), mcp_dir, tool_timeout_s)
        self.workers = max_parallel_calls
        self.timeout_s = tool_timeout_s
        self.callable = list(self.tools)  # the tools the row may call (start): all, or those its column names
        settings = SandboxConfig(**(sandbox or {}))
        self.unsafe = settings.unsafe
        configure_sandbox(settings)

    def start(self, row: Dict[str, Any]) -> None:
        """A row whose ``tools`` column names tools may call only those, none for an empty list
        (data/rows.py named_tools)."""
        from megatron_rlhf.data.rows import named_tools, row_tools

        named = named_tools(row_tools(row.get("tools")))
        self.callable = [name for name in self.tools if named is None or name in named]
        return None

    def step(self, turn: Turn) -> StepResult:
        parsed: ParsedTurn = self.parser.parse(turn.text)  # a call it cannot read is a problem, never a raise
        counts: Dict[str, float] = {"tool_calls": 0.0, "tool_errors": float(len(parsed.problems)),
                                    "tool_timeouts": 0.0, "tool_s": 0.0}
        for problem in parsed.problems:
            counts[f"tool_errors/{problem.kind}"] = counts.get(f"tool_errors/{problem.kind}", 0.0) + 1
        if not parsed.wants_tools:
            return StepResult(None, True, None, {"counts": counts})
        started = time.perf_counter()
        replies = [f"error: {problem.message}" for problem in parsed.problems]
        replies += self._call_all(parsed.calls, counts)
        counts["tool_s"] = time.perf_counter() - started
        if self.unsafe:
            counts["tool_unsafe_calls"] = float(take_unsafe_runs())
        return StepResult([{"role": "tool", "content": reply} for reply in replies], False, None, {"counts": counts})

    def _call_all(self, calls: List[ToolCall], counts: Dict[str, float]) -> List[str]:
        """Each call's reply, in order; the calls that can run run side by side."""
        replies: List[Any] = []
        for call in calls:
            tool = self.tools.get(call.name) if call.name in self.callable else None
            tools = f"the tools are {', '.join(self.callable)}" if self.callable else "this row has no tools"
            problem = (f"there is no tool {call.name!r}; {tools}" if tool is None
                       else argument_problem(tool, call.arguments))
            if problem:
                counts["tool_errors"] += 1
                replies.append(f"error: {problem}")
                continue
            counts["tool_calls"] += 1
            counts[f"tool_calls/{tool.name}"] = counts.get(f"tool_calls/{tool.name}", 0.0) + 1
            replies.append((tool, _executor(self.workers).submit(tool.fn, **call.arguments),
                            time.monotonic() + self.timeout_s))
        return [r if isinstance(r, str) else self._reply(*r, counts) for r in replies]

    def _reply(self, tool: FunctionTool, future: concurrent.futures.Future, deadline: float,
               counts: Dict[str, float]) -> str:
        """The call's result as text, or the error the model is shown (counted). A call still
        running at its deadline is left to finish on its own (a thread cannot be stopped): a tool
        that may never return should run its work in a process, as the sandbox does; later calls
        run in fresh threads."""
        try:
            return result_text(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
        except concurrent.futures.TimeoutError:
            counts["tool_errors"] += 1
            counts["tool_timeouts"] += 1
            _executor(self.workers, fresh=True)  # the hung call keeps its thread; later calls get others
            return f"error: {tool.name} did not answer within {self.timeout_s:g}s"
        except SystemExit as e:  # a tool's sys.exit ends its call, not the worker or the trajectory
            counts["tool_errors"] += 1
            return f"error: {tool.name} called sys.exit({e.code!r})"
        except ToolError as e:
            counts["tool_errors"] += 1
            counts["tool_timeouts"] += e.timed_out
            return f"error: {e}"
        except Exception as e:  # the tool failed on these arguments: the model is told, the run goes on
            counts["tool_errors"] += 1
            return f"error: {tool.name} raised {type(e).__name__}: {e}"
