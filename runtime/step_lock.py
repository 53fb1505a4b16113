"""The engine's state lock, fair to callers outside the loop.

The loop holds the lock for a whole step and takes it again right after. A plain lock does not
hand itself to a thread that is already waiting: the releasing thread usually re-takes it before
the woken waiter runs, so when steps hold the GIL (small models: mostly Python) a migrate_out or
suspend from another thread can wait until the engine runs out of work. Here the loop yields
between steps to every caller already waiting, so a caller waits at most one step."""

import threading
from contextlib import contextmanager


class StepLock:
    def __init__(self):
        self._lock = threading.RLock()
        self._turns = threading.Condition()
        self._waiting = 0  # callers outside the loop that want the lock

    @contextmanager
    def held(self):
        """For callers outside the loop: the lock, ahead of the loop's next step."""
        with self._turns:
            self._waiting += 1
        try:
            with self._lock:
                yield
        finally:
            with self._turns:
                self._waiting -= 1
                self._turns.notify_all()

    @contextmanager
    def step(self):
        """For the loop: the lock for one step, once every waiting caller has had its turn."""
        with self._turns:
            self._turns.wait_for(lambda: self._waiting == 0)
        with self._lock:
            yield
