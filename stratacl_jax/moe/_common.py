"""What the MoE ops share: their names, the handle dispatch returns and
combine reads, the FFI call with the runtime settings, the typing and
batching of their primitives, and the order in which combine sums (which the
cross-process path and the reference follow too)."""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from .. import _ffi

DISPATCH = "strata.moe.dispatch"
COMBINE = "strata.moe.combine"
LAYER = "strata.moe.expert_parallel_ffn"

COMBINE_DTYPES = tuple(np.dtype(d) for d in ("float32", "float64", "float16", jnp.bfloat16))


@partial(jax.tree_util.register_dataclass,
         data_fields=["recv_counts", "dropped", "pair_slot", "slot_source"],
         meta_fields=["axis_name"])
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to undo a dispatch. A pytree of int32 arrays (it
    flows through jit, shard_map and scan); ``axis_name`` is static.

    recv_counts [E_local]:    valid rows per local expert (capped at capacity).
    dropped []:               this rank's (token, k) pairs that found their expert full.
    pair_slot [T, K]:         per pair, ``e * capacity + row`` of the row it filled, -1 if dropped.
    slot_source [E_local, C]: per row, ``(source_rank * T + t) * K + k``, -1 if empty.
    """

    recv_counts: jax.Array
    dropped: jax.Array
    pair_slot: jax.Array
    slot_source: jax.Array
    axis_name: tuple = ()

    @property
    def capacity(self) -> int:
        return self.slot_source.shape[-1]

    @property
    def local_experts(self) -> int:
        return self.slot_source.shape[-2]


def weight_dtype(rows_dtype):
    """Weights (and their sums) are float64 for float64 rows, float32 otherwise."""
    return jnp.float64 if np.dtype(rows_dtype) == np.float64 else jnp.float32


def call(target, group, s, operands, results, **attrs):
    """One MoE custom call, issued while lowering a primitive: the group's
    (rank, group) operand and the runtime settings `s` the op was traced with
    (mode="buffer_centric" stages rows through communication buffers, as the
    vendor-library baseline does)."""
    fn = jax.ffi.ffi_call(target, results)
    return fn(
        *operands,
        group.meta(),
        site_id=np.int64(_ffi.next_site_id(target, group.axes, group.others,
                                           *[(o.shape, o.dtype) for o in operands], attrs)),
        group_size=np.int32(group.size),
        num_devices=np.int32(group.num_devices),
        cores=np.int32(s.cores_per_npu),
        engines=np.int32(s.sdma_engines_per_npu),
        mode=np.int32(_ffi._MODE_CODE[s.mode]),
        comm_buffer_bytes=np.int64(s.comm_buffer_bytes),
        timeout_ms=_ffi.timeout_ms(s),
        **attrs,
    )


def out_aval(like, shape, dtype, *operands):
    """An abstract result: `shape` and `dtype`, varying over every axis any
    of `operands` varies over (the twin's typing: per-rank data)."""
    vma = frozenset().union(*(_ffi.varying_axes(o) for o in operands))
    return _ffi.typed(like.update(dtype=np.dtype(dtype)), shape=shape, vma=vma, weak_type=False)


def zero_tangent(value):
    """The symbolic zero tangent of `value` (float0 for integers)."""
    return ad.Zero(jax.typeof(value).to_tangent_aval())


def zeros_for(aval, axes):
    """Zeros in the place of an operand a transpose does not solve for (the
    backward op computes both cotangents; one of them is thrown away)."""
    return _ffi.make_varying(jnp.zeros(aval.shape, aval.dtype), tuple(_ffi.varying_axes(aval) | set(axes)))


def each_in_turn(name):
    """The batching rule of primitive `name`: a batch of independent exchanges,
    one after another (lax.map, so every rank meets its peers in the same
    order), each one rendezvous of the group; unbatched operands are shared."""

    def rule(axis_data, vals, dims, **params):
        prim = _ffi.registered(name).primitive
        mapped = [_ffi.move_batch_to_front(v, d) for v, d in zip(vals, dims) if d is not None]

        def one(slices):
            it = iter(slices)
            return prim.bind(*[next(it) if d is not None else v for v, d in zip(vals, dims)], **params)

        out = lax.map(one, mapped)
        return out, ([0] * len(out) if prim.multiple_results else 0)

    return rule


def sum_by_rank(rows, weights, owner, dtype):
    """combine's sum in the runtime's order (moe.cc): per token, from zero, in
    ascending rank order, each rank's contribution added in the accumulation
    type of ``weights``: weight x row for a rank holding one of the token's
    pairs; for several, their partial (weight x row summed from zero in k
    order) rounded to ``dtype`` (the row that crosses back); the sum rounded
    to ``dtype``. rows [T, K, H]; weights [T, K]; owner [T, K]: the rank
    holding the pair's row, -1 if dropped."""
    t, k, h = rows.shape
    acc_dtype = weights.dtype
    last = jnp.iinfo(jnp.int32).max  # dropped pairs sort after every rank
    key = jnp.where(owner >= 0, owner, last).astype(jnp.int32)
    order = jnp.argsort(key, axis=1, stable=True)  # by rank, then k
    key = jnp.take_along_axis(key, order, axis=1)
    rows = jnp.take_along_axis(rows, order[..., None], axis=1)
    w = jnp.take_along_axis(weights, order, axis=1)
    acc = jnp.zeros((t, h), acc_dtype)
    part = jnp.zeros((t, h), acc_dtype)
    count = jnp.zeros((t, 1), jnp.int32)  # pairs in the rank's group so far
    for j in range(k):
        part = part + w[:, j, None] * rows[:, j].astype(acc_dtype)
        count = count + 1
        following = key[:, j + 1] if j + 1 < k else jnp.full((t,), last, jnp.int32)
        ends = ((key[:, j] != following) & (key[:, j] != last))[:, None]  # a rank's group ends here
        rounded = part.astype(dtype).astype(acc_dtype)
        acc = jnp.where(ends, acc + jnp.where(count == 1, part, rounded), acc)
        part = jnp.where(ends, jnp.zeros((), acc_dtype), part)
        count = jnp.where(ends, 0, count)
    return acc.astype(dtype)

