"""A command agent killed by a signal (agents/agent_process.py) is reported naming the
signal, with the tail of its stderr, and never holds its episode open after it died; real
processes, real signals."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys

import pytest

from polyrl.agents.agent_process import AgentExited, finish, how_it_ended


async def _run(*cmd: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


def test_the_end_of_a_process_in_words():
    assert how_it_ended(1) == "exited with status 1"
    assert how_it_ended(-9) == "was killed by SIGKILL (signal 9)"
    assert how_it_ended(-15) == "was killed by SIGTERM (signal 15)"
    assert how_it_ended(137) == (
        "exited with status 137 (a shell's 128 + 9: its child was killed by SIGKILL)"
    )


def test_a_killed_agent_names_the_signal_and_keeps_its_stderr():
    async def main():
        proc = await _run(
            "sh", "-c", "echo 'loading tools' >&2; echo 'out of memory' >&2; kill -9 $$"
        )
        with pytest.raises(AgentExited) as e:
            await finish(proc, "sh")
        return str(e.value)

    msg = asyncio.run(main())
    assert (
        msg == "the agent command sh was killed by SIGKILL (signal 9): loading tools\nout of memory"
    )


def test_a_killed_agent_whose_child_keeps_the_pipes_is_reported_at_once():
    """The agent's background child inherits stderr and lives on: the episode still ends
    (the old ``communicate()`` waited for the child), with the stderr written so far."""

    async def main():
        proc = await _run("sh", "-c", 'sleep 60 & echo "child $!" >&2; kill -TERM $$')
        with pytest.raises(AgentExited) as e:
            await asyncio.wait_for(finish(proc, "sh"), timeout=30)
        child = int(re.search(r"child (\d+)", str(e.value))[1])
        os.kill(child, signal.SIGKILL)  # the test's own cleanup of the orphan
        await proc.communicate()  # the pipes close with it
        for _ in range(3):  # their close callbacks run before the loop ends
            await asyncio.sleep(0)
        return str(e.value)

    msg = asyncio.run(main())
    assert msg.startswith("the agent command sh was killed by SIGTERM (signal 15): child ")


def test_a_silent_kill_says_stderr_was_empty_and_a_clean_exit_returns_stdout():
    async def main():
        silent = await _run("sh", "-c", "kill -KILL $$")
        with pytest.raises(AgentExited) as e:
            await finish(silent, "sh")
        ok = await _run("sh", "-c", "echo chatty; echo '{\"reward\": 1}'")
        return str(e.value), await finish(ok, "sh")

    msg, out = asyncio.run(main())
    assert (
        msg == "the agent command sh was killed by SIGKILL (signal 9) (it wrote nothing to stderr)"
    )
    assert out == b'chatty\n{"reward": 1}\n'


KILLED_AGENT = """
import os, signal, sys
sys.stderr.write("about to be killed\\n")
sys.stderr.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_gateway_episode_of_a_killed_agent_says_so(grid_model_dir, items):
    from polyrl.agents.gateway import Gateway
    from polyrl.core.record import strings
    from polyrl.core.rollout.engine import SamplingParams
    from polyrl.core.rollout.workflow import Context
    from tests.helpers.gateway import spied_models

    policies, engines = spied_models(grid_model_dir)
    # not isolated: in its own PID namespace the agent is PID 1, which its own SIGKILL
    # cannot end (and util-linux unshare reports a killed child as status 1)
    wf = Gateway(
        Context(None, policies, engines),
        command=[sys.executable, "-c", KILLED_AGENT],
        isolate_commands=False,
    )
    try:
        rec = wf.rollout(items([{"prompt": "grid S.G"}]), SamplingParams(n=1, max_new_tokens=4))
    finally:
        wf.close()
    assert rec["valid"].tolist() == [False]
    assert strings(rec, "error")[0] == (
        f"the agent command {sys.executable} was killed by SIGKILL (signal 9): about to be killed"
    )
