"""The example scripts of ``examples/``, loaded for the tests that drive them."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    """``examples/<name>.py`` loaded by file path, as module ``polyrl_example_<name>`` (a
    name no test or library uses), once per process; sys.path is left alone."""
    module_name = f"polyrl_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


@contextlib.contextmanager
def example_for_spawned_workers(name: str):
    """``examples/<name>.py`` imported under its own name while the block runs, for an
    example that hands its functions to spawned worker processes (ProcessPoolExecutor with
    the spawn context). Those workers import the functions by module name, with the parent's
    sys.path copied to them, so examples/ is on sys.path for the block and removed after;
    this is the one place a test does so."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))
