"""The engine's state lock, fair to callers outside the loop, and whole against Ctrl-C.

The loop holds the lock for a whole step and takes it again right after. A plain lock does not
hand itself to a thread that is already waiting: the releasing thread usually re-takes it before
the woken waiter runs, so when steps hold the GIL (small models: mostly Python) a migrate_out or
suspend from another thread can wait until the engine runs out of work. Here the loop yields
between steps to every caller already waiting, so a caller waits at most one step.

A KeyboardInterrupt (a notebook's stop button) raised wherever the main thread happens to be
would leave a step or a primitive half done: KV blocks taken and never given back, a sequence
with a token but no booking. While the main thread holds the lock, SIGINT is held and raised
when it lets go; a second one raises at once, for a step that will not end."""

import signal
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
            with self._lock, _interrupts_held():
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
        with self._lock, _interrupts_held():
            yield


@contextmanager
def _interrupts_held():
    """SIGINT held until the block ends, then raised as KeyboardInterrupt (unless the block
    raised). Only where Python's own handler is in place (else the application has its own
    say) and on the main thread (the only one signals reach, and can be set from)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield  # also nested: the outer block holds them
        return
    pressed = []

    def hold(signum, frame):
        if pressed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        pressed.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt
