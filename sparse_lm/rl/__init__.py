"""Agentic RL (ARCHITECTURE.md §10, docs/rl.md): sandbox, tool-call format, tools,
environments, episodes on the inference engine, GRPO and the SFT-then-GRPO trainer."""

from sparse_lm.rl.sandbox import SandboxUnavailableError, ToolResult, run_python

__all__ = ["SandboxUnavailableError", "ToolResult", "run_python"]
