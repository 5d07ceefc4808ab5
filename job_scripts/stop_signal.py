"""The rescale (SIGUSR1) and termination (SIGTERM) requests, recorded.

Only the standard library is imported here: ``job_scripts.run`` installs the handler
before it imports JAX, Orbax or the estimator, because SIGUSR1's default action ends the
process and the daemon may send it while the runner starts up.
"""

from __future__ import annotations

import signal

# A request's strength: SIGTERM (the job ends) outranks SIGUSR1 (a rescale), here as
# across the job's processes (``Job.stop_requested`` takes their maximum).
STOP_RANK = {None: 0, "SIGUSR1": 1, "SIGTERM": 2}


class StopSignal:
    """Records SIGUSR1 (rescale) and SIGTERM; the training loop acts between steps."""

    def __init__(self):
        self.name: str | None = None

    def install(self) -> "StopSignal":
        signal.signal(signal.SIGUSR1, self._handler)
        signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum, frame):
        name = signal.Signals(signum).name
        # Never downgrade: a SIGUSR1 after a SIGTERM would turn the job's end into a
        # held requeue (exit 86).
        if STOP_RANK[name] > STOP_RANK[self.name]:
            self.name = name
