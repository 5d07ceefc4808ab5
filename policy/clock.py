"""One clock protocol for the daemon (wall time) and the simulator (simulated time).

Policies never read a clock: the caller reads ``clock.now_s()`` once per decision and puts
it in the snapshot. The simulator advances its clock explicitly from event to event; the
daemon sleeps on the wall clock until its next deadline.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """Seconds on a monotone time line, and a way to wait until a later instant."""

    def now_s(self) -> float:
        """The current time, seconds."""
        ...

    def sleep_until(self, when_s: float) -> None:
        """Return once ``now_s() >= when_s`` (at once if that is already so)."""
        ...


class WallClock:
    """Real time: seconds since the Unix epoch; sleeping really sleeps.

    Args:
        sleep: the sleeping function (``time.sleep``); a daemon passes an interruptible
            one (e.g. ``threading.Event().wait``) so SIGTERM ends a wait early.
    """

    def __init__(self, sleep=time.sleep):
        self._sleep = sleep

    def now_s(self) -> float:
        return time.time()

    def sleep_until(self, when_s: float) -> None:
        delay_s = when_s - time.time()
        if delay_s > 0:
            self._sleep(delay_s)


class SimulatedClock:
    """Simulated time, moved only by ``advance_to``/``sleep_until``; never goes back.

    Args:
        start_s: the initial time.
    """

    def __init__(self, start_s: float = 0.0):
        self._now_s = float(start_s)

    def now_s(self) -> float:
        return self._now_s

    def advance_to(self, when_s: float) -> None:
        """Jump forward to ``when_s``.

        Raises:
            ValueError: ``when_s`` is in the past.
        """
        if when_s < self._now_s:
            raise ValueError(f"simulated clock cannot go back from {self._now_s} to {when_s}")
        self._now_s = float(when_s)

    def sleep_until(self, when_s: float) -> None:
        if when_s > self._now_s:
            self._now_s = float(when_s)
