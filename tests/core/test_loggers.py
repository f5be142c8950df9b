"""run.loggers: TensorBoard, offline wandb and file-store MLflow, read back from their files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from polyrl.core.config import ConfigError, load
from polyrl.core.observe import loggers
from polyrl.core.recipe import Config
from polyrl.core.runner.run import RunDir

STEPS = [(0, {"reward/mean": 0.25, "loss": 1.5}), (2, {"reward/mean": 0.75, "kl": math.nan})]


def _log(run: RunDir) -> None:
    for step, metrics in STEPS:
        run.log(step, metrics)
    run.close()


def test_tensorboard_is_the_default_and_run_tensorboard_false_leaves_it_out(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(RunDir(tmp_path / "on"))
    events = EventAccumulator(str(tmp_path / "on" / "tensorboard"))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("reward/mean")] == [(0, 0.25), (2, 0.75)]
    assert "kl" not in events.Tags()["scalars"]  # not finite: metrics.jsonl has it as null
    _log(RunDir(tmp_path / "off", tensorboard=False, loggers=["tensorboard"]))
    assert not (tmp_path / "off" / "tensorboard").exists()
    rows = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 2] and rows[1]["kl"] is None


def _wandb_records(path: Path) -> list:
    """The records of an offline ``run-*.wandb`` file: a 7-byte header, then LevelDB-style
    log blocks of 32 KiB whose chunks (checksum, length, type) hold protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


def test_wandb_writes_an_offline_run_under_the_run_dir(tmp_path):
    wandb = pytest.importorskip(
        "wandb", reason="wandb is not installed (pip install 'polyrl[loggers]')"
    )
    _log(RunDir(tmp_path / "run", {"seed": 3}, loggers=["wandb"]))
    # wandb's service may still be writing the first run of a process when finish()
    # returns; stopping it (as interpreter exit does) completes the file.
    wandb.teardown()
    (file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(file)
    history = [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["reward/mean"]) for h in history] == [(0, 0.25), (2, 0.75)]
    assert history[0]["loss"] == 1.5 and "kl" not in history[1]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "run"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["seed"] == 3  # the resolved recipe travels with the run
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # closed cleanly


def test_mlflow_writes_a_file_store_under_the_run_dir(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'polyrl[loggers]')")
    from mlflow.tracking import MlflowClient

    run = RunDir(tmp_path / "run", {"seed": 3}, loggers=["mlflow"])
    run.log(1, {"reward/term[0]": 0.5})  # a name MLflow refuses: its odd characters -> "_"
    _log(run)
    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("polyrl").experiment_id])
    assert found.info.run_name == "run" and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (2, 0.75)]
    assert [m.value for m in client.get_metric_history(found.info.run_id, "loss")] == [1.5]
    assert client.get_metric_history(found.info.run_id, "kl") == []
    assert [m.value for m in client.get_metric_history(found.info.run_id, "reward/term_0_")] == [
        0.5
    ]
    assert [a.path for a in client.list_artifacts(found.info.run_id)] == ["config.yaml"]


def test_the_recipe_names_loggers_checked_at_load():
    cfg = load(Config, None, ["policies.main.model=m"])
    assert cfg.run.loggers == ["tensorboard"]
    with pytest.raises(ConfigError, match=r"run.loggers\[1\]='comet'.*not one of"):
        load(Config, None, ["policies.main.model=m", "run.loggers=[tensorboard, comet]"])
    with pytest.raises(ConfigError, match="names 'tensorboard' twice"):
        load(Config, None, ["policies.main.model=m", "run.loggers=[tensorboard, tensorboard]"])


def test_a_logger_whose_package_is_missing_fails_at_load_naming_the_extra(monkeypatch):
    monkeypatch.setitem(loggers.MODULES, "wandb", "polyrl_test_no_such_package")
    with pytest.raises(ConfigError) as err:
        load(Config, None, ["policies.main.model=m", "run.loggers=[wandb]"])
    msg = str(err.value)
    assert "run.loggers" in msg and "'wandb'" in msg and "pip install 'polyrl[loggers]'" in msg


def test_a_training_run_logs_to_the_loggers_its_recipe_names(make_config):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'polyrl[loggers]')")
    from mlflow.tracking import MlflowClient

    from polyrl.core.loop import train

    run = train(make_config("train.steps=2", "run.loggers=[mlflow]"))
    client = MlflowClient(tracking_uri=(run.path / "mlruns").resolve().as_uri())
    (found,) = client.search_runs([client.get_experiment_by_name("polyrl").experiment_id])
    steps = [m.step for m in client.get_metric_history(found.info.run_id, "reward/mean")]
    assert steps == [1, 2]
    assert not (run.path / "tensorboard").exists()


def test_progress_is_a_line_per_step_when_stdout_is_not_a_terminal(capsys):
    """A log file or pipe gets each step as it ends (a bar would show only at the end), and
    the last line is the final evaluation's."""
    from polyrl.core.observe.progress import Progress

    with Progress(2) as bar:
        bar.update(0, {"eval/accuracy": 0.25})
        bar.update(1, {"reward/mean": 0.5, "time/step_s": 1.5})
        bar.update(2, {"reward/mean": 0.75, "time/step_s": 2.0})
        bar.update(2, {"eval/accuracy": 0.875}, final=True)
    assert capsys.readouterr().out.splitlines() == [
        "train 0/2  reward nan  acc 0.250  eval",
        "train 1/2  reward 0.500  acc 0.250  1.50s/step",
        "train 2/2  reward 0.750  acc 0.250  2.00s/step",
        "train 2/2  reward 0.750  acc 0.875  final eval",
    ]
    with Progress(2, enabled=False) as bar:  # run.progress: false
        bar.update(1, {"reward/mean": 0.5, "time/step_s": 1.5})
    assert capsys.readouterr().out == ""
