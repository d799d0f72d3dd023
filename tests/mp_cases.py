"""The checks tests/test_multiprocess.py runs on meshes that span processes
(in tests/mp_worker.py) and on one process (in pytest itself), with numpy
references. A case is a shard_map body, its inputs (random, from a seed: every
process builds the same global arrays) and, where it is simple, the numpy
result. Inputs and outputs are split on dim 0 over all mesh axes, in mesh
order, as tests/conftest.py's shard_run does."""
from __future__ import annotations

import itertools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import stratacl_jax as strata
from random_data import random_array

DTYPES = ["float32", "int32", "float64", "bfloat16", "int8", "uint32", "bool", "float16", "int64", "uint8"]




def members(shape, names, axes, device):
    """(rank, [linear device index of each rank]) of `device`'s group over `axes`."""
    coords = list(np.unravel_index(device, shape))
    dims = [names.index(a) for a in axes]
    out = []
    for sub in itertools.product(*[range(shape[d]) for d in dims]):
        c = list(coords)
        for d, v in zip(dims, sub):
            c[d] = v
        out.append(int(np.ravel_multi_index(c, shape)))
    return out.index(device), out


class Case:
    """ref(*inputs): the numpy result of each output (None: not given);
    same_on_group: outputs that must be bit-identical on every rank of a
    group over `axes`."""

    def __init__(self, name, body, inputs, ref=None, check_vma=True, same_on_group=(), axes=()):
        self.name, self.body, self.inputs, self.ref, self.check_vma = name, body, inputs, ref, check_vma
        self.same_on_group, self.axes = same_on_group, axes


def _blocks(x, n):
    return x.reshape((n, -1) + x.shape[1:])


def cases(shape, names, dtypes_per_set=3, sets=None):
    """Every op over the process axis, the local axes, both (both orders),
    on random data, several dtypes and odd sizes; grads; MoE; ragged. The
    ops of one (axes, dtype) run in one program (one compile per case)."""
    n = math.prod(shape)
    proc, local = names[0], names[1:]
    axis_sets = [(proc,), tuple(local), (proc,) + tuple(local), tuple(local) + (proc,)] if local else [(proc,)]
    out = []
    rng = np.random.default_rng(zlib.crc32(repr((tuple(shape), tuple(names))).encode()))

    def per_device(x, fn):
        b = _blocks(x, n)
        return np.concatenate([fn(d, b) for d in range(n)], axis=0)

    for i, axes in enumerate(axis_sets):
        if sets is not None and i not in sets:
            continue
        tag = "+".join(axes)
        g = math.prod(shape[names.index(a)] for a in axes)
        for j in range(dtypes_per_set):
            dtype = DTYPES[(i * dtypes_per_set + j) % len(DTYPES)]
            rows = 3 if j % 2 else 1
            cols = (5, 7, 9, 11)[(i + j) % 4]
            x = random_array(rng, (n * rows, cols), dtype)
            y = random_array(rng, (n * g * rows, cols), dtype)
            acc = np.int32 if dtype == "bool" else None
            op = ("max", "min")[j % 2]
            root = (g - 1) if j % 2 else min(1, g - 1)
            perm = [(k, (k + 1 + j) % g) for k in range(g) if k != g - 1 or j % 2 == 0]
            perm = [(a, b) for a, b in perm if a != b] or [(0, g - 1)]

            def body(x, y, axes=axes, op=op, root=root, perm=perm, dtype=dtype):
                outs = [strata.all_reduce(x, axes)]
                if dtype != "bool":
                    outs.append(strata.all_reduce(x, axes, op=op))
                outs += [strata.all_gather(x, axes, axis=1, tiled=True),
                         strata.reduce_scatter(y, axes, scatter_dimension=0, tiled=True),
                         strata.all_to_all(y, axes, 0, 1, tiled=True),
                         strata.broadcast(x, axes, root=root),
                         strata.ppermute(x, axes, perm)]
                return tuple(outs)

            def ref(x, y, axes=axes, op=op, root=root, perm=perm, dtype=dtype, g=g, acc=acc):
                def grp(d):
                    return members(shape, names, axes, d)

                bx, by = _blocks(x, n), _blocks(y, n)

                def each(fn):
                    return np.concatenate([fn(d) for d in range(n)], axis=0)

                def pp(d):
                    r, m = grp(d)
                    src = [s for s, t in perm if t == r]
                    return bx[m[src[0]]] if src else np.zeros_like(bx[0])

                outs = [each(lambda d: bx[grp(d)[1]].sum(0, dtype=acc or bx.dtype))]
                if dtype != "bool":
                    outs.append(each(lambda d: getattr(np, op)(bx[grp(d)[1]], axis=0)))
                outs += [each(lambda d: np.concatenate(list(bx[grp(d)[1]]), axis=1)),
                         each(lambda d: np.split(by[grp(d)[1]].sum(0, dtype=acc or by.dtype), g, axis=0)[grp(d)[0]]),
                         each(lambda d: np.concatenate([np.split(by[s], g, axis=0)[grp(d)[0]] for s in grp(d)[1]],
                                                       axis=1)),
                         each(lambda d: bx[grp(d)[1][root]]),
                         each(pp)]
                return outs

            out.append(Case(f"ops[{tag},{dtype}]", body, [x, y], ref, same_on_group=(0, 1) if dtype != "bool" else (0,),
                            axes=axes))
        # prod, mean, untiled forms, other dims, the hierarchical sum, grads.
        xf = random_array(rng, (n * 2, 3), "float32")
        xi = (rng.integers(1, 3, size=(n * 2, 3)) * rng.choice([-1, 1], size=(n * 2, 3))).astype(np.int32)
        xs = random_array(rng, (n * 2, g, 3), "float64")
        big = random_array(rng, (n * 4, 40000), "float32")  # the hierarchical (reduce-scatter first) sum
        w = random_array(rng, (n * 2, 3 * g), "float32")

        def forms(xf, xi, xs, big, w, axes=axes, g=g):
            grad = jax.grad(lambda u: (strata.all_gather(u, axes, axis=1, tiled=True) * w).sum()
                            + (strata.all_reduce(u, axes) ** 2).sum()
                            + strata.broadcast(u * u, axes, root=g - 1).sum()
                            + (strata.reduce_scatter(jnp.tile(u, (1, g)), axes, scatter_dimension=1, tiled=True)
                               * u).sum())(xf)
            return (strata.all_reduce(xf, axes, op="mean"), strata.all_reduce(xi, axes, op="prod"),
                    strata.all_gather(xf, axes, axis=1), strata.reduce_scatter(xs, axes, scatter_dimension=1),
                    strata.reduce_scatter(xs, axes, scatter_dimension=1, op="max"),
                    strata.all_to_all(xs, axes, 1, 2), strata.all_reduce(big, axes), grad)

        def forms_ref(xf, xi, xs, big, w, axes=axes):
            sums = np.concatenate([_blocks(big, n)[members(shape, names, axes, d)[1]].sum(0) for d in range(n)])
            return [None] * 6 + [sums, None]

        out.append(Case(f"forms+grad[{tag}]", forms, [xf, xi, xs, big, w], forms_ref))
        out.append(_moe_case(rng, n, g, axes, tag))
        out.append(_ragged_case(rng, n, g, axes, tag))
    out.append(_scan_vmap_case(rng, n, axis_sets[-1]))
    return out


def _moe_case(rng, n, g, axes, tag):
    t, h, k, el, cap = 6, 5, 2, 2, 5
    e = el * g
    x = random_array(rng, (n * t, h), "float32")
    idx = rng.integers(0, e, size=(n * t, k)).astype(np.int32)
    wts = rng.random((n * t, k)).astype(np.float32)
    ew = random_array(rng, (n * el, h), "float32")

    def body(x, idx, wts, ew, axes=axes):
        def f(x, ew):
            recv, handle = strata.moe.dispatch(x, idx, axis_name=axes, num_experts=e, capacity=cap)
            return strata.moe.combine(jnp.tanh(recv * ew[:, None, :]), handle, wts), (recv, handle)

        y, (recv, handle) = f(x, ew)
        gx, gew = jax.grad(lambda x, ew: (f(x, ew)[0] ** 2).sum(), argnums=(0, 1))(x, ew)
        return (y, gx, gew, recv.reshape(1, -1), handle.recv_counts.reshape(1, -1), handle.dropped.reshape(1, 1),
                handle.pair_slot, handle.slot_source.reshape(1, -1))

    return Case(f"moe[{tag}]", body, [x, idx, wts, ew])


def _ragged_case(rng, n, g, axes, tag):
    rows = out_rows = 2 * g + 1
    cols = 3
    operand = random_array(rng, (n * rows, cols), "float32")
    output = random_array(rng, (n * out_rows, cols), "float32")
    # send_sizes[s][d]: rows rank s sends to rank d (same group shape everywhere).
    sizes = rng.integers(0, 3, size=(g, g))
    in_off = np.concatenate([np.zeros((g, 1), int), np.cumsum(sizes, 1)[:, :-1]], 1)
    out_off = np.concatenate([np.zeros((1, g), int), np.cumsum(sizes, 0)[:-1]], 0)  # receiver d: rows from s
    vecs = [in_off, sizes, out_off, sizes.T]

    def body(op, outp, axes=axes):
        r = lax.axis_index(axes)
        tables = [jnp.asarray(v, jnp.int32)[r] for v in vecs]
        return strata.ragged_all_to_all(op, outp, *tables, axis_name=axes)

    return Case(f"ragged_all_to_all[{tag}]", body, [operand, output])


def _scan_vmap_case(rng, n, axes):
    x = random_array(rng, (n * 2, 4, 3), "float32")

    def body(v, axes=axes):
        def step(c, row):
            return c + strata.all_reduce(row, axes), strata.all_gather(row, axes, tiled=True)

        c, ys = lax.scan(step, jnp.zeros_like(v[:, 0]), jnp.swapaxes(v, 0, 1))
        z = jax.vmap(lambda r: strata.all_reduce(r, axes, op="max"), in_axes=1, out_axes=1)(v)
        return c, ys.reshape(1, -1), z

    return Case(f"scan_vmap[{'+'.join(axes)}]", body, [x])


def run(mesh, case, place):
    """Runs `case` on `mesh`; `place(np_array, sharding)` puts inputs (one or
    several processes); returns the jax outputs."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    spec = P(tuple(mesh.axis_names))
    args = [place(a, NamedSharding(mesh, spec)) for a in case.inputs]
    f = jax.jit(jax.shard_map(case.body, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec,
                              check_vma=case.check_vma))
    return f(*args)
