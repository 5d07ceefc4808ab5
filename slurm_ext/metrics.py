"""Prometheus metrics of the daemon (optional: needs the prometheus_client package).

Exposed on ``metrics_port`` when configured:

- ``slurm_ext_round_seconds`` (histogram): wall time of one observe → decide → act round.
- ``slurm_ext_rounds_total{outcome}``: rounds by outcome (``ok``, ``slurm_error``, ``error``).
- ``slurm_ext_decisions_total``: policy decisions taken.
- ``slurm_ext_actions_total{kind}``: actions applied (start, rescale, suspend, release, ...).
- ``slurm_ext_errors_total{kind}``: errors by kind (spec, slurm, policy, action, round:
  a round that failed otherwise).
- ``slurm_ext_jobs{kind}`` (gauge): jobs seen in the last round (``active``: every job
  Slurm lists as queued or running, ``elastic``: those with an elastic Comment,
  ``managed``: those the policy was given).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class Metrics:
    """Counters and timings; every method is a no-op without prometheus_client or a port.

    Args:
        port: TCP port of the /metrics endpoint, or None for no endpoint.
        address: the IP address it listens on (0.0.0.0: every interface).
    """

    def __init__(self, port: int | None = None, address: str = "0.0.0.0"):
        self.enabled = False
        if port is None:
            return
        try:
            import prometheus_client as prom
        except ImportError:
            log.warning("event=metrics_disabled reason=prometheus_client_not_installed "
                        "fix='pip install prometheus-client'")
            return
        registry = prom.CollectorRegistry()
        self._round_s = prom.Histogram("slurm_ext_round_seconds", "Wall time of one round",
                                       registry=registry,
                                       buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60))
        self._rounds = prom.Counter("slurm_ext_rounds", "Rounds by outcome", ["outcome"], registry=registry)
        self._decisions = prom.Counter("slurm_ext_decisions", "Policy decisions", registry=registry)
        self._actions = prom.Counter("slurm_ext_actions", "Actions applied", ["kind"], registry=registry)
        self._errors = prom.Counter("slurm_ext_errors", "Errors by kind", ["kind"], registry=registry)
        self._jobs = prom.Gauge("slurm_ext_jobs", "Jobs seen in the last round", ["kind"], registry=registry)
        try:
            prom.start_http_server(port, addr=address, registry=registry)
        except OSError as e:  # the port is taken: scheduling matters more than its metrics
            log.warning("event=metrics_disabled reason=cannot_listen address=%s port=%d error=%r", address, port,
                        str(e))
            return
        self.enabled = True
        log.info("event=metrics_listening address=%s port=%d", address, port)

    def round_done(self, seconds: float, outcome: str) -> None:
        if self.enabled:
            self._round_s.observe(seconds)
            self._rounds.labels(outcome).inc()

    def decision(self) -> None:
        if self.enabled:
            self._decisions.inc()

    def action(self, kind: str) -> None:
        if self.enabled:
            self._actions.labels(kind).inc()

    def error(self, kind: str) -> None:
        if self.enabled:
            self._errors.labels(kind).inc()

    def jobs(self, counts: dict[str, int]) -> None:
        if self.enabled:
            for kind, n in counts.items():
                self._jobs.labels(kind).set(n)
