"""Observing a run: progress, loggers, the Prometheus endpoint, plots, the
timeline trace and its report, and throughput figures."""
