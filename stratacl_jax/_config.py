"""Runtime choices: global settings, and contexts that scope them to a thread.

``strata.config(...)`` called as a statement changes the global settings (every
thread sees them); ``with strata.config(...):`` holds for its own thread only,
as JAX's config contexts do, and a setting a with-block does not name follows
the global one. Settings in force when an op is *traced* are baked into it (as
FFI attributes), so a jitted function keeps the mode it was traced with; the
timeout is the exception: ``timeout_s`` is part of jax.jit's cache key (a JAX
config state, ``strata_timeout_s``), so a jitted program called under another
timeout is traced again and waits as long as the setting in force at the call
says (a program compiled ahead of time, ``jit(f).lower(...).compile()``, keeps
the one it was lowered with).
"""
from __future__ import annotations

import dis
import functools
import math
import numbers
import operator
import sys
import threading
from dataclasses import dataclass, fields, replace

from . import _core

MODES = tuple(_core.mode_codes())  # the extension's names, in code order
PLANNERS = tuple(_core.planner_codes())
LAX_COLLECTIVES = ("xla", "strata")
# Beyond this a deadline is meaningless (and its microseconds overflow C++'s
# clocks); a wait this long is a hang by any measure.
MAX_TIMEOUT_S = 1e6
MAX_LANES = 4096
MAX_COMM_BUFFER_BYTES = 1 << 50


@dataclass(frozen=True)
class Settings:
    mode: str = "strata"
    # One die of an Ascend 910C has 48 vector (AIV) cores; a collective runs on them.
    cores_per_npu: int = 48
    # Public sources do not give the SDMA engine count per die: an assumption.
    sdma_engines_per_npu: int = 16
    # HCCL_BUFFSIZE's default: 200 MB per communication buffer, two per rank.
    comm_buffer_bytes: int = 200 * 1024 * 1024
    timeout_s: float = 60.0
    planner: str = "balanced"
    # "strata": jax.lax's own collectives traced under it lower to strata's
    # custom calls (stratacl_jax/_lax_routing.py); "xla": XLA's own.
    lax_collectives: str = "xla"

    def validated(self) -> "Settings":
        return replace(self, **{f.name: validate(f.name, getattr(self, f.name)) for f in fields(self)})


_NAMES = tuple(f.name for f in fields(Settings))


def validate(name: str, value):
    """The setting's value in canonical form, or the error naming it."""
    if name in ("mode", "planner", "lax_collectives"):
        choices = {"mode": MODES, "planner": PLANNERS, "lax_collectives": LAX_COLLECTIVES}[name]
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"strata.config: {name} must be one of {choices}, got {value!r}")
        return value
    if name == "timeout_s":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"strata.config: timeout_s must be a number of seconds, got {value!r}")
        t = float(value)
        if not math.isfinite(t) or not 0 < t <= MAX_TIMEOUT_S:
            raise ValueError(
                f"strata.config: timeout_s must be finite, positive and at most {MAX_TIMEOUT_S:g} s "
                f"({MAX_TIMEOUT_S / 86400:.1f} days), got {value!r}")
        return t
    limit = MAX_COMM_BUFFER_BYTES if name == "comm_buffer_bytes" else MAX_LANES
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"strata.config: {name} must be a positive int, got {value!r}")
    v = operator.index(value)
    if not 1 <= v <= limit:
        raise ValueError(f"strata.config: {name} must be a positive int of at most {limit}, got {value!r}")
    return v


# The global settings: defaults, then the statement calls in the order they
# were made. A call's layer is dropped if the object is later used in a
# `with` (its settings move to that thread), and folded into the base once the
# object is gone (it can no longer be entered).
class _Layer:
    __slots__ = ("changes", "final")

    def __init__(self, changes):
        self.changes = changes
        self.final = False


_lock = threading.RLock()
_base = Settings()
_layers: list[_Layer] = []
_global = _base
_local = threading.local()  # .stack: the changes of this thread's open with-blocks, outermost first


def _timeout_state():
    """A JAX config state mirroring each thread's timeout, in jit's cache key:
    a program called under a timeout it was not traced with is traced again.
    None if this JAX has no such hook (then a traced program keeps its timeout)."""
    try:
        from jax._src import config as jax_config

        return jax_config.State("strata_timeout_s", Settings.timeout_s,
                                "stratacl_jax's collective timeout (set with strata.config(timeout_s=...))",
                                include_in_jit_key=True, include_in_trace_context=True)
    except Exception:  # noqa: BLE001 - an internal API; degrade to trace-time timeouts
        return None


_TIMEOUT = _timeout_state()
TIMEOUT_FOLLOWS_CALLS = _TIMEOUT is not None


def _refresh_global() -> None:
    global _base, _global
    with _lock:
        while _layers and _layers[0].final:
            _base = replace(_base, **_layers.pop(0).changes)
        s = _base
        for layer in _layers:
            s = replace(s, **layer.changes)
        _global = s
        if _TIMEOUT is not None:
            _TIMEOUT.set_global(s.timeout_s)


def current() -> Settings:
    """The settings in force on this thread."""
    s = _global
    for changes in getattr(_local, "stack", ()):
        s = replace(s, **changes)
    return s


_WITH_OPS = frozenset({"BEFORE_WITH", "SETUP_WITH", "BEFORE_ASYNC_WITH", "SETUP_ASYNC_WITH"})


@functools.lru_cache(maxsize=4096)
def _with_follows(code, lasti: int) -> bool | None:
    """True when the call at `lasti` of `code` is a with-statement's context
    expression (the next instructions enter it), False when it is not, None
    when this Python's bytecode is not one we know."""
    try:
        ops = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
    except Exception:  # noqa: BLE001
        return None
    for k, ins in enumerate(ops):
        if ins.offset == lasti:
            nxt = [i.opname for i in ops[k + 1:k + 3]]
            if nxt[:1] and nxt[0] in _WITH_OPS:
                return True
            if nxt[:2] == ["COPY", "LOAD_SPECIAL"]:  # Python 3.14
                return True
            return False
    return None


def _called_as_with() -> bool:
    """Whether strata.config(...) is being evaluated as `with strata.config(...)`:
    then it must not touch the global settings even for a moment."""
    try:
        frame = sys._getframe(2)
        # A subclass's __init__ (stratacl_jax/_lax_routing.py) stands between: skip it.
        while frame.f_code.co_name == "__init__" and "stratacl_jax" in frame.f_code.co_filename:
            frame = frame.f_back
        return bool(_with_follows(frame.f_code, frame.f_lasti))
    except Exception:  # noqa: BLE001
        return False


class config:
    """``strata.config(mode=..., cores_per_npu=..., ...)``.

    Called as a statement it changes the global settings (every thread);
    used as ``with strata.config(...):`` it applies to the calling thread
    until the block ends, over whatever the global settings are.
    """

    _names = _NAMES

    def __init__(self, **changes):
        unknown = set(changes) - set(self._names)
        if unknown:
            raise TypeError(f"strata.config: unknown setting(s) {sorted(unknown)}; known: {self._names}")
        self._changes = {name: validate(name, value) for name, value in changes.items()}
        self._entries: list = []
        self._layer = None
        if not _called_as_with():
            self._layer = _Layer(self._changes)
            with _lock:
                _layers.append(self._layer)
                _refresh_global()

    def __enter__(self) -> Settings:
        if self._layer is not None and not self._layer.final:
            # Made as a statement, then entered: its settings leave the
            # global ones and hold for this thread instead.
            with _lock:
                if self._layer in _layers:
                    _layers.remove(self._layer)
                self._layer = None
                _refresh_global()
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        token = dict(self._changes)
        stack.append(token)
        previous_timeout = None
        if _TIMEOUT is not None and "timeout_s" in self._changes:
            previous_timeout = _TIMEOUT.swap_local(self._changes["timeout_s"])
        self._entries.append((token, previous_timeout))
        return current()

    def __exit__(self, *exc) -> None:
        token, previous_timeout = self._entries.pop()
        stack = _local.stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i] is token:
                del stack[i]
                break
        if _TIMEOUT is not None and "timeout_s" in self._changes:
            _TIMEOUT.set_local(previous_timeout)

    def __del__(self):
        # No lock here (a collector may run this anywhere): marking the layer
        # final changes no setting, the next change folds it into the base.
        layer = getattr(self, "_layer", None)
        if layer is not None:
            layer.final = True

    def __repr__(self) -> str:
        return f"strata.config({current()})"


def global_settings() -> Settings:
    """The global settings (what a thread outside any with-block sees)."""
    return _global
