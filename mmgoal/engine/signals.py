"""Stopping a run cleanly: SIGINT/SIGTERM during training, and data workers that must end.

SIGINT/SIGTERM on any rank stop every rank after the same step, with a checkpoint
(the trainer asks :attr:`StopSignals.received` once a step, in one agreement of
all ranks); a second SIGINT stops at once. In one process, a signal that comes
while the trainer waits for data (a reader may be stuck) stops it there:
:class:`StopWhileWaitingForData` leaves the wait, and the trainer checkpoints the
steps done; one that comes during a validation ends it at its next batch
(:meth:`StopSignals.validation`), and the trainer checkpoints the state before it, which
``--resume`` validates again. Several ranks finish a validation, a collective, before
they stop.

Data workers ignore SIGINT/SIGTERM (the main process stops cleanly) and end when
the main process sets their :class:`WorkerRelease`: one stuck in a read would sit
out the loader's shutdown, which it cannot notice, and keep the process from exiting.
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
    """A flag in shared memory that ends the data workers when set (:func:`start_data_worker`).

    Not a ``multiprocessing.Event``: its ``set`` waits for every process blocked in
    ``wait`` to acknowledge, and a worker that ended with its epoch never does, so
    ``set`` would block for ever. Workers poll this flag instead.
    """

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
    and ends when ``release`` is set (see the module docstring)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_when_set, args=(release,), daemon=True).start()


def _exit_when_set(release: WorkerRelease) -> None:
    while not release.is_set():
        time.sleep(release.POLL_SECONDS)
    os._exit(0)


class StopWhileWaitingForData(BaseException):
    """A stop signal that came while the only process waited for its next batch.

    A BaseException, like KeyboardInterrupt: the data pipeline, which skips any
    Exception of a sample as a bad sample, must let it through.
    """


class StopSignals:
    """The stop signals of one training run (see the module docstring).

    Args:
        alone: the run is one process, so a signal may end a wait for data there and
            then (several ranks stop after a step they agree on, since the others may
            be inside a collective).

    Attributes:
        received: the first stop signal received, or ``None``.
    """

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
        """The next batch (None when the data ran out). In one process a stop signal ends
        the wait, which may never end otherwise (a stuck reader).

        Raises:
            StopWhileWaitingForData: in one process, a stop signal came before or
                during the wait.
        """
        if self.alone and self.received is not None:  # it came inside a window's micro-step
            raise StopWhileWaitingForData(signal.Signals(self.received).name)
        self._waiting_for_data = self.alone
        try:
            return next(batches, None)
        finally:
            self._waiting_for_data = False
