"""Child processes that do not outlive draftsmith: engine servers and workers hold a GPU, a port and gigabytes.

Two holes, two fixes:

* a SIGTERM (a scheduler, ``kill PID``, a CI timeout that signals one process) runs no ``finally`` and no
  ``__exit__`` in Python by default: ``sigterm_as_exit`` turns it into ``SystemExit`` in the main thread, so the
  with-blocks that stop a server and remove a temporary export run as they do on an exception;
* a kill -9 runs nothing at all: ``child_options`` asks Linux to send the child SIGTERM when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``, kept across exec), so the server stops itself. Elsewhere it is a no-op.

The temporary folders a kill -9 leaves are removed at the next start (``core.io.process_temp_dir``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

_PR_SET_PDEATHSIG = 1


def _pdeathsig_setter() -> Callable[[], None] | None:
    """A preexec_fn that sets the parent-death signal; resolved before the fork (no library loading after it)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody would signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return set_pdeathsig


def child_options() -> dict:
    """Keyword arguments for ``subprocess.Popen``/``run``: the child gets SIGTERM when this process dies."""
    setter = _pdeathsig_setter()
    return {"preexec_fn": setter} if setter is not None else {}


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit(143)`` in the main thread (the shell's code for it), so cleanup
    runs; the previous handler is restored after. Outside the main thread, where no handler can be set, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = ["child_options", "sigterm_as_exit"]
