"""Ctrl-C at any moment of a command: the exit code it ends with, and a watch that tells an interruption apart from
the errors libraries make of it. No heavy imports: the command line uses it before torch loads."""

import signal
import threading
from typing import Self

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as shells report a Ctrl-C


class InterruptWatch:
    """Notes a Ctrl-C, which still raises KeyboardInterrupt, so that an error a library made of it is still
    reported as the interruption it was: transformers turns a KeyboardInterrupt inside one of its lazy imports into
    a ModuleNotFoundError, for one. Where Ctrl-C is ignored (a background job) it stays ignored.

    deferred: only note it, for the caller to act on once the block ends. For imports: a KeyboardInterrupt raised
    while a compiled module initialises (torch's, through pybind11) aborts the process instead of propagating.
    """

    def __init__(self, deferred: bool = False) -> None:
        self.seen = False
        self.deferred = deferred
        self._installed = False

    def _note(self, signum, frame) -> None:
        self.seen = True
        if not self.deferred:
            raise KeyboardInterrupt

    def __enter__(self) -> Self:
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._note)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
