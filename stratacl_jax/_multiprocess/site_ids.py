"""Site ids that agree across processes: a call site's id comes from what
the op is and where the user called it, so every process names one op alike
(in errors, traces and the cross-process marks)."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import zlib

# The package's own frames are skipped when looking for the user's call.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_lowering = threading.local()


@contextlib.contextmanager
def lowering(ctx):
    """While a strata primitive is lowered: the user's frame that called it
    and the module being lowered (which numbers repeats of one site)."""
    prev_where = getattr(_lowering, "where", None)
    _lowering.where = _frame_of(getattr(ctx, "traceback", None))
    prev_scope = getattr(_lowering, "scope", None)
    _lowering.scope = ("module", id(ctx.module_context))
    try:
        yield
    finally:
        _lowering.where = prev_where
        _lowering.scope = prev_scope


def _frame_of(traceback):
    """basename:line of the user's frame that called the op (not ours, not jax's)."""
    if traceback is None:
        return None
    try:
        from jax._src import source_info_util

        for frame in source_info_util.user_frames(traceback):
            if not os.path.abspath(frame.file_name).startswith(_PACKAGE_DIR):
                return f"{os.path.basename(frame.file_name)}:{frame.start_line}"
    except Exception:
        return None
    return None


def stable_site_id(*parts) -> int:
    """A call-site id from what the op is (name, axes, shapes, dtypes, static
    arguments) and where the user called it, not from a process-local counter:
    processes that traced their programs in different orders still name one
    op alike (the id appears in errors and traces; ranks meet by the
    instruction's instance, inside one process)."""
    text = "|".join(str(p) for p in parts) + "|" + _user_location()
    # The same op at the same place more than once in one program (a Python
    # loop): the n-th repeat in this program (one lowered module, or one
    # trace) gets ordinal n, the same in every process.
    scope = getattr(_lowering, "scope", None)
    if scope is None:
        try:
            from jax._src import core

            scope = ("trace", id(core.trace_ctx.trace))
        except Exception:
            scope = ("none",)
    if _ordinals.get("scope") != scope:
        _ordinals.clear()
        _ordinals["scope"] = scope
    n = _ordinals.get(text, 0)
    _ordinals[text] = n + 1
    text += f"|{n}"
    return (zlib.crc32(text.encode()) << 20 | (zlib.adler32(text.encode()) & 0xFFFFF)) or 1


_ordinals: dict = {}


def _user_location() -> str:
    where = getattr(_lowering, "where", None)
    if where:
        return where
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE_DIR) and f"{os.sep}jax{os.sep}" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""
