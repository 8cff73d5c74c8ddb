"""A signal that lands while the main thread is inside the stop event's own wait() (holding its lock) must
still stop the process: `pagedserve up` once hung on Ctrl-C that way, its handler waiting for a lock its own
thread held."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from pagedserve.service import stop_on_signals


@pytest.fixture
def restore_handlers():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_signal_inside_the_events_wait_sets_it_once_the_wait_lets_go(restore_handlers):
    stopping = threading.Event()
    stop_on_signals(stopping)
    with stopping._cond:  # where Event.wait() holds it: between waking and returning
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, on this thread, and must not block
        assert not stopping.is_set()
    assert stopping.wait(5)


def test_the_first_signal_stops_and_the_next_ones_interrupt(restore_handlers):
    stopping, interrupted = threading.Event(), threading.Event()
    stop_on_signals(stopping, interrupted)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stopping.wait(5) and not interrupted.is_set()
    os.kill(os.getpid(), signal.SIGINT)
    assert interrupted.wait(5)
