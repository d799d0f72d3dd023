"""Which axes of a collective's group cross processes, and the rank orders of
the split: the mesh's process layout (recorded by make_mesh, or seen while a
primitive is lowered) decides which axes stay inside a process (strata's
direct path) and which cross (XLA's collectives over gloo)."""
from __future__ import annotations

import contextlib
import math
import threading

import jax
import numpy as np
from jax import lax

from .._group import GroupSpec

# XLA:CPU packs a device's id as process_index * kMaxCpuDevicesPerProcess +
# local id (2048 in jaxlib 0.10.2; xla_ffi/bindings/ffi_common.h decodes the
# same constant).
MAX_CPU_DEVICES_PER_PROCESS = 2048


def local_device_index(device) -> int:
    """The device's index inside its process: what the C++ runtime's arenas,
    registry and stats are indexed by."""
    return int(device.id) % MAX_CPU_DEVICES_PER_PROCESS


def process_count() -> int:
    try:
        return jax.process_count()
    except RuntimeError:
        return 1


# ------------------------------------------------------------------------------------------------
# Which axes cross processes

_grids: dict = {}  # (axis_names, shape) -> process index per mesh position, from make_mesh
_lowering = threading.local()


def remember_mesh(mesh) -> None:
    """make_mesh records its meshes' process layout, for lowerings that only
    see an abstract mesh."""
    grid = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(mesh.devices)
    _grids[(tuple(mesh.axis_names), tuple(mesh.devices.shape))] = grid


def _grid_of(mesh):
    devices = getattr(mesh, "devices", None)
    if isinstance(devices, np.ndarray) and devices.dtype == object:
        return tuple(mesh.axis_names), np.vectorize(lambda d: d.process_index, otypes=[np.int64])(devices)
    key = (tuple(mesh.axis_names), tuple(mesh.axis_sizes))
    return (key[0], _grids.get(key))


@contextlib.contextmanager
def lowering(ctx):
    """While a strata primitive is lowered: the process layout of its mesh."""
    prev = getattr(_lowering, "grid", None)
    grid = None
    if process_count() > 1:
        mesh = getattr(ctx.module_context.axis_context, "mesh", None)
        grid = _grid_of(mesh) if mesh is not None else None
        if grid is None:
            grid = ((), None)
    _lowering.grid = grid
    try:
        yield
    finally:
        _lowering.grid = prev


def _is_local(names, grid, axes) -> bool:
    dims = [names.index(a) for a in axes]
    rest = [d for d in range(grid.ndim) if d not in dims]
    lines = np.transpose(grid, rest + dims).reshape(-1, math.prod(grid.shape[d] for d in dims))
    return bool((lines == lines[:, :1]).all())


def split(axes) -> tuple | None:
    """None when the group over `axes` stays in one process (today's direct
    path); else (local axes, crossing axes), each in the order of `axes`.
    With an unknown layout (an abstract mesh make_mesh did not make) every
    axis is taken to cross: the lax twin is right on any layout."""
    grid = getattr(_lowering, "grid", None)
    if grid is None:
        return None
    names, procs = grid
    if procs is None or any(a not in names for a in axes):
        return (), tuple(axes)
    if _is_local(names, procs, axes):
        return None
    local = tuple(a for a in axes if _is_local(names, procs, (a,)))
    return local, tuple(a for a in axes if a not in local)


def crosses_at_trace(axes) -> bool:
    """While tracing (the mesh is abstract): whether a group over `axes` of
    the current mesh spans processes, from the layout make_mesh recorded;
    unknown layouts count as crossing."""
    if process_count() <= 1:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    grid = _grids.get((tuple(mesh.axis_names), tuple(mesh.axis_sizes)))
    if grid is None:
        return True
    return not _is_local(tuple(mesh.axis_names), grid, tuple(axes))


def describe(opname, axes, crossing) -> str:
    """What a cross-process step waits for: the op, its axes and, per process,
    the ranks of the group of this process's first device."""
    names, procs = getattr(_lowering, "grid", None) or ((), None)
    where = ""
    if procs is not None and all(a in names for a in axes):
        me = jax.process_index()
        at = np.argwhere(procs == me)
        if len(at):
            index = list(at[0])
            dims = [names.index(a) for a in axes]
            sizes = [procs.shape[d] for d in dims]
            by_proc: dict = {}
            for rank, coords in enumerate(np.ndindex(*sizes)):
                for d, c in zip(dims, coords):
                    index[d] = c
                by_proc.setdefault(int(procs[tuple(index)]), []).append(rank)
            where = "; " + ", ".join(f"process {p}: ranks {_ranges(r)}" for p, r in sorted(by_proc.items()))
    return f"{opname} over {tuple(axes)} (cross-process step over {tuple(crossing)}{where})"


def _ranges(ranks) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def crossing_processes(axes) -> list:
    """The process of each rank of `axes` (their rank order) in the group of
    this process's first device."""
    names, procs = getattr(_lowering, "grid", None) or ((), None)
    if procs is None or not all(a in names for a in axes):
        return []
    at = np.argwhere(procs == jax.process_index())
    if not len(at):
        return []
    index = list(at[0])
    dims = [names.index(a) for a in axes]
    out = []
    for coords in np.ndindex(*[procs.shape[d] for d in dims]):
        for d, c in zip(dims, coords):
            index[d] = c
        out.append(int(procs[tuple(index)]))
    return out


def mesh_order(axes) -> tuple:
    """`axes` in the mesh's order."""
    names = tuple((getattr(_lowering, "grid", None) or ((), None))[0])
    if not names:
        names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    return tuple(sorted(axes, key=names.index)) if all(a in names for a in axes) else tuple(axes)


def rank_in_order(rank: int, axes, order) -> int:
    """A rank numbered row-major over `axes`, renumbered row-major over `order`."""
    coords = dict(zip(axes, np.unravel_index(rank, sizes(axes))))
    return int(np.ravel_multi_index([coords[a] for a in order], sizes(order)))


def sizes(axes):
    return [lax.axis_size(a) for a in axes]


def to_split_order(x, axes, local, crossing, lead=0):
    """x whose dim `lead` indexes ranks of `axes` (row-major, that order) ->
    dims [n_local, n_cross] at `lead`."""
    shape = x.shape
    sz = sizes(axes)
    x = x.reshape(shape[:lead] + tuple(sz) + shape[lead + 1:])
    order = [axes.index(a) for a in local] + [axes.index(a) for a in crossing]
    perm = list(range(lead)) + [lead + o for o in order] + list(range(lead + len(axes), x.ndim))
    x = x.transpose(perm)
    return x.reshape(shape[:lead] + (math.prod(sizes(local)), math.prod(sizes(crossing))) + shape[lead + 1:])


def from_split_order(x, axes, local, crossing, lead=0):
    """The inverse: dims [n_local, n_cross] at `lead` -> one rank dim of `axes`."""
    shape = x.shape
    order = [axes.index(a) for a in local] + [axes.index(a) for a in crossing]
    x = x.reshape(shape[:lead] + tuple(sizes(local)) + tuple(sizes(crossing)) + shape[lead + 2:])
    inv = np.argsort(order)
    perm = list(range(lead)) + [lead + int(o) for o in inv] + list(range(lead + len(axes), x.ndim))
    x = x.transpose(perm)
    return x.reshape(shape[:lead] + (math.prod(sizes(axes)),) + shape[lead + 2:])


def sub_group(group, local):
    """The in-process part of `group`: the same mesh, over `local` only."""
    manual = tuple(group.axes) + tuple(group.others)
    return GroupSpec(tuple(local), math.prod(sizes(local)), tuple(a for a in manual if a not in local),
                     group.num_devices)
