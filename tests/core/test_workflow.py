"""core.rollout.workflow helpers shared by the async plugin workflows."""

from __future__ import annotations

import asyncio
import threading

import pytest

from polyrl.core.rollout.workflow import run_sync


async def where_am_i() -> str:
    await asyncio.sleep(0)
    return threading.current_thread().name


def test_run_sync_from_plain_code_runs_on_this_thread():
    assert run_sync(where_am_i()) == threading.current_thread().name


def test_run_sync_inside_a_running_loop_uses_a_side_thread():
    async def caller():
        return run_sync(where_am_i())  # asyncio.run here would raise

    assert asyncio.run(caller()) != threading.current_thread().name


def test_run_sync_lets_errors_through():
    async def boom():
        raise KeyError("row 3")

    with pytest.raises(KeyError, match="row 3"):
        run_sync(boom())
