"""Stopping a run cleanly: SIGINT/SIGTERM during training (docs/distributed.md,
"Interruption and bad steps"), and data workers that must end.

Data workers ignore SIGINT/SIGTERM and end when the main process sets their
:class:`WorkerRelease`: one stuck in a read would not notice the loader's shutdown and
would keep the process from exiting.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class WorkerRelease:
    """A flag in shared memory that ends the data workers when set; not a
    ``multiprocessing.Event``, whose ``set`` would wait for ever on a worker that
    already ended with its epoch."""

    POLL_SECONDS = 0.2

    def __init__(self) -> None:
        self.flag = multiprocessing.RawValue("b", 0)

    def set(self) -> None:
        self.flag.value = 1

    def clear(self) -> None:
        self.flag.value = 0

    def is_set(self) -> bool:
        return bool(self.flag.value)


def start_data_worker(release: WorkerRelease, worker_id: int) -> None:
    """A DataLoader ``worker_init_fn``: the worker leaves SIGINT/SIGTERM to the main process
    and ends when ``release`` is set."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_when_set, args=(release,), daemon=True).start()


def _exit_when_set(release: WorkerRelease) -> None:
    while not release.is_set():
        time.sleep(release.POLL_SECONDS)
    os._exit(0)


class StopWhileWaitingForData(BaseException):
    """A stop signal that came while the only process waited for its next batch; a
    BaseException, so the data pipeline's skipping of bad samples lets it through."""


class StopSignals:
    """The stop signals of one training run; ``received``: the first, or ``None``.
    ``alone`` (one process): a signal may end a wait for data or a validation at once;
    several ranks stop after a step they agree on (others may be inside a collective)."""

    def __init__(self, alone: bool) -> None:
        self.alone = alone
        self.received: int | None = None
        self._waiting_for_data = False
        self._validating = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Handle SIGINT/SIGTERM inside (from the main thread only: elsewhere Python
        cannot install handlers); the previous handlers come back after."""
        in_main = threading.current_thread() is threading.main_thread()
        previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS} \
            if in_main else {}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle(self, signum: int, frame: Any) -> None:
        """The signal handler: remember the signal (a second SIGINT interrupts at once)."""
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        if self._waiting_for_data:
            raise StopWhileWaitingForData(signal.Signals(signum).name)
        if self._validating:
            logger.warning("received %s: stopping the validation at its next batch",
                           signal.Signals(signum).name)
        else:
            logger.warning("received %s: stopping after this step with a checkpoint",
                           signal.Signals(signum).name)

    @contextlib.contextmanager
    def validation(self) -> Iterator[Callable[[], bool] | None]:
        """Inside a validation; gives the ``stop`` it polls
        (:func:`~mmgoal.evaluation.gallery.evaluate_retrieval`): in one process, whether a
        stop signal came; ``None`` with several ranks, which must not leave its collectives
        one by one (they stop after the next step)."""
        self._validating = self.alone
        try:
            yield (lambda: self.received is not None) if self.alone else None
        finally:
            self._validating = False

    def next_batch(self, batches: Iterator[dict]) -> dict | None:
        """The next batch (None when the data ran out); in one process a stop signal that
        came before or during the wait (a stuck reader) raises StopWhileWaitingForData."""
        if self.alone and self.received is not None:  # it came inside a window's micro-step
            raise StopWhileWaitingForData(signal.Signals(self.received).name)
        self._waiting_for_data = self.alone
        try:
            return next(batches, None)
        finally:
            self._waiting_for_data = False
