"""The daemon's forecast, computed in a thread beside the rounds."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from slurm_ext.observe import kv

log = logging.getLogger("slurm_ext.daemon")


class BackgroundForecast:
    """One forecast at a time, computed in a thread; a round takes the last one finished.

    A forecast over thousands of queued jobs takes seconds (``benchmarks/forecast_speed.py``):
    it must not hold up a round. The policy's ``decide`` is pure, so the thread may call it
    while rounds go on.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._result: dict | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, compute: Callable[[], dict]) -> None:
        def run():
            try:
                result = compute()
            except Exception as e:  # a forecast that fails must not stop the service
                log.exception(kv("forecast_failed", error=repr(e)))
                return
            with self._lock:
                self._result = result
        self._thread = threading.Thread(target=run, name="forecast", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> None:
        """Until the forecast under way is done (tests; a stopping daemon does not wait)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def take(self) -> dict | None:
        """The last forecast finished and not taken yet, or None."""
        with self._lock:
            result, self._result = self._result, None
        return result
