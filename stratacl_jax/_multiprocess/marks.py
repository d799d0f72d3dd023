"""Cross-process steps: a lax collective over the crossing axes, bracketed by
in-flight marks (a C++ table, xla_ffi/bindings/xproc_handlers.cc, that the
watchdog reads) and preceded by a check that every process runs the same
step."""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _config
from .._group import make_varying
from . import watchdog
from .axis_split import crossing_processes
from .site_ids import stable_site_id


def mark(x, phase: int, site: int, what: str):
    """Passes x through the in-flight table (begin: phase 0, end: 1)."""
    watchdog.ensure_monitor()
    fn = jax.ffi.ffi_call("strata_xproc_mark", jax.ShapeDtypeStruct(x.shape, x.dtype),
                          input_output_aliases={0: 0})
    # The op's timeout travels with the step: the monitor thread cannot see
    # the with-block of the thread that runs the program.
    timeout_ms = int(round(_config.current().timeout_s * 1000))
    return fn(x, site_id=np.int64(site), phase=np.int32(phase), what=what, timeout_ms=np.int64(timeout_ms))


def check(x, axes, what, site, agree=()):
    """Every process of a cross-process step must run the same op: a 31-bit
    hash of (op, group, dtype, shape, reduction) is all-gathered over the
    crossing axes (one int32 per rank, in the same step XLA runs anyway:
    processes that disagree on the op still agree on this gather) and a
    check passes x through (aliased) only when every hash is this one, so
    the step itself never runs on a disagreement (it used to mix a sum with
    a max silently)."""
    text = f"{what}: {np.dtype(x.dtype).name}{list(x.shape)}" + "".join(f", {k}={v}" for k, v in
                                                                           zip(agree[::2], agree[1::2]))
    own = zlib.crc32(text.encode()) & 0x7FFFFFFF  # not where it was called: only what it is
    mine = jax.ffi.ffi_call("strata_xproc_hash", jax.ShapeDtypeStruct((1,), jnp.int32))(x, own=np.int32(own))
    hashes = lax.all_gather(varying(mine, axes), tuple(axes), axis=0, tiled=True)
    fn = jax.ffi.ffi_call("strata_xproc_check", jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0})
    return fn(x, hashes, procs=np.asarray(crossing_processes(axes), np.int32), site_id=np.int64(site),
              own=np.int32(own),
              process=np.int32(jax.process_index()), what=text)


def varying(x, axes):
    return make_varying(x, tuple(axes))


def cross(fn, x, axes, what, agree=()):
    """fn(x) over the crossing `axes` (a lax collective), bracketed by marks
    that pass the data through (aliased). The data dependency is what orders
    them: XLA:CPU runs thunks by data flow and drops optimization barriers,
    so a mark tied by a barrier can run after a collective that already
    failed. Aliasing is free on temporaries; on an entry parameter (e.g. a
    ppermute of the op's own input) XLA copies it once. First, every process
    checks the others run the same step (`check`); `agree`: what else must
    match (the reduction)."""
    site = stable_site_id("xproc", what)  # one per step of the program, alike in every process
    x = mark(varying(x, axes), 0, site, what)
    x = check(varying(x, axes), axes, what, site, agree)
    y = fn(varying(x, axes))
    return mark(y, 1, site, what)

