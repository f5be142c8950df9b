"""A run's Prometheus endpoint scraped while it trains (run.prometheus_port=0)."""

from __future__ import annotations

import re
import threading
import time
import urllib.error
import urllib.request
from typing import Any

Samples = dict[tuple[str, tuple], float]


def scrape(port: int) -> Samples:
    """(sample name, sorted labels) -> value, from one GET of /metrics, read with
    prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def train_scraping(cfg: Any, capsys: Any) -> tuple[Any, int, list[Samples]]:
    """``train(cfg)`` in a thread, its endpoint scraped every 20 ms from the port it prints
    until the run closes it: (run dir, port, the scrapes in order)."""
    from polyrl.core.loop import train

    done: list = []

    def run() -> None:
        try:
            done.append(train(cfg))
        except BaseException as e:  # raised below, in the test's thread
            done.append(e)

    trainer = threading.Thread(target=run)
    trainer.start()
    port, scrapes = None, []
    while trainer.is_alive():
        if port is None:
            found = re.search(r"prometheus: .*:(\d+)/metrics", capsys.readouterr().out)
            port = int(found[1]) if found else None
        else:
            try:
                scrapes.append(scrape(port))
            except (urllib.error.URLError, ConnectionError):  # the run has just closed it
                break
        time.sleep(0.02)
    trainer.join()
    if isinstance(done[0], BaseException):
        raise done[0]
    assert port is not None, "the endpoint's port was not printed"
    return done[0], port, scrapes


def most(scrapes: list[Samples], name: str, *labels: tuple[str, str]) -> float:
    """A figure at its highest over the scrapes (a counter's last value)."""
    return max(got.get((name, labels), float("-inf")) for got in scrapes)
