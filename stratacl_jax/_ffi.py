"""One mechanism every collective shares: find the caller's group and rank in
the shard_map mesh, define the op as a JAX primitive (abstract evaluation with
the twin's varying/invariant typing, CPU lowering, AD and batching rules), and
issue the FFI custom call with the attributes the C++ runtime needs."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType

from . import _config
from . import _core
from . import _multiprocess
# The op modules (and moe/) reach these as _ffi.*, beside the rest of the machinery.
from ._group import GroupSpec, make_varying, varying_axes  # noqa: F401

# Register every handler once, for the CPU platform (emulated NPUs are CPU devices).
# The state type first: each target's instantiate stage gives every custom-call
# instruction its own identity, which the ranks meet by.
# jaxlib 0.10.2 installs its deferred CPU handlers for targets before the one
# for types when the backend starts, so a type registered before the backend
# reaches XLA only after the targets that use it, which XLA rejects. Install
# the type handler now (make_cpu_client then keeps ours: the same function).
from jax._src.lib import xla_client as _xla_client  # noqa: E402

_xla_client.register_custom_type_handler("cpu", _xla_client._xla.register_custom_type)
jax.ffi.register_ffi_type("strata_site_instance", _core.site_instance_type(), platform="cpu")
for _name, _capsule in _core.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

# The extension's code tables (xla_ffi/runtime), not copies of them.
REDUCE_OPS = {k: v for k, v in _core.reduce_ops().items() if k != "none"}
NO_REDUCTION = _core.reduce_ops()["none"]
_MODE_CODE = _core.mode_codes()
_PLANNER_CODE = _core.planner_codes()

SUPPORTED_DTYPES = tuple(
    np.dtype(d)
    for d in ("float32", "float64", "float16", jnp.bfloat16, "complex64", "complex128", "int8", "int32",
              "int64", "uint8", "uint32", "bool")
)

def next_site_id(*parts) -> int:
    """The id of a call site (named in errors and traces): a stable hash of
    what the op is (`parts`: target, axes, shapes, dtypes, static arguments)
    and where the user called it, so every process names one op alike, in
    whatever order each traced its programs. Two instructions with one id
    (the same op at the same place, e.g. both branches of a cond) are told
    apart by their FFI instance, which is what ranks meet by."""
    return _multiprocess.stable_site_id(*parts)


def check_axis_index_groups(opname: str, axis_index_groups) -> None:
    """lax's `axis_index_groups=None` is accepted; groups are not."""
    if axis_index_groups is not None:
        raise NotImplementedError(
            f"{opname}: axis_index_groups={axis_index_groups!r} is not supported (only None); use a mesh axis "
            f"per group (a 2-D mesh and a collective over one of its axes)")


def is_constant(x) -> bool:
    """True when no leaf of `x` is a JAX tracer: lax.psum folds such a sum
    to the axis size times the value without communicating."""
    return all(not isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def normalize_axes(axis_name, opname: str = "strata") -> tuple:
    """`axis_name` as a tuple of mesh axis names; anything but a str or a
    tuple/list of str is the op's TypeError (lax reads an int as a positional
    array axis, which no collective has)."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    for a in axes:
        if not isinstance(a, str):
            raise TypeError(
                f"{opname}: axis_name must be a mesh axis name (a str) or a tuple of them, got {axis_name!r}"
                + (" (an int is a positional array axis in jax.lax, not a mesh axis)"
                   if isinstance(a, (int, np.integer)) else ""))
    return axes


def static_int(opname: str, name: str, value, *, lo: int | None = None, hi: int | None = None) -> int:
    """A static integer argument (a Python or numpy integer, not a bool or a
    float) as an int in [lo, hi), or the op's error naming the argument."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{opname}: {name} must be an int, got {value!r} ({type(value).__name__})")
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v >= hi):
        raise ValueError(f"{opname}: {name} must be in [{lo}, {hi}), got {v}")
    return v


def check_dtype(opname: str, x, *, reduce_op: str | None = None) -> None:
    dtype = np.dtype(x.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{opname}: dtype {dtype} is not supported; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if reduce_op is not None:
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"{opname}: op must be one of {tuple(REDUCE_OPS)}, got {reduce_op!r}")
        if np.issubdtype(dtype, np.complexfloating) and reduce_op in ("max", "min"):
            raise TypeError(f"{opname}: complex numbers have no {reduce_op} (op={reduce_op!r}), as in jax.lax")


def split_axes(opname: str, axes: tuple) -> tuple[tuple, tuple]:
    """(mesh axes, vmap axes): names bound by shard_map's manual mesh axes, and
    names bound only by an enclosing jax.vmap(axis_name=...), which need no
    communication (the batch is on this rank) and go to the lax twin."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set() if mesh.empty else {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual}
    vmapped = []
    for a in axes:
        if a in manual:
            continue
        try:
            lax.axis_size(a)
        except NameError:
            continue  # unbound: Group reports it with the op's name
        vmapped.append(a)
    return tuple(a for a in axes if a not in vmapped), tuple(vmapped)


class Group(GroupSpec):
    """The caller's group for a collective over `axes` of the current mesh;
    raises the op's error when there is none."""

    def __init__(self, opname: str, axis_name):
        axes = normalize_axes(axis_name, opname)
        mesh = jax.sharding.get_abstract_mesh()
        manual = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual] if not mesh.empty else []
        if not manual:
            raise NameError(
                f"{opname} must be called inside jax.shard_map (under jax.jit); there is no mesh axis "
                f"{axes!r} here")
        for a in axes:
            if a not in manual:
                raise NameError(
                    f"{opname}: unbound axis name {a!r}; the shard_map's mesh axes are {tuple(manual)}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{opname}: axis names repeat in {axes!r}")
        shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
        # num_devices sizes the check of XLA's thread pool (CheckPool): each
        # process's pool serves only its own devices of the mesh.
        super().__init__(axes, math.prod(shape[a] for a in axes), tuple(a for a in manual if a not in axes),
                         local_mesh_devices(mesh.size))
        object.__setattr__(self, "opname", opname)

    def spec(self) -> GroupSpec:
        return GroupSpec(self.axes, self.size, self.others, self.num_devices)


def local_mesh_devices(mesh_size: int) -> int:
    """Devices of a mesh of `mesh_size` that run in this process (all of
    them with one process)."""
    if _multiprocess.process_count() <= 1:
        return mesh_size
    return min(mesh_size, jax.local_device_count())


def vma_checked(x, axes) -> bool:
    """True when shard_map tracks varying axes (check_vma=True) for x."""
    return set(axes) <= varying_axes(x)


def typed(aval, shape=None, vma=None, weak_type=None):
    """`aval` with another shape, varying set or weak type (what abstract
    evals return; like lax's, a weakly typed operand stays weak unless the
    twin says otherwise)."""
    kw = {}
    if shape is not None:
        kw["shape"] = tuple(shape)
    if weak_type is not None:
        kw["weak_type"] = weak_type
    if vma is not None and getattr(aval, "mat", None) is not None:
        kw["manual_axis_type"] = aval.mat.update(varying=frozenset(vma))
    return aval.update(**kw)


def call(target: str, group, x, out_shape, *, block_elems: int, out_vma: frozenset | None = None,
         reduce_op: int = NO_REDUCTION, root: int = 0, perm: Sequence[int] = (), settings=None):
    """Issues one collective custom call on an operand laid out
    [rows, blocks_in, block] (any shape whose bytes are that); the result has
    `out_shape`, [rows, blocks_out, block] bytes. Called while lowering a
    primitive, where types need not be set (out_vma None); typed varying over
    `out_vma` otherwise. `settings`: the strata.config in force when the op
    was traced (default: now)."""
    s = settings if settings is not None else _config.current()
    fn = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(tuple(out_shape), x.dtype))
    y = fn(
        x,
        group.meta(),
        site_id=np.int64(next_site_id(target, group.axes, group.others, x.shape, x.dtype, tuple(out_shape),
                                      reduce_op, root, tuple(perm))),
        perm=np.asarray(perm, dtype=np.int32).reshape(-1),
        # One attribute for the static rest: XLA decodes every attribute by
        # name on every call of every rank (13 of them cost ~0.4 us per rank
        # per op). Order: CollectiveParam in xla_ffi/bindings/handlers.cc.
        params=np.asarray([reduce_op, root, group.size, group.num_devices,
                           block_elems * np.dtype(x.dtype).itemsize, _MODE_CODE[s.mode],
                           s.cores_per_npu, s.sdma_engines_per_npu, _PLANNER_CODE[s.planner],
                           s.comm_buffer_bytes, int(timeout_ms(s))], dtype=np.int64),
    )
    # ffi_call results are typed invariant; give them the twin's type.
    return make_varying(y, tuple(out_vma)) if out_vma else y


def timeout_ms(settings) -> np.int64:
    return np.int64(max(1, round(settings.timeout_s * 1000)))


_own = threading.local()


@contextlib.contextmanager
def _lowering_own():
    prev = getattr(_own, "lowering", False)
    _own.lowering = True
    try:
        yield
    finally:
        _own.lowering = prev


def lowering_own() -> bool:
    """True while strata lowers one of its own primitives on this thread: the
    lax collectives bound then (its cross-process steps use them on purpose)
    stay lax's (_lax_routing reads this)."""
    return getattr(_own, "lowering", False)


@dataclasses.dataclass(frozen=True)
class Registered:
    """One of strata's ops, as its module defined it."""
    primitive: Primitive
    lower: Callable  # lower(*operands, **params): the lowering's body, for ops composed of others
    api: Callable | None  # the public function (strata.all_gather, ...)


# Strata's ops by primitive name. An op's rules reach another op (a transpose
# its twin, a JVP a gather) through here instead of importing its module, as
# lax's rules name their twins' primitives: the op modules import none of each
# other. Every op module is imported with the package, before any rule runs.
_REGISTRY: dict[str, Registered] = {}


def registered(name: str) -> Registered:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LookupError(f"no strata primitive {name!r} is registered; registered: {sorted(_REGISTRY)}") from None


def primitive(name: str, abstract_eval, lower, *, jvp=None, transpose=None, batch=None, api=None,
              multiple_results: bool = False):
    """A JAX primitive for one collective: abstract evaluation, a CPU lowering
    (`lower(*operands, **params)` traced into the FFI call), and the rules.
    Without `jvp` the op is linear (the JVP applies it to the tangent) and
    `transpose(ct, *operands, **params)` is its transpose. Registered under
    `name` with its public function `api` (see `registered`). With
    `multiple_results`, abstract_eval and lower return lists (MoE dispatch's
    rows and handle)."""
    if name in _REGISTRY:
        raise ValueError(f"strata primitive {name!r} is defined twice")
    p = Primitive(name)
    p.multiple_results = multiple_results
    p.def_abstract_eval(abstract_eval)
    lowered = mlir.lower_fun(lower, multiple_results=multiple_results)

    def rule(ctx, *args, **params):
        # The mesh's process layout and the op's source location, for ops
        # whose group crosses processes (_multiprocess.split) and site ids.
        with _multiprocess.lowering(ctx), _lowering_own():
            return lowered(ctx, *args, **params)

    mlir.register_lowering(p, rule, platform="cpu")
    if jvp is None:
        ad.deflinear2(p, transpose)
    else:
        ad.primitive_jvps[p] = jvp
        if transpose is not None:
            ad.primitive_transposes[p] = transpose
    if batch is not None:
        batching.fancy_primitive_batchers[p] = batch
    _REGISTRY[name] = Registered(p, lower, api)
    return p


def move_batch_to_front(x, d):
    return x if d == 0 else jnp.moveaxis(x, d, 0)


# ---------------------------------------------------------------------------
# Rules several ops share


def product_of_others(x, group):
    """Π_{s≠r} x_s on rank r, exact (no division, so zeros are fine): the
    tangent weight of a product (all_reduce's and reduce_scatter's JVPs)."""
    everyone = registered("strata_all_gather").api(x, group.axes)
    own = (jnp.arange(group.size) == group.rank()).reshape((-1,) + (1,) * x.ndim)
    return jnp.prod(jnp.where(own, jnp.ones_like(everyone), everyone), axis=0)
