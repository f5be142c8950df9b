"""Contender processes and interleaved timing: ``Remote`` starts a contender (from
``_contenders.CONTENDERS``) in its own fresh Python process, ``serve`` is that process's
side, and ``interleave`` steps all contenders round-robin.

    python _runner.py --serve SPEC     (how ``Remote`` starts a worker)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from _common import HERE, RESULT_TAG, set_threads
from _contenders import CONTENDERS

# ------------------------------------------------------------------------------ workers


class Remote:
    """A contender in its own fresh Python process (default) or in this one.

    A fresh process per contender keeps them from inheriting each other's state: vLLM on
    CPU replaces ``torch.set_num_threads``, calls ``gc.freeze()`` and keeps process-global
    distributed state; TRL/accelerate set their own seeds and defaults."""

    def __init__(
        self,
        name: str,
        kind: str,
        kwargs: dict,
        *,
        threads: int,
        isolate: bool = True,
        env: dict | None = None,
    ) -> None:
        self.name, self.kind, self.kwargs, self.isolate = name, kind, kwargs, isolate
        self.error: str | None = None
        self.info: dict = {}
        self.obj = None
        self.proc = None
        if not isolate:
            set_threads(threads)
            try:
                self.obj = CONTENDERS[kind](**kwargs)
                self.info = self.obj.info
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                self.error = f"{type(e).__name__}: {e}"
            return
        full_env = dict(os.environ)
        full_env.update(
            {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "TOKENIZERS_PARALLELISM": "false",
                "OMP_NUM_THREADS": str(threads),
                "VLLM_CPU_KVCACHE_SPACE": "1",
            }
        )
        full_env.update(env or {})
        fd, self.log_path = tempfile.mkstemp(prefix=f"bench-{kind}-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        spec = json.dumps({"kind": kind, "kwargs": kwargs, "threads": threads})
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_runner.py"), "--serve", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=full_env,
            bufsize=1,
        )
        self._ready = False

    def wait_ready(self) -> None:
        if self.isolate and not self._ready and self.error is None:
            msg = self._read()
            if msg is not None:
                self.info = msg
            self._ready = True

    def _read(self) -> dict | None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            at = line.find(RESULT_TAG)  # another thread's print may share the line
            if at >= 0:
                msg, _ = json.JSONDecoder().raw_decode(line[at + len(RESULT_TAG) :])
                if "error" in msg:
                    self.error = msg["error"]
                    return None
                return msg
        self.error = f"worker exited ({self.proc.wait()}): {self.stderr_tail()}"
        return None

    def stderr_tail(self, lines: int = 12) -> str:
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError:
            return "?"
        return "\n".join(text.strip().splitlines()[-lines:])

    def call(self, op: str, **kwargs) -> dict | None:
        if self.error is not None:
            return None
        if not self.isolate:
            try:
                if op == "step":
                    return self.obj.step(**kwargs)
                return _local_op(self.obj, op, kwargs)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                self.error = f"{type(e).__name__}: {e}"
                return None
        self.wait_ready()
        if self.error is not None:
            return None
        try:
            self.proc.stdin.write(json.dumps({"op": op, "kwargs": kwargs}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.error = f"worker died: {self.stderr_tail()}"
            return None
        return self._read()

    def step(self, **kwargs) -> dict | None:
        return self.call("step", **kwargs)

    def close(self) -> None:
        if self.isolate and self.proc is not None:
            if self.proc.poll() is None and self.error is None:
                self.call("quit")
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.log.close()
            if self.error is None:
                os.unlink(self.log_path)
            else:
                print(f"  {self.name}: worker log kept at {self.log_path}", file=sys.stderr)
        elif self.obj is not None:
            self.obj.close()


_PROFILER: dict = {}


def _local_op(obj, op: str, kwargs: dict) -> dict:
    if op == "profile_start":
        import cProfile

        _PROFILER["p"] = cProfile.Profile()
        _PROFILER["p"].enable()
    elif op == "profile_stop":
        prof = _PROFILER.pop("p")
        prof.disable()
        prof.dump_stats(kwargs["path"])
    elif op == "quit":
        obj.close()
    return {}


def serve(spec: dict) -> None:
    """Worker side of :class:`Remote`: build the contender, then answer one JSON command
    per stdin line with one tagged JSON line on stdout."""
    set_threads(spec["threads"])
    try:
        obj = CONTENDERS[spec["kind"]](**spec["kwargs"])
        reply: dict = dict(obj.info)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(RESULT_TAG + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    print(RESULT_TAG + json.dumps(reply, default=str), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "step":
                reply = obj.step(**cmd["kwargs"])
            else:
                reply = _local_op(obj, cmd["op"], cmd["kwargs"])
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(RESULT_TAG + json.dumps(reply, default=str), flush=True)
        if cmd["op"] == "quit" or "error" in reply:
            break


def start_all(
    specs: dict[str, tuple[str, dict]], *, threads: int, isolate: bool
) -> dict[str, Remote]:
    """Start every contender (in parallel when isolated) and wait until all are ready."""
    remotes = {
        name: Remote(name, kind, kw, threads=threads, isolate=isolate)
        for name, (kind, kw) in specs.items()
    }
    for r in remotes.values():
        r.wait_ready()
    return remotes


def interleave(
    remotes: dict[str, Remote],
    *,
    warmup: int,
    steps: int,
    configs: list[dict] | None = None,
    profile_dir: str | None = None,
    progress: bool = True,
) -> dict[str, dict[str, list[dict]]]:
    """Round-robin steps over contenders (and configs), rotating the order every round.

    Returns {contender: {config key: [timed step results]}}; warm-up steps are dropped.
    """
    configs = configs or [{}]
    out: dict[str, dict[str, list[dict]]] = {n: {} for n in remotes}
    jobs = [(name, cfg) for cfg in configs for name in remotes]
    total = warmup + steps
    for rnd in range(total):
        if profile_dir and rnd == warmup:
            for r in remotes.values():
                if r.kind == "polyrl":
                    r.call("profile_start")
        k = rnd % len(jobs)
        for name, cfg in jobs[k:] + jobs[:k]:
            r = remotes[name]
            res = r.step(**cfg)
            if res is not None and rnd >= warmup:
                out[name].setdefault(config_key(cfg), []).append(res)
        if progress:
            print(
                f"  round {rnd + 1}/{total} done ({'warm-up' if rnd < warmup else 'timed'})",
                file=sys.stderr,
                flush=True,
            )
    if profile_dir:
        for name, r in remotes.items():
            if r.kind == "polyrl":
                path = str(Path(profile_dir) / f"profile-{slug(name)}.prof")
                r.call("profile_stop", path=path)
                print(f"  cProfile of {name}'s timed steps: {path}", file=sys.stderr)
    return out


def config_key(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(cfg.items())) or "default"


def slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").lower()


def close_all(remotes: dict[str, Remote]) -> None:
    for r in remotes.values():
        r.close()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--serve":
    serve(json.loads(sys.argv[2]))
