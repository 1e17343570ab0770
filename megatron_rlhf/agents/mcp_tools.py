"""Tools served by MCP servers (``rollout.mcp_servers``: command lines, stdio transport, the ``mcp``
package's client): each server is started once per process that calls it, its tools listed with
their schemas and called like function tools. A server that dies is started again at the next
call; the call that found it dead is answered with an error (counted).

The client's asyncio loop runs in a thread of its own, so the tool environment's threads call a
server as they call a function.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import threading
from typing import Any, Dict, List, Optional

from megatron_rlhf.agents.function import FunctionTool, ToolError, check_schema

START_TIMEOUT_S = 60.0


class MCPServerTools:
    """The tools of one MCP server started by ``command`` (a command line) in ``cwd``."""

    def __init__(self, command: str, cwd: str, timeout_s: float = 30.0):
        self.command, self.cwd, self.timeout_s = command, cwd, timeout_s
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True).start()
        self._session = None
        self._stack: Optional[contextlib.AsyncExitStack] = None
        self._lock = threading.Lock()
        self.restarts = 0

    def _run(self, coroutine, timeout: float):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    async def _connect(self) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        argv = shlex.split(self.command)
        stack = contextlib.AsyncExitStack()
        read, write = await stack.enter_async_context(stdio_client(StdioServerParameters(
            command=argv[0], args=argv[1:], cwd=self.cwd)))
        session = await stack.enter_async_context(ClientSession(read, write))
        await session.initialize()
        self._stack, self._session = stack, session

    async def _disconnect(self) -> None:
        stack, self._stack, self._session = self._stack, None, None
        if stack is not None:
            with contextlib.suppress(BaseException):
                await stack.aclose()

    def _session_or_start(self):
        with self._lock:
            if self._session is None:
                try:
                    self._run(self._connect(), START_TIMEOUT_S)
                except BaseException as e:
                    self._run(self._disconnect(), 10.0)
                    raise ToolError(f"the MCP server `{self.command}` could not be started ({type(e).__name__}: {e})") from None
            return self._session

    def tools(self) -> List[FunctionTool]:
        """The server's tools, each calling it."""
        session = self._session_or_start()
        listed = self._run(session.list_tools(), self.timeout_s).tools
        out = []
        for tool in listed:
            schema = dict(getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None) or {"type": "object"})
            check_schema(schema, f"{tool.name} of MCP server `{self.command}`")
            out.append(FunctionTool(tool.name, tool.description or "", schema, _Caller(self, tool.name)))
        return out

    def call(self, name: str, arguments: Dict[str, Any]) -> str:
        """The text of the server's answer; ToolError for an error result, a time-out, or a server
        that died (it is started again at the next call)."""
        session = self._session_or_start()
        try:
            result = self._run(session.call_tool(name, arguments), self.timeout_s)
        except TimeoutError:
            raise ToolError(f"{name}: the MCP server did not answer within {self.timeout_s:g}s", timed_out=True) from None
        except Exception as e:  # the connection broke: the server died
            self.restarts += 1
            self._run(self._disconnect(), 10.0)
            raise ToolError(f"{name}: the MCP server `{self.command}` stopped ({type(e).__name__}: {e}); it is "
                            "started again for the next call") from None
        text = "\n".join(getattr(block, "text", "") for block in result.content if getattr(block, "type", "") == "text")
        if getattr(result, "is_error", False) or getattr(result, "isError", False):
            raise ToolError(f"{name}: {text}")
        return text

    def close(self) -> None:
        """Stop the server (a later call starts it again)."""
        with contextlib.suppress(BaseException):
            self._run(self._disconnect(), 10.0)


class _Caller:
    """A server's tool as a callable with keyword arguments (what the tool environment calls)."""

    def __init__(self, server: MCPServerTools, name: str):
        self.server, self.name = server, name

    def __call__(self, **arguments) -> str:
        return self.server.call(self.name, arguments)


def load_mcp_tools(commands: List[str], cwd: str, timeout_s: float, keep: bool = True) -> List[FunctionTool]:
    """The tools of every server (each started here), in order; ``keep``: False stops each server
    once its tools are listed (their callables then start it again if called)."""
    tools: List[FunctionTool] = []
    for command in commands:
        server = MCPServerTools(command, cwd, timeout_s)
        try:
            tools += server.tools()
        except ToolError as e:
            server.close()
            raise ValueError(f"rollout.mcp_servers: {e}") from None
        if not keep:
            server.close()
    return tools
