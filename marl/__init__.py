"""polyrl.marl: several LLM agents that learn to work together.

Importing the package registers its parts in the core's registries: the multi-agent
workflows (``signaling``, ``parallel``, ``chain``, ``debate``, ``aggregator`` and
``look_and_answer``, where a vision-language looker describes the row's image to a
text-only solver), the ``magrpo`` credit assignment and the ``max_baseline`` advantage, the
``lora_agent`` policy kind (one LoRA adapter per agent on a shared base) with its
``vllm_lora`` engine (one vLLM serving every adapter), and the ``signaling`` and
``vl_team_colour`` (issue 21's Demo B) tasks, and ``paint_team``: an LLM writer, a
diffusion painter (``team[name].paint``) and a VLM judge trained together. A recipe
may add a centralized critic (``rollout.args.critic``, :mod:`polyrl.marl.critic`): a value
head over the joint transcript that replaces group baselines with ``R - V(joint state)``.

Modules: :mod:`~polyrl.marl.api` (the agent API workflows are written in),
:mod:`~polyrl.marl.runtime` (``@workflow``, its spec and the workflow bound to a run),
:mod:`~polyrl.marl.batching` (one generate per policy per round), :mod:`~polyrl.marl.record`
(episodes -> record), :mod:`~polyrl.marl.config` (typed options), :mod:`~polyrl.marl.credit`
(``magrpo``), :mod:`~polyrl.marl.critic`, :mod:`~polyrl.marl.lora`,
:mod:`~polyrl.marl.vllm_lora`, :mod:`~polyrl.marl.workflows` (the built-ins) and
:mod:`~polyrl.marl.signaling` (the demo task) and :mod:`~polyrl.marl.vl_team` (Demo B's
task). See ``marl/README.md``.

Write your own workflow as an async function over the agent API::

    from polyrl.marl import workflow

    @workflow("my_flow", agents={"writer": "You write.", "critic": "You critique."})
    async def my_flow(ep, team):
        drafts = await team["writer"].act(ep.task, n=ep.G)
        notes = await ep.gather(team["critic"].act(d.text) for d in drafts)
        for d, c in zip(drafts, notes):
            ep.joint([d, c], final=c.text)
"""

from polyrl.marl import (
    credit,
    critic,
    lora,
    paint_team,
    signaling,
    tinker_api,
    vl_team,
    vllm_lora,
    workflows,
)
from polyrl.marl.api import AgentHandle, Episode, Joint, Message, Team
from polyrl.marl.config import AgentSpec, CriticOptions, MarlOptions
from polyrl.marl.record import JOINT_POLICY
from polyrl.marl.runtime import MarlWorkflow, WorkflowSpec, workflow

__all__ = [
    "JOINT_POLICY",
    "AgentHandle",
    "AgentSpec",
    "CriticOptions",
    "Episode",
    "Joint",
    "MarlOptions",
    "MarlWorkflow",
    "Message",
    "Team",
    "WorkflowSpec",
    "credit",
    "critic",
    "lora",
    "paint_team",
    "signaling",
    "tinker_api",
    "vl_team",
    "vllm_lora",
    "workflow",
    "workflows",
]
