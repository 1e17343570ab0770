"""Tools for agents: function tools with JSON schemas (function.py), parsers of the models' tool-call
formats (parsers.py), the built-in tool environment on the rollout's environment protocol
(environment.py), and a sandboxed Python tool for model-written code (sandbox.py). Nothing here
imports torch: it runs in the environment workers."""
