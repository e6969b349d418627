"""Critical sections that a Ctrl-C cannot split.

The engine's device state and host records must change together: a step's donated arena and
the record that its outputs are pending, a compaction copy and the acknowledgement of its
moves, the host commit of a step's outputs. Inside `critical()` a SIGINT is held back and
raised as KeyboardInterrupt when the section ends, so it lands before or after the section,
never inside. Only the main thread receives signals; elsewhere `critical()` does nothing.
"""

from __future__ import annotations

import _signal  # signal.signal without its enum wrapping: a swap and restore ~0.5 us against ~8 (~9 sections a step)
import contextlib
import signal
import threading


@contextlib.contextmanager
def critical():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def hold(signum, frame):  # noqa: ARG001 - the signal handler signature
        received.append(signum)

    try:
        previous = _signal.signal(signal.SIGINT, hold)
    except ValueError:  # not the main interpreter: no signals to hold
        yield
        return
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)
            else:
                raise KeyboardInterrupt
