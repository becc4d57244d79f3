"""Ctrl-C or SIGTERM at any moment of a command: the exit code it ends with, and a watch that tells an interruption
apart from the errors libraries make of it. No heavy imports: the command line uses it before torch loads."""

import signal
import threading
from typing import Self

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as shells report a Ctrl-C
# SIGTERM (kill, a timeout, a service manager stopping the tool) stops a command as Ctrl-C does: the text so far
# kept, one line, no traceback; Python's default would end the process on the spot, mid-write, silently.
STOP_SIGNALS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}  # each with its default

_stopped_by: list[int] = []  # the stop signal the current watch noted, if any


def interrupted_exit_code() -> int:
    """What a command stopped by the user ends with: 128 + the signal, as shells report it (130 for Ctrl-C, or a
    KeyboardInterrupt raised any other way, 143 for SIGTERM)."""
    return 128 + _stopped_by[-1] if _stopped_by else INTERRUPTED_EXIT_CODE


class InterruptWatch:
    """Notes a Ctrl-C or SIGTERM, which then raises KeyboardInterrupt, so that an error a library made of it is
    still reported as the interruption it was: transformers turns a KeyboardInterrupt inside one of its lazy imports
    into a ModuleNotFoundError, for one. A signal that is ignored (Ctrl-C in a background job) or handled by someone
    else stays so.

    deferred: only note it, for the caller to act on once the block ends. For imports: a KeyboardInterrupt raised
    while a compiled module initialises (torch's, through pybind11) aborts the process instead of propagating.
    """

    def __init__(self, deferred: bool = False) -> None:
        self.seen = False
        self.deferred = deferred
        self._installed: list[int] = []

    def _note(self, signum, frame) -> None:
        self.seen = True
        _stopped_by.append(signum)
        if not self.deferred:
            raise KeyboardInterrupt

    def __enter__(self) -> Self:
        _stopped_by.clear()  # a new command: whatever stopped an earlier one in this process is not its story
        if threading.current_thread() is threading.main_thread():
            for signum, default in STOP_SIGNALS.items():
                if signal.getsignal(signum) is default:
                    signal.signal(signum, self._note)
                    self._installed.append(signum)
        return self

    def __exit__(self, *exc) -> None:
        for signum in self._installed:
            signal.signal(signum, STOP_SIGNALS[signum])
        self._installed.clear()
