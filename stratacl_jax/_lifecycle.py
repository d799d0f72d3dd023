"""Exits and Ctrl-C never wait for a collective whose peers will not come.

An op waiting for peers holds its ranks' XLA executions until its timeout
(60 s by default); interpreter shutdown and a KeyboardInterrupt both wait for
those executions. So: at exit, every op still waiting fails at once with an
error (and later ones are refused), and SIGINT does the same for the ops
waiting at that moment before Python's own handler raises KeyboardInterrupt.
"""
from __future__ import annotations

import atexit

from . import _core

_EXITING = "the process is exiting"


def _abort_at_exit() -> None:
    _core.abort_pending(_EXITING, True)


def install() -> None:
    _core.install_interrupt_handler()
    # atexit runs after Python has joined non-daemon threads (whose ops may
    # legitimately still be finishing) and, registered after `import jax`,
    # before jax's own exit hooks, which may wait for a pending execution.
    atexit.register(_abort_at_exit)
