"""One event loop for a workflow's agents, alive from the first rollout to ``close``.

Agent frameworks keep their async HTTP clients past an episode: langchain-openai's
``ChatOpenAI`` caches an ``httpx`` client per base URL (128 of them, least recently used
dropped), and the ``openai`` and ``anthropic`` clients close theirs when collected by
scheduling ``aclose()`` on whatever loop is running then. A loop per rollout step (what
:func:`polyrl.core.rollout.workflow.run_sync` gives) closes under those clients: when a later step
drops one, its ``aclose()`` touches connections of the closed loop and the log fills with
``Task exception was never retrieved ... RuntimeError: Event loop is closed`` (thousands
of times in a run). Here every rollout of the workflow runs on the same loop, in a thread
of its own, so a client made in step 1 can still close in step 30; ``close`` collects the
clients nobody holds while the loop still runs, lets their ``aclose()`` finish, then shuts
the loop down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import gc
import threading
from collections.abc import Coroutine
from typing import Any


class AgentLoop:
    """Runs coroutines on one long-lived event loop in a daemon thread (see the module doc)."""

    def __init__(self, name: str = "polyrl-agents", drain_timeout: float = 5.0) -> None:
        self.name = name
        self.drain_timeout = drain_timeout  # seconds close() waits for clients to close
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and return its result (or raise its error). It runs in
        the caller's context (its ContextVars: a step's trace), as ``asyncio.run`` would;
        Ctrl-C (any exception while waiting) cancels it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(f"{self.name}: run() called from its own loop would wait forever")
        loop = self._start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        tasks: list[asyncio.Task] = []

        def settle(task: asyncio.Task) -> None:
            if task.cancelled():
                done.cancel()
            elif task.exception() is not None:
                done.set_exception(task.exception())  # type: ignore[arg-type]
            else:
                done.set_result(task.result())

        def start() -> None:  # on the loop, in the caller's context: the task copies it
            task = loop.create_task(coro)
            task.add_done_callback(settle)
            tasks.append(task)

        loop.call_soon_threadsafe(start, context=contextvars.copy_context())
        try:
            return done.result()
        except BaseException:
            loop.call_soon_threadsafe(lambda: [t.cancel() for t in tasks])
            raise

    def close(self) -> None:
        """Let the clients the agents left close on this loop, then shut it down."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._drain(), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    async def _drain(self) -> None:
        gc.collect()  # unreachable clients schedule their aclose() on this (running) loop
        loop, me = asyncio.get_running_loop(), asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not me]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.drain_timeout)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        await loop.shutdown_asyncgens()
        await loop.shutdown_default_executor()
