"""Configs the agent tests share."""

# The agent demo with the sandboxed Python tool in the tags format instead of its environment
# ({repo}: the checkout's root).
TOOLS_CONFIG = """includes: {repo}/examples/tiny_agent/grpo.yaml
data:
  tokenizer:
    alphabet: "abcdefghijklmnopqrstuvwxyz <>/()+0123456789"
rollout:
  environment: null
  tools: [megatron_rlhf.agents.sandbox:python]
  tool_parser: tags
"""
