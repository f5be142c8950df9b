"""The end of an external agent's process (``rollout.args.command``), said plainly.

A command agent that dies of a signal (the kernel's OOM killer, a sandbox limit, a
``kill -9``) has a negative return code; "exited with status -9" hides what happened, so
:func:`finish` names the signal and keeps the tail of what the process wrote to stderr.
It reads stdout and stderr while the process runs and stops reading a short grace after it
ends: a killed agent whose child still holds the pipes open (a shell's background job, a
tool server) must not hold the episode until its timeout or lose the stderr read so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

TAIL = 500  # characters of stderr kept in the error
GRACE_S = 1.0  # how long the pipes are read after the process ended
POLL_S = 0.05


class AgentExited(RuntimeError):
    """The agent command ended with a non-zero status or was killed by a signal."""


def how_it_ended(returncode: int) -> str:
    """``exited with status 1``, ``was killed by SIGKILL (signal 9)``; a shell's
    ``128 + n`` (its child killed by signal n) is read as such too."""
    if returncode < 0:
        return f"was killed by {_signal_name(-returncode)} (signal {-returncode})"
    text = f"exited with status {returncode}"
    if 128 < returncode < 128 + 65:
        text += f" (a shell's 128 + {returncode - 128}: its child was killed by "
        text += f"{_signal_name(returncode - 128)})"
    return text


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


async def _drain(stream: asyncio.StreamReader | None, into: bytearray) -> None:
    if stream is None:
        return
    while chunk := await stream.read(1 << 16):
        into += chunk


async def finish(proc: asyncio.subprocess.Process, name: str) -> bytes:
    """Wait for ``proc`` (started with stdout and stderr piped) and return its stdout; a
    non-zero end raises :class:`AgentExited` naming the status or the signal with the
    stderr tail. Cancelled (an episode timeout), it kills the process and re-raises."""
    out, err = bytearray(), bytearray()
    readers = [
        asyncio.ensure_future(_drain(proc.stdout, out)),
        asyncio.ensure_future(_drain(proc.stderr, err)),
    ]
    try:
        # asyncio's wait() returns only once the pipes close, which a child of the agent
        # may put off for ever: watch the exit status itself
        while proc.returncode is None and not all(r.done() for r in readers):
            await asyncio.wait(readers, timeout=POLL_S)
        if proc.returncode is None:
            await proc.wait()  # the pipes are closed: this returns at the exit
        await asyncio.wait(readers, timeout=GRACE_S)  # what is still in the pipes
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    finally:
        for r in readers:
            r.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-TAIL:]
        said = f": {tail}" if tail else " (it wrote nothing to stderr)"
        raise AgentExited(f"the agent command {name} {how_it_ended(proc.returncode or 0)}{said}")
    return bytes(out)
