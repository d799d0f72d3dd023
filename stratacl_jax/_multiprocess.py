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

XLA's cross-process collectives block with no timeout when a peer process is
gone. Every cross-process step is therefore bracketed by two marks (a C++
in-flight table, xla_ffi/bindings/xproc_handlers.cc) and a monitor thread
ends the process with a message naming the op, its ranks and the missing
process when a step waits past the op's timeout (strata.config(timeout_s=))
or a peer stops its heartbeat (a counter each process bumps in JAX's
distributed key-value store; on one host a dead peer's pid is also checked).
"""
from __future__ import annotations

import atexit
import contextlib
import math
import os
import socket
import sys
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
    prev_where = getattr(_lowering, "where", None)
    _lowering.where = _frame_of(getattr(ctx, "traceback", None))
    prev_scope = getattr(_lowering, "scope", None)
    _lowering.scope = ("module", id(ctx.module_context))
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
        _lowering.where = prev_where
        _lowering.scope = prev_scope


def _frame_of(traceback):
    """basename:line of the user's frame that called the op (not ours, not jax's)."""
    if traceback is None:
        return None
    try:
        from jax._src import source_info_util

        pkg = os.path.dirname(os.path.abspath(__file__))
        for frame in source_info_util.user_frames(traceback):
            if not os.path.abspath(frame.file_name).startswith(pkg):
                return f"{os.path.basename(frame.file_name)}:{frame.start_line}"
    except Exception:
        return None
    return None


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


# ------------------------------------------------------------------------------------------------
# Site ids that agree across processes


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
    pkg = os.path.dirname(os.path.abspath(__file__))
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(pkg) and f"{os.sep}jax{os.sep}" not in path:
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


# ------------------------------------------------------------------------------------------------
# Cross-process steps: marks and lax pieces


def mark(x, phase: int, site: int, what: str):
    """Passes x through the in-flight table (begin: phase 0, end: 1)."""
    _ensure_monitor()
    fn = jax.ffi.ffi_call("strata_xproc_mark", jax.ShapeDtypeStruct(x.shape, x.dtype),
                          input_output_aliases={0: 0})
    from . import _config

    # The op's timeout travels with the step: the monitor thread cannot see
    # the with-block of the thread that runs the program.
    timeout_ms = int(round(_config.current().timeout_s * 1000))
    return fn(x, site_id=np.int64(site), phase=np.int32(phase), what=what, timeout_ms=np.int64(timeout_ms))


def _crossing_processes(axes) -> list:
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
    return fn(x, hashes, procs=np.asarray(_crossing_processes(axes), np.int32), site_id=np.int64(site),
              own=np.int32(own),
              process=np.int32(jax.process_index()), what=text)


def varying(x, axes):
    from ._ffi import make_varying

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
    from ._ffi import GroupSpec

    manual = tuple(group.axes) + tuple(group.others)
    return GroupSpec(tuple(local), math.prod(sizes(local)), tuple(a for a in manual if a not in local),
                     group.num_devices)


# ------------------------------------------------------------------------------------------------
# The monitor: a missing or crashed peer is an error naming the op, never a hang

_monitor_lock = threading.Lock()
_monitor_started = False
_seen: dict = {}  # process -> (last counter value, monotonic time it changed)
_kv_ok = [time.monotonic()]
HEARTBEAT_S = 0.25


def peer_timeout_s() -> float:
    """How long a peer's heartbeat may stand still while we wait for it in a
    cross-process step: STRATA_PEER_TIMEOUT_S (default 10 s), and at most half
    of jax.distributed's heartbeat_timeout_seconds, so strata names the op and
    the stalled process before JAX's coordination service aborts this one
    (with a 10 s heartbeat both fired at 10 s and JAX's SIGABRT won)."""
    try:
        limit = float(os.environ.get("STRATA_PEER_TIMEOUT_S", "10"))
    except ValueError:
        limit = 10.0
    if _jax_heartbeat_s[0]:
        limit = min(limit, 0.5 * _jax_heartbeat_s[0])
    return max(limit, 2 * HEARTBEAT_S)


# heartbeat_timeout_seconds given to jax.distributed.initialize (None: unknown).
_jax_heartbeat_s: list = [None]


def _capture_heartbeat_setting() -> None:
    """Records heartbeat_timeout_seconds when jax.distributed.initialize runs
    (JAX keeps it only inside its C++ client)."""
    try:
        import functools
        import inspect

        from jax._src import distributed
    except Exception:  # noqa: BLE001
        return
    original = distributed.State.initialize
    if getattr(original, "_strata_wrapped", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(self, *args, **kwargs):
        try:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            value = bound.arguments.get("heartbeat_timeout_seconds")
            _jax_heartbeat_s[0] = float(value) if value else None
        except Exception:  # noqa: BLE001
            pass
        return original(self, *args, **kwargs)

    initialize._strata_wrapped = True
    distributed.State.initialize = initialize


_capture_heartbeat_setting()


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def _ensure_monitor():
    global _monitor_started
    if _monitor_started or process_count() <= 1 or _client() is None:
        return
    with _monitor_lock:
        if _monitor_started:
            return
        _monitor_started = True
        threads = [threading.Thread(target=_heartbeat_loop, name="strata-heartbeat", daemon=True),
                   threading.Thread(target=_monitor_loop, name="strata-monitor", daemon=True)]
        for t in threads:
            t.start()

        def stop():
            # Before the interpreter ends its daemon threads: one inside a
            # key-value call would be unwound through C++ and abort the exit.
            _stop.set()
            for t in threads:
                t.join(timeout=2.0)

        atexit.register(stop)
        _install_excepthook()


_stop = threading.Event()


def _heartbeat_loop():
    first = _client()
    me = jax.process_index()
    host = socket.gethostname()
    beat = 0
    while not _stop.is_set():
        beat += 1
        client = _client()
        if client is None or client is not first:  # jax.distributed.shutdown()
            return
        try:
            client.key_value_set(f"strata/hb/{me}", f"{beat} {host} {os.getpid()}", allow_overwrite=True)
            now = time.monotonic()
            for key, value in client.key_value_dir_get("strata/hb/"):
                p = int(key.rsplit("/", 1)[1])
                count, phost, pid = value.split()
                last = _seen.get(p)
                if last is None or last[0] != count:
                    _seen[p] = (count, now, phost, int(pid))
            _kv_ok[0] = now
        except Exception:  # the coordinator is gone: the monitor reports it
            pass
        _stop.wait(HEARTBEAT_S)


def _pid_gone(pid: int) -> bool:
    """A local process that has exited (a zombie its parent has not reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return False


def _dead_peers(procs, now, limit):
    host = socket.gethostname()
    dead = []
    for p in procs:
        if p == jax.process_index():
            continue
        seen = _seen.get(p)
        if seen is None:
            continue
        _, since, phost, pid = seen
        if phost == host and _pid_gone(pid):
            dead.append((p, f"its process {pid} is gone"))
            continue
        if now - since > limit:
            dead.append((p, f"no heartbeat for {now - since:.1f} s"))
    return dead


def _procs_in(what):
    import re

    return sorted({int(p) for p in re.findall(r"process (\d+):", what)}) or list(range(process_count()))


def _monitor_loop():
    while not _stop.wait(HEARTBEAT_S):
        try:
            inflight = _core_inflight()
        except Exception:
            continue
        if not inflight:
            continue
        now = time.monotonic()
        limit = peer_timeout_s()
        for site, device, age, what, timeout in inflight:
            dead = _dead_peers(_procs_in(what), now, limit)
            why = None
            if dead:
                why = "; ".join(f"process {p} ({reason})" for p, reason in dead) + " stopped responding"
            elif now - _kv_ok[0] > limit and age > limit:
                why = f"the coordination service (process 0) has been unreachable for {now - _kv_ok[0]:.1f} s"
            elif age > max(timeout, limit):
                why = (f"the peers did not complete it within {max(timeout, limit):.1f} s (strata.config "
                       f"timeout_s={timeout}); a peer process may be stuck or running another program")
            if why is not None:
                _fail(f"{what}: waited {age:.1f} s on process {jax.process_index()}, device {device}: {why}. "
                      f"XLA's cross-process collectives cannot be cancelled, so this process ends now "
                      f"instead of hanging.")


def diagnose() -> str | None:
    """What strata knows when a program failed inside a cross-process step:
    the op, its ranks per process and which peer process is gone; None when
    no step is in flight."""
    try:
        inflight = _core_inflight()
    except Exception:
        return None
    if not inflight:
        return None
    now = time.monotonic()
    lines = []
    for what in sorted({row[3] for row in inflight}):
        dead = _dead_peers(_procs_in(what), now, peer_timeout_s())
        why = ("; ".join(f"process {p} ({reason})" for p, reason in dead) + " stopped responding") if dead else \
            "no peer process is known to be gone"
        lines.append(f"{what} did not complete: {why}")
        if dead:
            _diagnosed_dead[0] = True
    return "\n".join(lines)


_diagnosed_dead = [False]


def _install_excepthook():
    """An uncaught error raised while a cross-process step was in flight (XLA
    reports gloo's "Connection closed by peer", which names no op) gets a note
    naming the strata op, its ranks and the missing process; when a peer is
    known to be gone the process then ends at once (JAX's shutdown barrier
    would only wait for the dead peer and abort)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        message = diagnose()
        if message and isinstance(value, BaseException):
            value.add_note(f"stratacl_jax: {message}")
        previous(kind, value, tb)
        if message and _diagnosed_dead[0]:
            sys.stderr.write(f"stratacl_jax: error: {message}\n")
            sys.stderr.flush()
            os._exit(75)

    sys.excepthook = hook


def _core_inflight():
    from . import _core

    return _core.xproc_inflight()


def _fail(message):
    sys.stderr.write(f"stratacl_jax: error: {message}\n")
    sys.stderr.flush()
    os._exit(75)
