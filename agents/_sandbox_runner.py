"""Runs inside a sandbox worker: the model's code, or the checks of a ``unit_tests`` row.

This file is executed by the sandbox's own Python (``python -I -B -c <this source>``) with
the working directory as the current directory, after the supervisor dropped privileges
and set the resource limits. It must only use the standard library. ``argv``: the audit
hook flag ("1": on), the status channel's descriptor, the descriptor the nonce (``run``)
or the checks (``check``) arrive on, the mode, and for ``serve``/``check`` the request and
reply descriptors that connect the two processes of a tests run. A failure before the
code starts exits 126 with ``sandbox setup failed`` on stderr; the supervisor trusts that
only without ``start`` on the status channel.

Modes:

- ``run``: run ``snippet.py``; ``done <nonce>`` on the status channel once it returned.
- ``serve`` (the candidate process of a tests run): run ``snippet.py`` (the response),
  then answer requests for its names and calls. Every result goes back as plain data
  (:func:`encode`: exact builtin types only, numpy values through ``tolist()``);
  anything else is refused.
- ``check`` (the checker process): no model code runs here. It makes itself
  non-dumpable (no process of its uid may read its memory or descriptors), reads the
  row's checks and the nonce from its pipe, runs them with every name they do not define
  (nor builtins) looked up in the candidate process, decodes each reply into fresh
  builtins (:func:`decode`: whatever bytes arrive, the checks compare plain data, never
  an object of the candidate's), and writes ``done <nonce>`` after the last check
  returned.

The audit hook (PEP 578, ``run``/``serve``) refuses, with a ``PermissionError`` that names
the operation: opening files outside the working directory (reading is also allowed under
the Python installation, so imports work), changing files or directories outside it,
sockets, signals to other processes, starting processes (fork, exec, spawn, system, Popen)
and ctypes foreign calls. It is a Python-level guard that gives clear errors; the OS
layers (separate uid, namespaces, seccomp, resource limits) are the boundary.
"""

import os
import sys


def _install(work: str) -> None:
    real = os.path.realpath
    work = real(work)
    read_roots = {work}
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path):
        if p and os.path.isdir(p):
            read_roots.add(real(p))
    read_roots.update({"/dev/null", "/dev/urandom", "/dev/zero"})
    roots = tuple(sorted(read_roots))
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked = (
        "socket.",
        "os.kill",
        "os.killpg",
        "signal.pthread_kill",
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
        "pty.spawn",
        "os.startfile",
        "webbrowser.open",
    )
    path_events_write = {
        "os.remove": 1,
        "os.rmdir": 1,
        "os.rename": 2,
        "os.replace": 2,
        "os.mkdir": 1,
        "os.chmod": 1,
        "os.chown": 1,
        "os.link": 2,
        "os.symlink": 2,
        "os.truncate": 1,
        "os.utime": 1,
        "os.chflags": 1,
        "os.lchflags": 1,
        "os.lchmod": 1,
        "os.setxattr": 1,
        "os.removexattr": 1,
        "shutil.rmtree": 1,
        "shutil.copyfile": 2,
        "shutil.copytree": 2,
        "shutil.move": 2,
        "shutil.chown": 1,
        "shutil.make_archive": 1,
        "shutil.unpack_archive": 2,
    }
    path_events_read = {
        "os.listdir": 1,
        "os.scandir": 1,
        "os.chdir": 1,
        "os.getxattr": 1,
        "os.listxattr": 1,
        "glob.glob": 1,
    }
    deny = PermissionError

    def inside(path, allowed) -> bool:
        if isinstance(path, int):  # an already-open descriptor
            return True
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            path = os.fspath(path)
        p = real(path)
        return any(p == r or p.startswith(r.rstrip("/") + "/") for r in allowed)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            if path is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writing and not inside(path, (work,)):
                raise deny(
                    f"sandbox: writing {path!r} is not allowed outside the working directory"
                )
            if not writing and not inside(path, roots):
                raise deny(
                    f"sandbox: reading {path!r} is not allowed outside the working directory"
                )
            return
        if event.startswith("ctypes."):
            if event == "ctypes.dlopen" and args and args[0] is None:
                return  # ctypes' own import opens the running process
            if event in ("ctypes.addressof",):
                return
            raise deny(f"sandbox: {event} (ctypes foreign calls) is not allowed")
        if event.startswith(blocked):
            raise deny(f"sandbox: {event} is not allowed (no network, processes or signals)")
        if event in path_events_write:
            for path in args[: path_events_write[event]]:
                if path is not None and not inside(path, (work,)):
                    raise deny(
                        f"sandbox: {event} on {path!r} is not allowed outside the working directory"
                    )
            return
        if event in path_events_read and args and args[0] is not None:
            target = args[0]
            if not inside(target, roots if event != "os.chdir" else (work,)):
                raise deny(
                    f"sandbox: {event} on {target!r} is not allowed outside the working directory"
                )

    sys.addaudithook(hook)
    _remove_unaudited()


# Calls that reach other processes without raising an audit event (CPython 3.10-3.13):
# pidfds signal any process of the same uid, and fork_exec is what subprocess runs
# underneath its audited Popen. Replaced in the C modules too, so reloading os, signal or
# subprocess does not bring them back.
UNAUDITED = {
    "posix": ("pidfd_open",),
    "os": ("pidfd_open",),
    "_signal": ("pidfd_send_signal",),
    "signal": ("pidfd_send_signal",),
    "_posixsubprocess": ("fork_exec",),
}


def _remove_unaudited() -> None:
    import importlib

    for module_name, names in UNAUDITED.items():
        module = importlib.import_module(module_name)
        for name in names:
            if hasattr(module, name):
                setattr(module, name, _denied(f"{module_name}.{name}"))


def _denied(what: str):
    def refuse(*args, **kwargs):
        raise PermissionError(f"sandbox: {what} is not allowed (no network, processes or signals)")

    return refuse


# Plain data between the two processes of a tests run: JSON, with one-key tags for what
# JSON lacks. Exact builtin types only: a subclass could carry an ``__eq__`` of its own.
MAX_DEPTH = 64
MAX_MESSAGE = 8 * 2**20  # bytes of one request or reply line
PLAIN = "None, bool, int, float, complex, str, bytes, or lists, tuples, dicts and sets of them"


def _walk(value, depth: int, convert, rest, too_deep: str):
    """The walk :func:`encode` and :func:`decode` share: the depth bound, scalars kept as they
    are, lists item by item through ``convert``; ``rest(value, kind, depth)`` takes the rest."""
    if depth > MAX_DEPTH:
        raise ValueError(f"a value nested deeper than {MAX_DEPTH} levels{too_deep}")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [convert(v, depth + 1) for v in value]
    return rest(value, kind, depth)


def encode(value, depth: int = 0):
    """``value`` as JSON-ready plain data; anything but exact builtins raises TypeError."""
    return _walk(value, depth, encode, _encode_tagged, " cannot be sent")


def _encode_tagged(value, kind: type, depth: int):
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [encode(v, depth + 1) for v in value]}
    if kind is dict:
        return {"dict": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    if getattr(kind, "__module__", None) == "numpy" and hasattr(value, "tolist"):
        # numpy scalars and arrays, as their plain equivalents (this runs in the code's
        # process, which could convert them itself: the checker still sees plain data)
        return encode(value.tolist(), depth + 1)
    raise TypeError(f"a {kind.__name__} is not plain data ({PLAIN})")


def decode(data, depth: int = 0):
    """Fresh builtins from what :func:`encode` made; anything else raises ValueError."""
    return _walk(data, depth, decode, _decode_tagged, "")


def _decode_tagged(data, kind: type, depth: int):
    if kind is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag in ("tuple", "set", "frozenset") and type(body) is list:
            make = {"tuple": tuple, "set": set, "frozenset": frozenset}[tag]
            return make([decode(v, depth + 1) for v in body])
        pairs = tag == "dict" and type(body) is list
        if pairs and all(type(p) is list and len(p) == 2 for p in body):
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        two = tag == "complex" and type(body) is list and len(body) == 2
        if two and all(type(x) in (int, float) for x in body):
            return complex(body[0], body[1])
    raise ValueError("the reply is not plain data")


def _send(fd: int, message: dict) -> None:
    import json

    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(fd, data) :]


def _text(e: BaseException) -> str:
    try:
        return str(e)[:2000]
    except BaseException:
        return "(its message could not be read)"


def _serve(scope: dict, req_fd: int, rep_fd: int) -> None:
    """The candidate process: answer the checker's lookups and calls until it hangs up."""
    import contextlib
    import json

    requests = os.fdopen(req_fd, "rb", buffering=65536)
    while line := requests.readline(MAX_MESSAGE):
        try:
            req = json.loads(line)
            name = req["name"]
            if req["op"] == "get":
                if name not in scope:
                    reply = {"missing": True}
                elif callable(scope[name]):
                    reply = {"callable": True}
                else:
                    reply = {"value": encode(scope[name])}
            else:
                args, kwargs = decode(req["args"]), decode(req["kwargs"])
                reply = {"value": encode(scope[name](*args, **kwargs))}
        except BaseException as e:  # the code's error (any kind) is the checker's to judge
            reply = {"error": [type(e).__name__, _text(e)]}
        for stream in (sys.stdout, sys.stderr):  # the process may be killed once answered
            with contextlib.suppress(BaseException):
                stream.flush()
        try:
            _send(rep_fd, reply)
        except (TypeError, ValueError) as e:  # e.g. a float the JSON encoder refuses
            _send(rep_fd, {"error": ["TypeError", _text(e)]})


class _Candidate:
    """The checker's end of the two pipes to the candidate process."""

    def __init__(self, req_fd: int, rep_fd: int, status_fd: int) -> None:
        self.req_fd, self.status_fd = req_fd, status_fd
        self.replies = os.fdopen(rep_fd, "rb", buffering=65536)

    def ask(self, message: dict, answers: tuple = ()) -> tuple:
        """Send one request; ("value", the reply's value decoded), (kind, None) for a kind
        in ``answers``, or the code's exception raised here."""
        import json

        _send(self.req_fd, message)
        line = self.replies.readline(MAX_MESSAGE + 1)
        if not line.endswith(b"\n"):
            raise RuntimeError(
                "the candidate's process ended (it exited or was stopped) before answering"
                if len(line) <= MAX_MESSAGE
                else f"the candidate's reply is longer than {MAX_MESSAGE} bytes"
            )
        reply = json.loads(line)
        if type(reply) is not dict or len(reply) != 1:
            raise ValueError("the candidate's reply is malformed")
        ((kind, body),) = reply.items()
        if kind == "value":
            return kind, decode(body)
        if kind in answers and body is True:
            return kind, None
        two = kind == "error" and type(body) is list and len(body) == 2
        if two and all(type(x) is str for x in body):
            raise _exception(body[0])(f"{body[1]} (raised in the candidate's code)")
        raise ValueError("the candidate's reply is malformed")

    def lookup(self, name: str):
        kind, value = self.ask({"op": "get", "name": name}, ("missing", "callable"))
        if kind == "missing":
            raise KeyError(name)
        return _Function(self, name) if kind == "callable" else value

    def call(self, name: str, args: tuple, kwargs: dict):
        try:
            sent = {"op": "call", "name": name, "args": encode(list(args))}
            sent["kwargs"] = encode(dict(kwargs))
        except TypeError as e:  # a lambda, an object: only the row's own checks make those
            msg = f"an argument to {name}() cannot be sent to the candidate's process: {e}"
            os.write(self.status_fd, f"harness {msg}\n".encode())
            raise TypeError(msg) from None
        except Exception as e:
            # too deep (a wrong answer's own value fed back) or any other failure to send:
            # values the candidate shaped, so the check fails (0), the row is not dropped
            raise ValueError(f"an argument to {name}() cannot be sent: {e}") from None
        return self.ask(sent)[1]


def _exception(name: str) -> type:
    """A builtin exception the candidate named, so checks that expect one still work;
    never one that ends an iteration (``all(map(candidate, xs))`` would pass)."""
    import builtins

    cls = getattr(builtins, name, None)
    if (
        isinstance(cls, type)
        and issubclass(cls, Exception)
        and not issubclass(cls, (StopIteration, StopAsyncIteration))
    ):
        return cls
    return RuntimeError


class _Function:
    """A function of the candidate's: calling it runs it in the candidate's process."""

    __slots__ = ("_candidate", "__name__")

    def __init__(self, candidate: _Candidate, name: str) -> None:
        self._candidate, self.__name__ = candidate, name

    def __call__(self, *args, **kwargs):
        return self._candidate.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<the candidate's {self.__name__}>"


class _Checks(dict):
    """The checks' globals: a name they neither define nor find in builtins is looked up
    in the candidate's process (its functions become :class:`_Function`, its other values
    are copied as plain data). Builtins come first: the candidate cannot replace them."""

    def __init__(self, candidate: _Candidate) -> None:
        import builtins

        super().__init__(__builtins__=builtins, __name__="__main__")
        self._candidate, self._builtins = candidate, vars(builtins)

    def __missing__(self, name: str):
        if name in self._builtins or name.startswith("__"):
            raise KeyError(name)
        return self._candidate.lookup(name)


# Comparisons in the row's checks see each operand through this (a name the checks do not
# use): a NaN makes every comparison false, so ``assert not abs(a - b) > tol`` would pass.
GUARD = "__polyrl_comparable__"


class NotComparable(BaseException):
    """A comparison in the checks met a NaN. Not an ``Exception``: a check's own
    ``except Exception`` (or ``except ValueError``) cannot turn it into a pass."""


def _comparable(value):
    """``value`` unless it is or holds a NaN (float or complex): then the comparison, and
    so the check, fails. Infinities stay: they order as IEEE says, so they satisfy no
    tolerance against a finite value (and ``inf - inf`` is a NaN, refused here)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        kind = type(v)
        if str(getattr(kind, "__module__", "")).split(".")[0] == "numpy":
            # arrays and scalars the checks built with numpy: NaN anywhere in them
            nan = getattr(v, "dtype", None) is not None and v.dtype.kind in "fc"
            if nan and bool((v != v).any()):
                raise NotComparable("a NaN cannot satisfy a check (a value compared holds NaN)")
        elif isinstance(v, (float, complex)):
            if v != v:
                raise NotComparable("a NaN cannot satisfy a check (a value compared is NaN)")
        elif kind in (list, tuple, set, frozenset, dict) and id(v) not in seen:
            seen.add(id(v))
            stack.extend(v.items() if kind is dict else v)
    return value


def _guarded(source: str):
    """The checks' syntax tree with every comparison's operands passed through
    :func:`_comparable` (``is``/``is not`` and the container of ``in`` excepted).
    Chains, evaluation order and short-circuiting are those of the source."""
    import ast

    class Guard(ast.NodeTransformer):
        def visit_Compare(self, node: ast.Compare) -> ast.AST:
            self.generic_visit(node)
            if all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                return node

            def wrap(operand: ast.expr) -> ast.expr:
                call = ast.Call(ast.Name(GUARD, ast.Load()), [operand], [])
                return ast.copy_location(call, operand)

            node.left = wrap(node.left)
            node.comparators = [
                c if isinstance(op, (ast.In, ast.NotIn)) else wrap(c)
                for op, c in zip(node.ops, node.comparators, strict=True)
            ]
            return node

    tree = Guard().visit(ast.parse(source, "checks"))
    return ast.fix_missing_locations(tree)


def _check(status_fd: int, tests_fd: int, req_fd: int, rep_fd: int) -> None:
    """The checker process: runs the row's checks; ``done <nonce>`` once they returned."""
    import json

    try:
        import ctypes

        # non-dumpable: a process of the same uid can neither ptrace this one nor open its
        # /proc/<pid>/mem, fd or environ (the checks are read only after this)
        if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
        data = b""
        while chunk := os.read(tests_fd, 65536):
            data += chunk
        os.close(tests_fd)
        payload = json.loads(data)
        nonce = payload["nonce"].encode()
        entry = payload["entry_point"]
        if entry and not entry.isidentifier():
            raise ValueError(f"the entry point {entry!r} is not a Python name")
        scope = _Checks(_Candidate(req_fd, rep_fd, status_fd))
        os.write(status_fd, b"start\n")
    except BaseException as e:
        os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(126)
    try:
        exec(compile(payload["preamble"], "preamble", "exec"), scope)
        scope[GUARD] = _comparable
        exec(compile(_guarded(payload["source"]), "checks", "exec"), scope)
        if entry:
            check = dict.get(scope, "check")  # the checks' own, never a lookup in the code
            if not callable(check):
                msg = f"the row names the entry point {entry!r} but its tests define no check()"
                os.write(status_fd, f"harness {msg}\n".encode())
                raise NameError(msg)
            # the candidate's own definition, never a builtin of the same name (``sorted``)
            try:
                candidate = scope._candidate.lookup(entry)
            except KeyError:
                raise NameError(
                    f"the response defines no {entry!r}: the function this row's checks call "
                    "(its entry point)"
                ) from None
            check(candidate)
    except BaseException as e:
        import traceback

        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, tb)
        sys.stderr.flush()
        os._exit(1)
    os.write(status_fd, b"done " + nonce + b"\n")


def _main() -> None:
    audit = len(sys.argv) > 1 and sys.argv[1] == "1"
    status_fd, pipe_fd = (int(a) for a in sys.argv[2:4]) if len(sys.argv) > 3 else (-1, -1)
    mode = sys.argv[4] if len(sys.argv) > 4 else "run"
    req_fd, rep_fd = (int(a) for a in sys.argv[5:7]) if len(sys.argv) > 6 else (-1, -1)
    if mode == "check":
        _check(status_fd, pipe_fd, req_fd, rep_fd)
        return
    try:
        nonce = b""
        if pipe_fd >= 0:
            while chunk := os.read(pipe_fd, 64):
                nonce += chunk
            os.close(pipe_fd)  # gone before the code runs
        work = os.getcwd()
        with open(os.path.join(work, "snippet.py"), encoding="utf-8") as f:
            source = f.read()
        if audit:
            _install(work)
        if status_fd >= 0:
            os.write(status_fd, b"start\n")
    except BaseException as e:  # the sandbox's own failure, not the code's
        os.write(2, f"sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(126)
    scope = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "snippet.py"}
    try:
        exec(compile(source, "snippet.py", "exec"), scope)
    except SystemExit:
        raise
    except BaseException as e:  # the user's error: print it without this runner's frame
        import traceback

        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        traceback.print_exception(type(e), e, tb)
        sys.stderr.flush()
        sys.exit(1)
    if mode == "serve":  # the candidate of a tests run: its checks run elsewhere
        _serve(scope, req_fd, rep_fd)
        return
    # The last statement returned (no exception, no exit): say so with the nonce, over a
    # channel an early exit, an exit status or text on stdout/stderr cannot stand in for.
    if status_fd >= 0:
        os.write(status_fd, b"done " + nonce + b"\n")


_main()
