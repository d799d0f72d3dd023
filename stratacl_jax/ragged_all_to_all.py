"""strata.ragged_all_to_all — the twin of lax.ragged_all_to_all, which XLA:CPU
cannot run (jax#34755).

Rank s sends rows [input_offsets[i], + send_sizes[i]) of `operand` to rank
i // k (k = slices per peer = len(send_sizes) / group size); they land at rows
[output_offsets[i], + send_sizes[i]) of that rank's result (offsets in the
receiver's buffer). Rows nobody writes keep `output`'s values. The sizes are
runtime values: the C++ runtime reads every rank's vectors when the group meets,
checks them (sizes agree with the receivers' recv_sizes, rows fit the buffers:
an error naming the rank otherwise) and runs the exchange as a plan like the
collectives': in strata.config's mode (buffer_centric stages the rows through
the comm buffers), on the NPUs' cores or DMA engines, counted in strata.stats().

The primitive is linear in (operand, output) jointly; its transpose sends the
cotangent's received rows back (a ragged_all_to_all with the roles swapped)
and keeps the cotangent of `output` where nothing was written. Like lax's,
the operand's gradient assumes the slices a rank sends read disjoint rows
(overlapping reads would need their cotangents summed)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import ad

from . import _config
from . import _ffi
from . import _multiprocess as _mp

OPNAME = "strata.ragged_all_to_all"
_INDEX_DTYPES = tuple(np.dtype(d) for d in ("int32", "int64", "uint32", "uint64"))


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=None,
                      *, axis_index_groups=None):
    """lax.ragged_all_to_all's arguments and result (see the module docstring)."""
    if axis_name is None:
        raise TypeError(f"{OPNAME}: axis_name is required")
    if axis_index_groups is not None:
        raise NotImplementedError(f"{OPNAME}: axis_index_groups is not supported; use a mesh axis per group")
    axes = _ffi.normalize_axes(axis_name, OPNAME)
    mesh_axes, vmap_axes = _ffi.split_axes(OPNAME, axes)
    if vmap_axes:
        raise NotImplementedError(f"{OPNAME}: axes {vmap_axes} are vmap axes; like lax's, it runs over mesh axes only")
    group = _ffi.Group(OPNAME, axes).spec()
    operand, output = jnp.asarray(operand), jnp.asarray(output)
    for name, v in (("operand", operand), ("output", output)):
        _ffi.check_dtype(OPNAME, v)
        if v.ndim < 1:
            raise ValueError(f"{OPNAME}: {name} must have a leading (row) axis, got shape {v.shape}")
    if operand.dtype != output.dtype or operand.shape[1:] != output.shape[1:]:
        raise ValueError(f"{OPNAME}: operand {operand.dtype}{list(operand.shape)} and output "
                         f"{output.dtype}{list(output.shape)} must have one dtype and the same row shape")
    vectors = []
    for name, v in (("input_offsets", input_offsets), ("send_sizes", send_sizes),
                    ("output_offsets", output_offsets), ("recv_sizes", recv_sizes)):
        v = jnp.asarray(v)
        if not jnp.issubdtype(v.dtype, jnp.integer):
            raise ValueError(f"{OPNAME}: {name} must be of an integer type, got {v.dtype}")
        if v.ndim != 1 or v.shape[0] < 1 or v.shape[0] % group.size:
            raise ValueError(f"{OPNAME}: {name} must be 1-D with a positive multiple of the group's {group.size} "
                             f"ranks entries, got shape {v.shape}")
        # Kept in their own type (the runtime reads int32/int64/uint32/uint64):
        # a cast to int32 would wrap 2**32 + 2 into 2 and run the wrong rows.
        vectors.append(v if np.dtype(v.dtype) in _INDEX_DTYPES else v.astype(jnp.int32))
    if len({v.shape for v in vectors}) != 1:
        raise ValueError(f"{OPNAME}: offsets and sizes must have one length, got {[v.shape for v in vectors]}")
    args = [_ffi.make_varying(v, axes) for v in (operand, output, *vectors)]
    return ragged_p.bind(*args, group=group, settings=_config.current())


def _abstract_eval(operand, output, *vectors, group, settings):
    return _ffi.typed(output, vma=_ffi.varying_axes(operand) | _ffi.varying_axes(output), weak_type=False)


def _lower(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, group, settings):
    parts = _mp.split(group.axes)
    if parts is not None:
        return _lower_across(operand, output, input_offsets, send_sizes, output_offsets, group, parts[1])
    fn = jax.ffi.ffi_call("strata_ragged_all_to_all", jax.ShapeDtypeStruct(output.shape, output.dtype),
                          input_output_aliases={1: 0})
    return fn(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group.meta(),
              site_id=np.int64(_ffi.next_site_id("strata_ragged_all_to_all", group.axes, group.others, operand.shape,
                                                      operand.dtype, output.shape)), group_size=np.int32(group.size),
              num_devices=np.int32(group.num_devices),
              timeout_ms=_ffi.timeout_ms(settings),
              # Order: RaggedParam in xla_ffi/bindings/ragged_handlers.cc.
              params=np.asarray([_ffi._MODE_CODE[settings.mode], settings.cores_per_npu,
                                 settings.sdma_engines_per_npu, _ffi._PLANNER_CODE[settings.planner],
                                 settings.comm_buffer_bytes], dtype=np.int64))


def _lower_across(operand, output, input_offsets, send_sizes, output_offsets, group, crossing):
    """Over axes that cross processes (lax.ragged_all_to_all cannot run on
    XLA:CPU, jax#34755): XLA all-gathers every rank's operand and offsets
    between processes and each rank places the rows sent to it. Correct for
    any layout; it moves n times the operand, so it is a fallback, not a
    fast path."""
    what = _mp.describe(OPNAME, group.axes, crossing)
    axes = group.axes
    n = group.size

    def gathered(v):
        return lax.all_gather(v, axes, axis=0)

    ops = _mp.cross(gathered, operand, axes, what)  # [n, N, ...]
    # Compared in the widest integer type at hand, so no offset wraps.
    wide = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    vectors = jnp.stack([v.astype(wide) for v in (input_offsets, send_sizes, output_offsets)])
    offsets = _mp.cross(gathered, vectors, axes, what)  # [n, 3, n]
    me = lax.axis_index(axes)
    rows = jnp.arange(output.shape[0], dtype=wide)
    out = output
    for src in range(n):
        start_in, size, start_out = (offsets[src, i, me] for i in range(3))
        at = rows - start_out.astype(rows.dtype)
        take = (at >= 0) & (at < size.astype(rows.dtype))
        source = jnp.clip(at + start_in.astype(rows.dtype), 0, operand.shape[0] - 1)
        picked = jnp.take(ops[src], source, axis=0)
        out = jnp.where(take.reshape((-1,) + (1,) * (out.ndim - 1)), picked, out)
    return out


def _jvp(primals, tangents, *, group, settings):
    operand, output, *vectors = primals
    t_operand, t_output, *_ = tangents
    y = ragged_p.bind(operand, output, *vectors, group=group, settings=settings)
    t_operand, t_output = ad.instantiate_zeros(t_operand), ad.instantiate_zeros(t_output)
    return y, ragged_p.bind(t_operand, t_output, *vectors, group=group, settings=settings)


def received_rows(num_rows, offsets, sizes):
    """Mask of the rows [offsets[i], + sizes[i]) over a buffer of num_rows."""
    rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
    return jnp.any((rows >= offsets[None, :]) & (rows < (offsets + sizes)[None, :]), axis=1)


def _transpose(ct, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, group, settings):
    for v in (input_offsets, send_sizes, output_offsets, recv_sizes):
        if ad.is_undefined_primal(v):
            raise ValueError(f"{OPNAME}: offsets and sizes are not differentiable")
    want_operand, want_output = ad.is_undefined_primal(operand), ad.is_undefined_primal(output)
    if type(ct) is ad.Zero:
        return [ad.Zero(operand.aval) if want_operand else None,
                ad.Zero(output.aval) if want_output else None] + [None] * 4
    all_to_all = _ffi.registered("strata_all_to_all").api
    # Where this rank received (the senders' output_offsets for it), and where
    # each sender took those rows from.
    received_at = all_to_all(output_offsets, group.axes, 0, 0, tiled=True)
    taken_from = all_to_all(input_offsets, group.axes, 0, 0, tiled=True)
    operand_ct = output_ct = None
    if want_operand:
        zeros = _ffi.make_varying(jnp.zeros(operand.aval.shape, operand.aval.dtype), group.axes)
        operand_ct = ragged_p.bind(ct, zeros, received_at, recv_sizes, taken_from, send_sizes,
                                   group=group, settings=settings)
    if want_output:
        written = received_rows(ct.shape[0], received_at, recv_sizes).reshape((-1,) + (1,) * (ct.ndim - 1))
        output_ct = jnp.where(written, jnp.zeros_like(ct), ct)
    return [operand_ct, output_ct] + [None] * 4


def _batch(axis_data, vals, dims, *, group, settings):
    """B independent exchanges as one: the batch is merged into the rows and
    every slice gets one entry per batch element (lax's batching rule)."""
    if all(d is None for d in dims):
        return ragged_p.bind(*vals, group=group, settings=settings), None
    size = axis_data.size

    def rows_first(x, d):
        x = jnp.broadcast_to(x, (size,) + x.shape) if d is None else _ffi.move_batch_to_front(x, d)
        return x

    operand, output = (rows_first(v, d) for v, d in zip(vals[:2], dims[:2]))
    n_rows, m_rows = operand.shape[1], output.shape[1]

    def entries_by_batch(v, d):  # [K, B]
        return jnp.broadcast_to(v[:, None], (v.shape[0], size)) if d is None else jnp.moveaxis(v, d, 1)

    io, ss, oo, rs = (entries_by_batch(v, d) for v, d in zip(vals[2:], dims[2:]))
    batch_index = jnp.arange(size, dtype=jnp.int32)[None, :]
    io = io + batch_index * n_rows
    oo = oo + batch_index * m_rows
    merged = [operand.reshape((-1,) + operand.shape[2:]), output.reshape((-1,) + output.shape[2:])]
    merged += [v.reshape(-1) for v in (io, ss, oo, rs)]
    out = ragged_p.bind(*merged, group=group, settings=settings)
    return out.reshape((size, m_rows) + output.shape[2:]), 0


ragged_p = _ffi.primitive("strata_ragged_all_to_all", _abstract_eval, _lower, jvp=_jvp, transpose=_transpose,
                          batch=_batch, api=ragged_all_to_all)
