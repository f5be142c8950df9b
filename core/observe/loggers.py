"""Metric loggers: where a run's metrics go besides ``metrics.jsonl``.

``run.loggers`` picks them, each behind one small interface (``log(metrics, step)``,
``close()``), and each writes under the run directory, so nothing needs a server or a
network:

- ``tensorboard``: event files in ``run.dir/tensorboard``;
- ``wandb``: an offline run in ``run.dir/wandb`` (upload it later with ``wandb sync``);
- ``mlflow``: a file store in ``run.dir/mlruns`` (browse it with
  ``mlflow ui --backend-store-uri run.dir/mlruns``).

``run.prometheus_port`` adds one more, the one that is not a file: a Prometheus endpoint
serving the last step's metrics and live figures while the run lasts
(:mod:`polyrl.core.observe.prometheus`).

The packages are imported only when a logger opens; a recipe that names one whose package
is missing fails at load (:func:`check_loggers`, :func:`~polyrl.core.observe.prometheus.check_prometheus`).
A resumed run opens a new wandb / MLflow run that continues at the checkpoint's step.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from polyrl.core.config import ConfigError
from polyrl.core.observe.prometheus import PrometheusLogger, check_prometheus

LoggerName = Literal["tensorboard", "wandb", "mlflow"]
INSTALL = "pip install 'polyrl[loggers]'"


@runtime_checkable
class MetricLogger(Protocol):
    """Receives each logged step's finite metrics."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """TensorBoard event files in ``run_dir/tensorboard``."""

    def __init__(self, run_dir: Path, name: str, config: dict | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """An offline Weights & Biases run in ``run_dir/wandb``, holding the resolved recipe
    as its config; nothing is sent until the user runs ``wandb sync``."""

    def __init__(self, run_dir: Path, name: str, config: dict | None = None) -> None:
        import wandb

        self._run = wandb.init(
            project="polyrl",
            name=name,
            dir=str(run_dir),
            mode="offline",
            config=config,
            reinit="create_new",  # several runs in one process (train, then evaluate)
            settings=wandb.Settings(console="off"),  # metrics only; stdout stays the run's
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


# MLflow accepts these characters in a metric name; others become "_".
_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")


class MLflowLogger:
    """An MLflow run in a file store at ``run_dir/mlruns`` (experiment ``polyrl``), with
    the run's ``config.yaml`` as an artifact.

    MLflow 3 keeps the file store in maintenance mode and asks for an opt-in
    (``MLFLOW_ALLOW_FILE_STORE``); we give it unless the environment says otherwise, since
    a file store needs no database or server."""

    def __init__(self, run_dir: Path, name: str, config: dict | None = None) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        experiment = self._client.get_experiment_by_name("polyrl")
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment("polyrl")
        )
        self._run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        if (run_dir / "config.yaml").is_file():
            self._client.log_artifact(self._run_id, str(run_dir / "config.yaml"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(_MLFLOW_BAD.sub("_", k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), 1000):  # MLflow takes at most 1000 metrics per batch
            self._client.log_batch(self._run_id, metrics=rows[i : i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


LOGGERS: dict[str, type] = {
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
    "mlflow": MLflowLogger,
}
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_loggers(names: Sequence[str], source: str = "<config>") -> None:
    """Fail at load, not at the first logged step: each logger named once, and its package
    installed."""
    for i, name in enumerate(names):
        if name not in LOGGERS:
            raise ConfigError(
                f"run.loggers[{i}]={name!r} in {source}: not one of {sorted(LOGGERS)}"
            )
        if name in names[:i]:
            raise ConfigError(f"run.loggers in {source} names {name!r} twice")
        if importlib.util.find_spec(MODULES[name]) is None:
            raise ConfigError(
                f"run.loggers in {source} names {name!r}, but the {MODULES[name]} package is "
                f"not installed: {INSTALL} (or remove {name!r} from run.loggers)"
            )


def open_loggers(
    names: Sequence[str],
    run_dir: Path,
    name: str,
    config: dict | None = None,
    prometheus_port: int | None = None,
) -> list[MetricLogger]:
    """One open logger per name, writing under ``run_dir``, and the Prometheus endpoint on
    ``prometheus_port`` (None: none). A logger that fails to open closes those before it."""
    check_loggers(names)
    check_prometheus(prometheus_port)
    opened: list[MetricLogger] = []
    try:
        for n in names:
            opened.append(LOGGERS[n](run_dir, name, config))
        if prometheus_port is not None:
            opened.append(PrometheusLogger(prometheus_port, name))
    except BaseException:
        for logger in opened:
            logger.close()
        raise
    return opened
