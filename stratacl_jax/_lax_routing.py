"""`strata.config(lax_collectives="strata")`: jax.lax's own collectives on strata.

Every collective primitive of jax.lax that strata implements gets a
`bind_with_trace` (jax's `Primitive.def_bind_with_trace` hook) that, when the
primitive is *staged* into a jaxpr (jit, shard_map, scan, remat, the
transposes autodiff traces...) while the setting is "strata", binds strata's
primitive instead. The setting is thus read at trace time and baked into the
program, as `mode` is, and everything that puts a lax collective into a
program goes through it: the user's `lax.psum`, `pmean`/`pmax`/`pmin`, and the
`psum_invariant` that the transpose of shard_map's implicit `pvary` inserts
(the gradient of a replicated parameter under check_vma=True), whatever vmap
or a transpose rule binds. From then on the op is strata's primitive, with
strata's AD and batching rules (the same linear maps as lax's) and lax's
shapes and varying/invariant typing (checked against lax's own abstract
evaluation at every routed bind).

What strata cannot run keeps lax's primitive, and so XLA's lowering:
`axis_index_groups`, positional (integer) axes, axes that are not manual mesh
axes of the enclosing shard_map (bound only by vmap, or no shard_map at all),
dtypes outside strata's contract, eager (unjitted) execution. Programs traced
with the setting off are untouched. `strata.stats()` reports, by primitive,
what was routed (`lax_routed`) and what was left to XLA and why
(`lax_left_to_xla`); both count binds at trace time.
"""
from __future__ import annotations

import collections
import threading

import numpy as np
from jax._src import core
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import parallel as P

from . import _config
from . import _ffi
from .all_gather import all_gather_p
from .all_reduce import bind as all_reduce_bind
from .all_to_all import all_to_all_p
from .broadcast import broadcast_p
from .ppermute import ppermute_p
from .ragged_all_to_all import ragged_p
from .reduce_scatter import reduce_scatter_p

_lock = threading.Lock()
_routed: collections.Counter = collections.Counter()
_left: collections.Counter = collections.Counter()


def counters() -> dict:
    with _lock:
        return {"lax_routed": dict(_routed), "lax_left_to_xla": dict(_left)}


def reset() -> None:
    with _lock:
        _routed.clear()
        _left.clear()


def _count(counter, key):
    with _lock:
        counter[key] += 1


# ---------------------------------------------------------------------------
# Which binds can go to strata


def _axes(name) -> tuple:
    return tuple(name) if isinstance(name, (tuple, list)) else (name,)


def _why_not(axes, avals, axis_index_groups=None) -> str | None:
    """None when strata can run the op over `axes` here; else the reason."""
    if axis_index_groups is not None:
        return "axis_index_groups"
    if not axes:
        return "no axes"
    axes = tuple(a for a in axes if not isinstance(a, int))  # positional: reduced on the rank
    if not axes:
        return "positional axes only"
    mesh = _mesh()
    if mesh is None:
        return "not inside shard_map"
    manual = _manual_axes(mesh)
    if any(a not in manual for a in axes):
        return "axis not a manual mesh axis (vmap)"
    if len(set(axes)) != len(axes):
        return "repeated axes"
    for aval in avals:
        if np.dtype(aval.dtype) not in _ffi.SUPPORTED_DTYPES:
            return f"dtype {aval.dtype}"
    return None


def _mesh():
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _manual_axes(mesh) -> tuple:
    from jax.sharding import AxisType

    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)


def _group(opname, axes):
    return _ffi.Group(opname, axes).spec()


def _mesh_order(axes) -> tuple:
    names = _mesh().axis_names
    return tuple(sorted(axes, key=names.index))


# ---------------------------------------------------------------------------
# One router per lax primitive: (args, params) -> strata's result


_POSITIONAL = {"sum": "reduce_sum", "max": "reduce_max", "min": "reduce_min"}


def _reduce(op):
    def route(x, *, axes, axis_index_groups=None):
        from jax import lax

        axes = _axes(axes)
        positional = tuple(a for a in axes if isinstance(a, int))
        if positional:
            # What vmap leaves of a reduction over its axis (lax's lowering
            # also reduces these first, on the rank).
            x = getattr(lax, _POSITIONAL[op])(x, tuple(a % x.ndim for a in positional))
            axes = tuple(a for a in axes if not isinstance(a, int))
        x = _ffi.make_varying(x, axes)
        return all_reduce_bind(x, _group("strata.all_reduce", axes), op, _config.current())

    return route


def _all_gather(invariant):
    def route(x, *, all_gather_dimension, axis_name, axis_size, tiled, axis_index_groups=None):
        axes = _axes(axis_name)
        x = _ffi.make_varying(x, axes)
        return all_gather_p.bind(x, group=_group("strata.all_gather", axes), axis=all_gather_dimension,
                                 tiled=bool(tiled), invariant=invariant, settings=_config.current())

    return route


def _psum_scatter(x, *, axis_name, scatter_dimension, axis_index_groups, axis_size, tiled):
    axes = _axes(axis_name)
    x = _ffi.make_varying(x, axes)
    return reduce_scatter_p.bind(x, group=_group("strata.reduce_scatter", axes), dim=scatter_dimension % x.ndim,
                                 tiled=bool(tiled), op="sum", settings=_config.current())


def _all_to_all(x, *, split_axis, concat_axis, axis_name, axis_index_groups, tiled):
    # lax's primitive is always "tiled" (its wrapper adds and drops the axis).
    axes = _axes(axis_name)
    x = _ffi.make_varying(x, axes)
    return all_to_all_p.bind(x, group=_group("strata.all_to_all", axes), split=split_axis % x.ndim,
                             concat=concat_axis % x.ndim,
                             tiled=True, settings=_config.current())


def _ppermute(x, *, axis_name, perm):
    # lax numbers the ranks of an axis tuple in mesh order (its lowering sorts
    # each group's device ids); strata in the order given: give mesh order.
    axes = _mesh_order(_axes(axis_name))
    group = _group("strata.ppermute", axes)
    pairs = tuple((int(s) % group.size, int(d) % group.size) for s, d in perm)
    x = _ffi.make_varying(x, axes)
    return ppermute_p.bind(x, group=group, pairs=pairs, settings=_config.current())


def _pbroadcast(x, *, axis_name, source):
    axes = _axes(axis_name)
    x = _ffi.make_varying(x, axes)
    return broadcast_p.bind(x, group=_group("strata.broadcast", axes), root=int(source),
                            settings=_config.current())


def _ragged(operand, output, *vectors, axis_name, axis_index_groups=None):
    axes = _axes(axis_name)
    vectors = [v.astype(np.int32) if v.dtype != np.int32 else v for v in vectors]
    args = [_ffi.make_varying(v, axes) for v in (operand, output, *vectors)]
    return ragged_p.bind(*args, group=_group("strata.ragged_all_to_all", axes), settings=_config.current())


def _axes_of(params):
    return _axes(params["axes"] if "axes" in params else params["axis_name"])


_ROUTES = {
    P.psum_p: _reduce("sum"),
    P.psum_invariant_p: _reduce("sum"),
    P.pmax_p: _reduce("max"),
    P.pmin_p: _reduce("min"),
    P.all_gather_p: _all_gather(False),
    P.all_gather_invariant_p: _all_gather(True),
    P.reduce_scatter_p: _psum_scatter,
    P.all_to_all_p: _all_to_all,
    P.ppermute_p: _ppermute,
    P.pbroadcast_p: _pbroadcast,
    P.ragged_all_to_all_p: _ragged,
}


def _check_type(prim, out, expected):
    """The routed result must have lax's type; a mismatch is a bug here."""
    import jax

    got = jax.typeof(out)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        raise AssertionError(f"strata lax routing: {prim} gave {got} where lax gives {expected}")
    want_vma = _ffi.varying_axes(expected)
    have = _ffi.varying_axes(got)
    if have != want_vma:
        if have <= want_vma:
            return _ffi.make_varying(out, tuple(want_vma - have))
        raise AssertionError(f"strata lax routing: {prim} gave {got} where lax gives {expected}")
    return out


def _wrap(prim, route):
    original = prim.bind_with_trace

    def bind_with_trace(trace, args, avals, params, /):
        if (_ffi.lowering_own() or _config.current().lax_collectives != "strata"
                or not isinstance(trace, (pe.DynamicJaxprTrace, pe.JaxprTrace))):
            return original(trace, args, avals, params)
        with core.set_current_trace(trace):
            reason = _why_not(_axes_of(params), avals, params.get("axis_index_groups"))
        if reason is not None:
            _count(_left, f"{prim.name}: {reason}")
            return original(trace, args, avals, params)
        expected, _ = prim.abstract_eval(*avals, **params)
        with core.set_current_trace(trace):
            out = _check_type(prim, route(*args, **params), expected)
        _count(_routed, prim.name)
        return out

    prim.def_bind_with_trace(bind_with_trace)


# jax's caches of traced programs (jit's, scan's and remat's bodies) key on
# its config's trace context, not on strata.config: a JAX config state that
# mirrors the setting puts it in that key, so a function traced with the
# switch off is traced again under it (and the other way round).
_JAX_STATE_NAME = "jax_strata_lax_collectives"
_jax_state = None


def _sync() -> None:
    value = _config.current().lax_collectives
    if _jax_state is not None and _jax_state.value != value:
        import jax

        jax.config.update(_JAX_STATE_NAME, value)


class config(_config.config):
    __doc__ = _config.config.__doc__

    # A statement sets jax's state globally; a `with` block also holds it in
    # jax's thread-local context for its own thread (as jax's config contexts
    # do), so another thread's traces key on that thread's setting.
    def __init__(self, **changes):
        super().__init__(**changes)
        _sync()

    def __enter__(self):
        settings = super().__enter__()
        self._jax_context = _jax_state(_config.current().lax_collectives) if _jax_state is not None else None
        if self._jax_context is not None:
            self._jax_context.__enter__()
        return settings

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        if getattr(self, "_jax_context", None) is not None:
            self._jax_context.__exit__(*exc)
        _sync()
        return result


_installed = False


def install() -> None:
    global _installed, _jax_state
    if _installed:
        return
    _installed = True
    from jax._src import config as jax_config

    _jax_state = jax_config.enum_state(
        _JAX_STATE_NAME, list(_config.LAX_COLLECTIVES), "xla",
        help="Mirror of strata.config(lax_collectives=...), so that jax's trace caches key on it.",
        include_in_jit_key=True, include_in_trace_context=True)
    _sync()
    for prim, route in _ROUTES.items():
        _wrap(prim, route)


__all__ = ["install", "counters", "reset", "config"]
