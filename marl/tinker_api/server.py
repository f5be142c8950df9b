"""Run the service: ``polyrl serve tinker --config FILE`` (blocking), or :func:`start` in a
thread (tests, benchmarks, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from polyrl.marl.tinker_api.config import TinkerServeConfig
from polyrl.marl.tinker_api.service import Service


@dataclass
class Running:
    url: str
    service: Service


def _uvicorn(cfg: TinkerServeConfig, service: Service, sock: socket.socket):
    import uvicorn

    from polyrl.marl.tinker_api.routes import make_app

    config = uvicorn.Config(make_app(service), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    return server, lambda: server.run(sockets=[sock])


def _bind(cfg: TinkerServeConfig) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    return sock


@contextmanager
def start(cfg: TinkerServeConfig) -> Iterator[Running]:
    """The service on a free port (``cfg.port`` 0) in a background thread, stopped on exit."""
    service = Service(cfg)
    sock = _bind(cfg)
    server, run = _uvicorn(cfg, service, sock)
    thread = threading.Thread(target=run, daemon=True, name="tinker-http")
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("tinker service: the HTTP server did not start")
        time.sleep(0.01)
    host, port = sock.getsockname()[:2]
    try:
        yield Running(f"http://{host}:{port}", service)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        service.close()
        sock.close()


def serve(config: str, overrides: list[str] | None = None) -> int:
    """``polyrl serve tinker``: load the config, check the models, serve until stopped."""
    from polyrl.core.config import load

    cfg = load(TinkerServeConfig, config, overrides or [])
    service = Service(cfg)
    sock = _bind(cfg)
    server, run = _uvicorn(cfg, service, sock)
    host, port = sock.getsockname()[:2]
    print(f"tinker service on http://{host}:{port} serving {sorted(cfg.models)}", flush=True)
    print(f"  point a Tinker loop at it: ServiceClient(base_url='http://{host}:{port}')")
    try:
        run()
    finally:
        service.close()
        sock.close()
    return 0
