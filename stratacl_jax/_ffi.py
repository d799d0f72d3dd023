"""One mechanism every collective shares: find the caller's group and rank in
the shard_map mesh, type results as jax.lax types its twin's, and issue the
FFI custom call with the attributes the C++ runtime needs."""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType

from . import _config
from . import _core

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

REDUCE_OPS = {"sum": 0, "max": 1, "min": 2, "prod": 3}
NO_REDUCTION = 4
_MODE_CODE = {"strata": 0, "buffer_centric": 1}
_PLANNER_CODE = {"balanced": 0, "naive": 1}

SUPPORTED_DTYPES = tuple(
    np.dtype(d)
    for d in ("float32", "float64", "float16", jnp.bfloat16, "int8", "int32", "int64", "uint8", "uint32", "bool")
)

# Call-site ids: each traced op gets its own, so the runtime never confuses two
# collectives that XLA runs concurrently in one program.
_site_ids = itertools.count(1)


def normalize_axes(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def check_dtype(opname: str, x, *, reduce_op: str | None = None) -> None:
    dtype = np.dtype(x.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{opname}: dtype {dtype} is not supported; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if reduce_op is not None:
        if reduce_op not in REDUCE_OPS:
            raise ValueError(f"{opname}: op must be one of {tuple(REDUCE_OPS)}, got {reduce_op!r}")
        if dtype == np.bool_:
            raise TypeError(f"{opname}: dtype bool cannot be reduced (op={reduce_op!r}); cast it first")


class Group:
    """The caller's group for a collective over `axes` of the current mesh."""

    def __init__(self, opname: str, axis_name):
        self.opname = opname
        self.axes = normalize_axes(axis_name)
        mesh = jax.sharding.get_abstract_mesh()
        manual = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual] if not mesh.empty else []
        if not manual:
            raise NameError(
                f"{opname} must be called inside jax.shard_map (under jax.jit); there is no mesh axis "
                f"{self.axes!r} here")
        for a in self.axes:
            if a not in manual:
                raise NameError(
                    f"{opname}: unbound axis name {a!r}; the shard_map's mesh axes are {tuple(manual)}")
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"{opname}: axis names repeat in {self.axes!r}")
        shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
        self.size = math.prod(shape[a] for a in self.axes)
        self.others = tuple(a for a in manual if a not in self.axes)
        self.num_devices = mesh.size

    def rank(self):
        return lax.axis_index(self.axes)

    def meta(self):
        """(rank in group, group id) as the int32 operand the handler reads."""
        group = lax.axis_index(self.others) if self.others else jnp.int32(0)
        return jnp.stack([self.rank(), group]).astype(jnp.int32)


def varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def make_varying(x, axes: Sequence):
    """Types x as varying over `axes` (as lax does before a collective)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def vma_checked(x, axes) -> bool:
    """True when shard_map tracks varying axes (check_vma=True) for x."""
    return set(axes) <= varying_axes(x)


def call(target: str, group: Group, x, out_shape, *, block_elems: int, out_vma: frozenset,
         reduce_op: int = NO_REDUCTION, root: int = 0, perm: Sequence[int] = ()):
    """Issues one collective custom call on a normalised operand.

    `x` is laid out [blocks_in, block] (leading batch dims allowed under vmap);
    the result [blocks_out, block] is typed varying over `out_vma`.
    """
    s = _config.current()
    fn = jax.ffi.ffi_call(
        target,
        jax.ShapeDtypeStruct(out_shape, x.dtype),
        vmap_method="expand_dims",
    )
    y = fn(
        x,
        group.meta(),
        site_id=np.int64(next(_site_ids)),
        reduce_op=np.int32(reduce_op),
        root=np.int32(root),
        perm=np.asarray(perm, dtype=np.int32).reshape(-1),
        group_size=np.int32(group.size),
        num_devices=np.int32(group.num_devices),
        block_bytes=np.int64(block_elems * np.dtype(x.dtype).itemsize),
        mode=np.int32(_MODE_CODE[s.mode]),
        cores=np.int32(s.cores_per_npu),
        engines=np.int32(s.sdma_engines_per_npu),
        planner=np.int32(_PLANNER_CODE[s.planner]),
        comm_buffer_bytes=np.int64(s.comm_buffer_bytes),
        timeout_ms=np.int64(max(1, round(s.timeout_s * 1000))),
    )
    # ffi_call results are typed invariant; give them the twin's type.
    return make_varying(y, tuple(a for a in out_vma)) if out_vma else y


def linear_collective(forward, transpose, num_static: int):
    """The op `forward(x, *static)` as a differentiable JAX function, for the
    collectives that are linear in x: the VJP is `transpose(ct, *static)` and
    needs no residuals. (all_reduce keeps its own rule: max/min/prod are not
    linear.)"""
    op = jax.custom_vjp(forward, nondiff_argnums=tuple(range(1, 1 + num_static)))
    op.defvjp(lambda x, *static: (forward(x, *static), None),
              lambda *args: (transpose(args[-1], *args[:num_static]),))
    return op
