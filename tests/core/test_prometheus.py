"""The Prometheus endpoint (run.prometheus_port): scraped over HTTP while a real run
trains, parsed with prometheus_client's own parser, and compared with metrics.jsonl."""

from __future__ import annotations

import socket
import sys
import threading
import urllib.error
import urllib.request

import pytest

from polyrl.core.config import ConfigError, UserError
from polyrl.core.loop import train
from polyrl.core.observe import timeline
from polyrl.core.observe.prometheus import metric_name
from tests.helpers.prometheus import most, scrape, train_scraping
from tests.helpers.runs import metrics

pytest.importorskip("prometheus_client")


def test_metric_names_follow_the_prometheus_rules():
    assert metric_name("reward/mean") == "polyrl_reward_mean"
    assert metric_name("perf/main/mfu") == "polyrl_perf_main_mfu"
    assert metric_name("eval/pass@4") == "polyrl_eval_pass_4"
    assert metric_name("a:b-c.d e") == "polyrl_a_b_c_d_e"


def test_keys_that_share_a_name_are_told_apart_by_a_label():
    from polyrl.core.observe.prometheus import PrometheusLogger

    logger = PrometheusLogger(0, "labels")
    try:
        logger.log({"a/b": 1.0, "a.b": 2.0, "reward/mean": 0.5}, step=3)
        logger.log({"reward/mean": 0.25}, step=4)  # a.b, a/b keep their last values
        got = scrape(logger.port)
        with pytest.raises(ValueError, match="polyrl_engine_busy_seconds_total"):
            logger.log({"engine/busy_seconds_total": 1.0}, step=5)  # a live figure's name
    finally:
        logger.close()
    assert got[("polyrl_a_b", (("key", "a/b"),))] == 1.0
    assert got[("polyrl_a_b", (("key", "a.b"),))] == 2.0
    assert got[("polyrl_reward_mean", ())] == 0.25 and got[("polyrl_step", ())] == 4
    with pytest.raises(urllib.error.URLError):
        scrape(logger.port)


def test_the_endpoint_serves_each_steps_metrics_during_a_run(make_config, one_thread, capsys):
    cfg = make_config(
        "train.steps=4",
        "run.export=false",
        "run.prometheus_port=0",
        "rollout.max_staleness=1",  # the async producer: its queue is served too
    )
    before = set(threading.enumerate())
    _, port, scrapes = train_scraping(cfg, capsys)

    rows = metrics(cfg.run.dir)
    trained = {r["step"]: r for r in rows if "time/step_s" in r}
    assert sorted(trained) == [1, 2, 3, 4]
    # steps 1-3 log one row each (step 4 adds the final evaluation): a scrape taken while
    # step s was the last logged holds that row's every finite value, exactly
    checked = 0
    for got in scrapes:
        step = got.get(("polyrl_step", ()))
        if step is None or not 1 <= step <= 3:
            continue
        for key, value in trained[int(step)].items():
            if key in ("step", "time") or value is None:
                continue
            assert got[(metric_name(key), ())] == value, key
        checked += 1
    assert checked > 0, "no scrape fell between two training steps"

    # the live figures, each at its highest over the run's scrapes (counters only grow)
    main = ("engine", "main")
    assert most(scrapes, "polyrl_engine_calls_total", main) >= 4  # a batch a step, and evaluations
    assert most(scrapes, "polyrl_engine_tokens_total", main) > 0
    assert most(scrapes, "polyrl_engine_busy_share", main) > 0
    assert most(scrapes, "polyrl_span_seconds_total", ("span", "update")) > 0
    assert most(scrapes, "polyrl_span_seconds_total", ("span", "wait_rollout")) > 0
    assert most(scrapes, "polyrl_async_queued_batches") in (0, 1, 2)  # k=1: at most one ahead
    assert most(scrapes, "polyrl_async_ready_batch_staleness") in (0, 1)

    # the run closed the endpoint: the port refuses, no thread or span watcher is left
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert timeline._WATCHERS == ()


def test_without_the_package_or_with_a_bad_port_it_is_a_clear_error(make_config, monkeypatch):
    with pytest.raises(ConfigError, match=r"run\.prometheus_port=70000 .*TCP port 1-65535"):
        make_config("run.prometheus_port=70000")
    with pytest.raises(ConfigError, match=r"run\.prometheus_port=-1 "):
        make_config("run.prometheus_port=-1")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "prometheus_client", None)  # as if it were not installed
        with pytest.raises(ConfigError, match=r"prometheus_client package is not installed"):
            make_config("run.prometheus_port=9400")
    make_config("run.prometheus_port=null")  # off: fine without a port
    # a port another process holds: said when the run opens, before any model loads
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = make_config(f"run.prometheus_port={port}", "run.export=false")
        with pytest.raises(UserError, match=rf"run\.prometheus_port={port}: cannot listen"):
            train(cfg)
    assert timeline._WATCHERS == ()
