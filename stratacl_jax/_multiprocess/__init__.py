"""Strata on meshes that span processes (jax.distributed).

Each process runs its own XLA:CPU client; strata's runtime (rendezvous,
arenas, registry, stats) lives in one address space and serves the ranks of a
group that are all in this process. An op whose group crosses processes is
composed, when it is lowered, from

  * strata's in-process op over the group's axes that stay inside a process
    (every line of devices along them has one process_index): the direct
    path, unchanged;
  * the lax twin over the axes that cross processes: XLA's own collectives,
    which run over gloo between processes.

The block order is the single-process op's (row-major over the axis tuple in
the order given). An op whose axes all cross (e.g. a 1-D mesh of 8 devices
over 2 processes) runs its lax twin (or, where XLA:CPU has none, a
composition of lax ops) for the whole group.

Because the composition happens in the primitives' lowering, their abstract
evaluation (shapes, dtypes, varying/invariant typing), AD, batching and
trace-time errors are exactly the single-process ones.

Four concerns, a module each: `axis_split` (which axes cross processes, and
the rank orders of the split), `site_ids` (call-site ids alike in every
process), `marks` (a cross-process step: its in-flight marks and the check
that every process runs the same step) and `watchdog` (a missing or crashed
peer is an error naming the op, never a hang).
"""
from __future__ import annotations

import contextlib

# The watchdog wraps jax.distributed.initialize (to learn its heartbeat
# timeout) when it is imported: it must be before the user initializes.
from . import watchdog  # noqa: F401
from . import axis_split, site_ids
from .axis_split import (crosses_at_trace, describe, from_split_order, local_device_index, mesh_order,  # noqa: F401
                         process_count, rank_in_order, remember_mesh, sizes, split, sub_group, to_split_order)
from .marks import cross  # noqa: F401
from .site_ids import stable_site_id  # noqa: F401


@contextlib.contextmanager
def lowering(ctx):
    """While a strata primitive is lowered: its mesh's process layout (for
    split) and its call site (for stable_site_id)."""
    with axis_split.lowering(ctx), site_ids.lowering(ctx):
        yield
