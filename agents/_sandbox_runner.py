"""Runs inside the sandbox worker: installs the audit hook, then runs ``snippet.py``.

This file is executed by the sandbox's own Python (``python -I -B -c <this source>``) with
the working directory as the current directory, after the supervisor dropped privileges
and set the resource limits. It must only use the standard library. ``argv[1]`` is "1"
when the audit hook is on; ``argv[2]`` is the status channel's descriptor (``start``
before the code runs, ``done <nonce>`` once it returned) and ``argv[3]`` the pipe the
per-run nonce arrives on. A failure before the code starts exits 126 with
``sandbox setup failed`` on stderr; the supervisor trusts that only without ``start``.

The audit hook (PEP 578) refuses, with a ``PermissionError`` that names the operation:
opening files outside the working directory (reading is also allowed under the Python
installation, so imports work), changing files or directories outside it, sockets,
signals to other processes, starting processes (fork, exec, spawn, system, Popen) and
ctypes foreign calls. It is a Python-level guard that gives clear errors; the OS layers
(separate uid, namespaces, resource limits) are the boundary.
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


def _main() -> None:
    audit = len(sys.argv) > 1 and sys.argv[1] == "1"
    status_fd, nonce_fd = (int(a) for a in sys.argv[2:4]) if len(sys.argv) > 3 else (-1, -1)
    try:
        nonce = b""
        if nonce_fd >= 0:
            while chunk := os.read(nonce_fd, 64):
                nonce += chunk
            os.close(nonce_fd)  # gone before the code runs
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
    # The last statement returned (no exception, no exit): say so with the nonce, over a
    # channel an early exit, an exit status or text on stdout/stderr cannot stand in for.
    if status_fd >= 0:
        os.write(status_fd, b"done " + nonce + b"\n")


_main()
