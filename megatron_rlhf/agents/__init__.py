"""What answers the policy between its turns: the environment protocol (protocol.py: a custom
environment's start and step, their checks), and the tools agents call through the built-in tool
environment (tool_environment.py): function tools with JSON schemas (function.py), parsers of the
models' tool-call formats (parsers.py), MCP servers' tools (mcp_tools.py) and the Python sandbox
for model-written code (sandbox/). Nothing here imports torch: it runs in the environment workers."""
