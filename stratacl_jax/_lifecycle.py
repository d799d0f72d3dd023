"""Exits and Ctrl-C never wait for a collective whose peers will not come.

An op waiting for peers holds its ranks' XLA executions until its timeout
(60 s by default); interpreter shutdown and a KeyboardInterrupt both wait for
those executions. So: at exit, every op still waiting fails at once with an
error (and later ones are refused), and SIGINT does the same for the ops
waiting at that moment before Python's own handler raises KeyboardInterrupt.
"""
from __future__ import annotations

import atexit
import threading

from . import _core

_EXITING = "the process is exiting"


def _abort_at_exit() -> None:
    _core.abort_pending(_EXITING, True)


def install() -> None:
    _core.install_interrupt_handler()
    # threading's exit hooks run first in interpreter shutdown, before it
    # joins threads and before atexit's hooks (jax's among them), any of
    # which may wait for a pending execution.
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_abort_at_exit)
        except RuntimeError:  # already shutting down
            pass
    atexit.register(_abort_at_exit)
