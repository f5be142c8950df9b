"""Reading a run's trace files back the way a viewer does, for the timeline tests.

The files are checked against the Chrome Trace Event format (the JSON array format of
the "Trace Event Format" document that Perfetto and chrome://tracing read) with
``jsonschema``, parsed with ``json`` line by line, and each complete event is given the
span that encloses it on its thread (how the viewers draw nesting). Perfetto's own reading
of the same files is ``tests/helpers/perfetto.py``."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

# What the format asks of the events PolyRL writes: complete ("X"), instant ("i") and
# metadata ("M") events; ids are integers, times microseconds.
EVENT_SCHEMA = {
    "type": "object",
    "required": ["ph", "name", "pid", "tid"],
    "properties": {
        "ph": {"enum": ["X", "i", "M"]},
        "name": {"type": "string", "minLength": 1},
        "pid": {"type": "integer"},
        "tid": {"type": "integer"},
        "ts": {"type": "number"},
        "dur": {"type": "number", "minimum": 0},
        "s": {"enum": ["t", "p", "g"]},
        "args": {"type": "object"},
    },
    "allOf": [
        {"if": {"properties": {"ph": {"const": "X"}}}, "then": {"required": ["ts", "dur"]}},
        {"if": {"properties": {"ph": {"const": "i"}}}, "then": {"required": ["ts"]}},
        {
            "if": {"properties": {"ph": {"const": "M"}}},
            "then": {
                "properties": {"name": {"enum": ["process_name", "thread_name"]}},
                "required": ["args"],
            },
        },
    ],
}
TRACE_SCHEMA = {"type": "array", "items": EVENT_SCHEMA}


def load_checked(path: Path) -> list[dict]:
    """A trace file's events, the file closed as a viewer closes it (the last ``,`` and a
    missing ``]``) and checked against the schema as one JSON document."""
    text = Path(path).read_text().rstrip()
    assert text.startswith("["), path
    events = json.loads(text.rstrip(",") + ("" if text.endswith("]") else "\n]"))
    jsonschema.validate(events, TRACE_SCHEMA)
    return events


def run_events(run_dir: Path) -> list[dict]:
    """Every trace file of a run, checked; their complete events."""
    files = sorted((Path(run_dir) / "trace").glob("*.json"))
    assert files, f"no trace files in {run_dir}/trace"
    return [e for f in files for e in load_checked(f) if e["ph"] == "X"]


def parents(events: list[dict]) -> list[tuple[dict, dict | None]]:
    """(span, the innermost span enclosing it on its thread, or None) for each span."""
    out = []
    for e in events:
        around = [
            p
            for p in events
            if p is not e
            and (p["pid"], p["tid"]) == (e["pid"], e["tid"])
            and p["ts"] <= e["ts"]
            and e["ts"] + e["dur"] <= p["ts"] + p["dur"]
            and p["dur"] >= e["dur"]
        ]
        out.append((e, min(around, key=lambda p: p["dur"]) if around else None))
    return out


def nesting(events: list[dict]) -> set[tuple[str, str | None]]:
    """The (span name, enclosing span name) pairs of a run."""
    return {(e["name"], p["name"] if p else None) for e, p in parents(events)}
