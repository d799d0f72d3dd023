"""Differential fuzz: a random collective (op, dtype, per-rank shape with odd
and empty dims, mesh, axes, mode, planner, streaming threshold) against its
jax.lax twin, on random data.

Derandomized (the same examples every run, so CI is reproducible);
STRATA_FUZZ_EXAMPLES=N runs more (e.g. 500 locally), STRATA_FUZZ_RANDOM=1
draws fresh ones.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_array, shard_run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from stratacl_jax import _core

DTYPES = ["float32", "float64", "float16", jnp.bfloat16, "int8", "int32", "int64", "uint8", "uint32", "bool"]
REDUCE = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


def assert_close(got, want, dtype, op, n):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    dtype = np.dtype(dtype)
    if op == "sum" and (np.issubdtype(dtype, np.floating) or dtype == jnp.bfloat16):
        eps = {2: 1e-2, 4: 1e-5, 8: 1e-12}[dtype.itemsize]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=eps * n, atol=eps * n * 4)
    else:
        np.testing.assert_array_equal(got, want)


@st.composite
def cases(draw):
    mesh_shape = draw(st.sampled_from([(8,), (2, 4)]))
    names = ("x",) if mesh_shape == (8,) else ("node", "npu")
    axes = draw(st.sampled_from([names[0]] if len(names) == 1 else [names[0], names[1], names]))
    n = 8 if axes == names else dict(zip(names, mesh_shape))[axes]
    op = draw(st.sampled_from(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute"]))
    reduces = op in ("all_reduce", "reduce_scatter")
    dtype = draw(st.sampled_from([d for d in DTYPES if not (reduces and d == "bool")]))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.sampled_from([0, 1, 2, 3, 5, 7, 9])) for _ in range(ndim)]
    params = {}
    if op == "all_reduce":
        params["op"] = draw(st.sampled_from(sorted(REDUCE)))
    elif op == "all_gather":
        params["tiled"] = draw(st.booleans())
        params["axis"] = draw(st.integers(0, ndim - 1 if params["tiled"] else ndim))
    elif op == "reduce_scatter":
        params["tiled"] = draw(st.booleans())
        params["scatter_dimension"] = d = draw(st.integers(0, ndim - 1))
        shape[d] = n * draw(st.sampled_from([1, 2, 3])) if params["tiled"] else n
    elif op == "all_to_all":
        params["tiled"] = draw(st.booleans())
        params["split_axis"] = s = draw(st.integers(0, ndim - 1))
        params["concat_axis"] = draw(st.integers(0, ndim - 1))
        shape[s] = n * draw(st.sampled_from([1, 2])) if params["tiled"] else n
    elif op == "broadcast":
        params["root"] = draw(st.integers(0, n - 1))
    else:
        targets = draw(st.permutations(range(n)))
        keep = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        params["perm"] = [(i, t) for i, t, k in zip(range(n), targets, keep) if k]
    mode = draw(st.sampled_from(["strata", "buffer_centric"]))
    comm = draw(st.sampled_from([200 << 20, 4096])) if mode == "buffer_centric" else 200 << 20
    return dict(mesh_shape=mesh_shape, names=names, axes=axes, n=n, op=op, dtype=dtype, shape=tuple(shape),
                params=params, mode=mode, comm_buffer_bytes=comm,
                planner=draw(st.sampled_from(["balanced", "naive"])),
                cores=draw(st.sampled_from([1, 3, 48])),
                stream_bytes=draw(st.sampled_from([0, -1])),  # always stream, or the default
                seed=draw(st.integers(0, 2**31 - 1)))


def twin(case):
    op, axes, p = case["op"], case["axes"], case["params"]
    if op == "all_reduce":
        return lambda v: REDUCE[p["op"]](v, axes)
    if op == "all_gather":
        return lambda v: lax.all_gather(v, axes, axis=p["axis"], tiled=p["tiled"])
    if op == "reduce_scatter":
        return lambda v: lax.psum_scatter(v, axes, scatter_dimension=p["scatter_dimension"], tiled=p["tiled"])
    if op == "all_to_all":
        return lambda v: lax.all_to_all(v, axes, p["split_axis"], p["concat_axis"], tiled=p["tiled"])
    if op == "broadcast":
        return lambda v: lax.all_gather(v, axes)[p["root"]]
    return lambda v: lax.ppermute(v, axes, p["perm"])


def ours(case):
    op, axes, p = case["op"], case["axes"], case["params"]
    fn = getattr(strata, op)
    if op == "all_to_all":
        return lambda v: fn(v, axes, p["split_axis"], p["concat_axis"], tiled=p["tiled"])
    if op == "ppermute":
        return lambda v: fn(v, axes, p["perm"])
    return lambda v: fn(v, axes, **p)


_MESHES = {}


def mesh_for(shape, names):
    if shape not in _MESHES:
        _MESHES[shape] = strata.emulator.make_mesh(shape, names)
    return _MESHES[shape]


@settings(max_examples=int(os.environ.get("STRATA_FUZZ_EXAMPLES", "40")),
          derandomize=not os.environ.get("STRATA_FUZZ_RANDOM"), database=None, deadline=None,
          suppress_health_check=list(HealthCheck), print_blob=True)
@given(cases())
def test_random_collective_matches_lax(case):
    mesh = mesh_for(case["mesh_shape"], case["names"])
    local = case["shape"]
    x = random_array(np.random.default_rng(case["seed"]), (8 * local[0],) + local[1:], case["dtype"])
    reduce_op = case["params"].get("op", "sum") if case["op"] in ("all_reduce", "reduce_scatter") else None
    if reduce_op == "sum" and np.dtype(case["dtype"]) in (np.float16, jnp.bfloat16):
        # Sums of 16-bit floats: both sides round, in different orders.
        x = (x / 8).astype(x.dtype)
    # Each rank's result under a new leading dim: results of any rank (an
    # untiled reduce_scatter's may be 0-d) stack along it.
    stacked = lambda f: (lambda v: f(v)[None])  # noqa: E731
    if x.size:
        want = shard_run(stacked(twin(case)), mesh, x)
    else:  # XLA rejects some lax collectives of empty arrays; the shape is the twin's
        spec = P(tuple(mesh.axis_names))
        aval = jax.eval_shape(jax.shard_map(stacked(twin(case)), mesh=mesh, in_specs=spec, out_specs=spec),
                              jax.ShapeDtypeStruct(x.shape, x.dtype))
        want = np.zeros(aval.shape, aval.dtype)
    previous = _core.set_streaming_threshold_bytes(case["stream_bytes"])
    try:
        with strata.config(mode=case["mode"], planner=case["planner"], cores_per_npu=case["cores"],
                           sdma_engines_per_npu=case["cores"], comm_buffer_bytes=case["comm_buffer_bytes"]):
            got = shard_run(stacked(ours(case)), mesh, x)
    finally:
        _core.set_streaming_threshold_bytes(previous)
    assert_close(got, want, case["dtype"], reduce_op, case["n"])
