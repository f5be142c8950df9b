"""polyrl.agents: multi-turn agentic RL -- environments, tools, a sandbox, step-level credit.

Importing the package registers its parts in the core's registries: the ``multi_turn``
and ``gateway`` workflows, the ``gridworld`` and ``tool_math`` environments and tasks, the ``episode_grpo``, ``turn_return``
and ``gigpo`` credit schemes and the ``env_return`` / ``env_success`` / ``success_rate``
rewards.
"""

from polyrl.agents import credit, gateway, gridworld, math_env, rewards, tools, workflow  # noqa: F401
from polyrl.agents.chat import ChatFormat
from polyrl.agents.env import Environment, StepResult, make_env_factory, register_env
from polyrl.agents.sandbox import Sandbox, SandboxLimits, SandboxResult
from polyrl.agents.tools import TOOL_PARSERS, Tool, ToolEnv, register_parser, tool
from polyrl.agents.workflow import MultiTurn

__all__ = [
    "TOOL_PARSERS",
    "ChatFormat",
    "Environment",
    "MultiTurn",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "StepResult",
    "Tool",
    "ToolEnv",
    "make_env_factory",
    "register_env",
    "register_parser",
    "tool",
]
