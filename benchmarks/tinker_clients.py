"""Tinker clients on one base against one server per client (issue 43).

N concurrent clients (``--clients 1 4 16``), each a LoRA adapter (rank ``--rank``) training
through the official ``tinker`` client: every step one ``forward_backward`` of ``--datums``
arithmetic SFT datums (cross-entropy) and one ``optim_step``, the N clients' calls sent at
once from N threads:

- ``shared``: ONE service holding the base once; the clients' calls that arrive together
  run as one multi-LoRA pass (``marl/tinker_api``);
- ``separate``: N services in the same process, one per client, each with its own copy of
  the base (what a one-model-per-server deployment gives).

Printed per N: datums trained per second (median of ``--steps`` timed steps after one
warm-up step), the parameter memory of the models held (base copies + adapters + Adam
moments, counted from the tensors), and the shared / separate ratios of both, measured in
the same run. Run alone, on a quiet machine:

    .venv/bin/python benchmarks/tinker_clients.py [--size 20M] [--clients 1 4 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import build_model, print_machine, set_threads  # noqa: E402

API_KEY = "tml-local"


def _datums(tok, n: int) -> list:
    from tinker import types

    out = []
    for i in range(n):
        a, b = i % 10, (3 * i + 1) % 10
        prompt = tok.encode(f"{a}+{b}=")
        full = prompt + tok.encode(str(a + b))
        w = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": w},
            )
        )
    return out


def _memory(services) -> int:
    """Bytes of every model tensor the services hold, Adam moments included."""
    total = 0
    for s in services:
        for base in s.bases.values():
            model = base.peft if base.peft is not None else base.model
            total += sum(p.numel() * p.element_size() for p in model.parameters())
        for c in s.clients.values():
            for st in c.optimizer.state.values():
                total += sum(
                    v.numel() * v.element_size() for v in st.values() if hasattr(v, "numel")
                )
    return total


def _run(trainers, data, steps: int) -> list[float]:
    from tinker import types

    walls = []
    for _ in range(steps + 1):
        barrier = threading.Barrier(len(trainers) + 1)

        def one(tc, barrier=barrier):
            barrier.wait()
            fb = tc.forward_backward(data, "cross_entropy")
            op = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            fb.result()
            op.result()

        threads = [threading.Thread(target=one, args=(tc,)) for tc in trainers]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        walls.append(time.perf_counter() - t0)
    return walls[1:]


def case(path: str, n: int, args, shared: bool) -> tuple[float, int]:
    import tinker

    from polyrl.marl.tinker_api.config import TinkerServeConfig
    from polyrl.marl.tinker_api.server import start

    tmp = tempfile.mkdtemp(prefix="tinker-bench-")
    with ExitStack() as stack:
        count = 1 if shared else n
        runs = [
            stack.enter_context(
                start(
                    TinkerServeConfig(
                        models={"base": path},
                        port=0,
                        checkpoint_dir=tmp,
                        batch_window_ms=args.window_ms,
                    )
                )
            )
            for _ in range(count)
        ]
        trainers = []
        for i in range(n):
            # entered after the servers, so each client (and its telemetry) closes first
            sc = stack.enter_context(
                tinker.ServiceClient(base_url=runs[i % count].url, api_key=API_KEY)
            )
            trainers.append(
                sc.create_lora_training_client(base_model="base", rank=args.rank, seed=i).result()
            )
        data = _datums(trainers[0].get_tokenizer(), args.datums)
        walls = _run(trainers, data, args.steps)
        mem = _memory([r.service for r in runs])
    return n * args.datums / statistics.median(walls), mem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="20M")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--datums", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--window-ms", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--model", default=None, help="a local model directory instead of --size")
    args = ap.parse_args()
    set_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per server otherwise
    print_machine(args.threads)
    path = args.model or build_model(args.size)
    print(f"model {path}; rank {args.rank}; {args.datums} datums per client step")
    print(
        f"{'N':>3} {'shared dat/s':>13} {'separate dat/s':>15} {'x thru':>7} "
        f"{'shared MiB':>11} {'separate MiB':>13} {'x mem':>6}"
    )
    for n in args.clients:
        thr_s, mem_s = case(path, n, args, shared=True)
        thr_p, mem_p = case(path, n, args, shared=False)
        print(
            f"{n:>3} {thr_s:>13.1f} {thr_p:>15.1f} {thr_s / thr_p:>7.2f} "
            f"{mem_s / 2**20:>11.1f} {mem_p / 2**20:>13.1f} {mem_p / mem_s:>6.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
