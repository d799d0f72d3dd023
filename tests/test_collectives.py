"""Every collective against its jax.lax twin on random data, in one jitted
shard_map: dtypes, sizes from one element to MBs, 1-D and 2-D meshes with
each axis and both, tiled both ways, every valid axis."""
import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_array, shard_run
from jax import lax

import stratacl_jax as strata

ALL_DTYPES = ["float32", "float64", "float16", jnp.bfloat16, "int8", "int32", "int64", "uint8", "uint32", "bool"]
REDUCIBLE = [d for d in ALL_DTYPES if d != "bool"]
LAX_REDUCE = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}
AXES_2D = ["node", "npu", ("node", "npu")]


def assert_matches(got, want, dtype, op="sum", n=8):
    assert got.shape == want.shape and got.dtype == want.dtype
    dtype = np.dtype(dtype)
    if op == "sum" and np.issubdtype(dtype, np.floating) or dtype == jnp.bfloat16:
        # Both sides round; ours folds in rank order in float32 for 16-bit types.
        eps = {2: 1e-2, 4: 1e-5, 8: 1e-12}[dtype.itemsize]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=eps * n, atol=eps * n * 4)
    else:
        np.testing.assert_array_equal(got, want)


def assert_same_on_group(out, group_blocks):
    """Bit-identical results on all ranks of each group (blocks of dim 0)."""
    for members in group_blocks:
        first = out[members[0]]
        for r in members[1:]:
            assert first.tobytes() == out[r].tobytes(), f"rank {r} differs from rank {members[0]}"


def per_rank(out, n=8):
    return out.reshape((n, -1) + out.shape[1:])


@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_all_reduce_dtypes(mesh8, dtype, op):
    x = random_array(np.random.default_rng(1), (8 * 3, 5), dtype)
    got = shard_run(lambda v: strata.all_reduce(v, "x", op=op), mesh8, x)
    want = shard_run(lambda v: LAX_REDUCE[op](v, "x"), mesh8, x)
    assert_matches(got, want, dtype, op)
    assert_same_on_group(per_rank(got), [list(range(8))])


@pytest.mark.parametrize("dtype", ["float32", "int32", "float64", "uint8"])
def test_all_reduce_prod(mesh8, dtype):
    rng = np.random.default_rng(2)
    x = (rng.integers(1, 3, size=(8 * 2, 7)) * rng.choice([-1, 1], size=(16, 7))).astype(dtype) \
        if dtype != "uint8" else rng.integers(1, 3, size=(16, 7)).astype(dtype)
    got = shard_run(lambda v: strata.all_reduce(v, "x", op="prod"), mesh8, x)
    want = np.prod(x.reshape(8, 2, 7), axis=0, dtype=dtype)
    np.testing.assert_array_equal(per_rank(got), np.broadcast_to(want, (8, 2, 7)))


@pytest.mark.parametrize("elems", [1, 7, 64, 1001, 65536 + 3, 1 << 20])
def test_all_reduce_sizes(mesh8, elems):
    x = np.random.default_rng(elems).standard_normal((8 * elems,)).astype(np.float32)
    got = shard_run(lambda v: strata.all_reduce(v, "x"), mesh8, x)
    want = shard_run(lambda v: lax.psum(v, "x"), mesh8, x)
    assert_matches(got, want, np.float32)
    exact = x.reshape(8, elems).astype(np.float64).sum(0)
    np.testing.assert_allclose(per_rank(got)[3], exact, rtol=1e-5, atol=1e-5)
    assert_same_on_group(per_rank(got), [list(range(8))])


@pytest.mark.parametrize("axis_name", AXES_2D, ids=str)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_all_reduce_2d(mesh2x4, axis_name, op):
    x = random_array(np.random.default_rng(3), (8 * 2, 3), np.float32)
    got = shard_run(lambda v: strata.all_reduce(v, axis_name, op=op), mesh2x4, x)
    want = shard_run(lambda v: LAX_REDUCE[op](v, axis_name), mesh2x4, x)
    assert_matches(got, want, np.float32, op)
    groups = {"node": [[0, 4], [1, 5], [2, 6], [3, 7]], "npu": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    assert_same_on_group(per_rank(got), groups.get(axis_name, [list(range(8))]))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather_dtypes(mesh8, dtype, tiled):
    x = random_array(np.random.default_rng(4), (8 * 3, 2), dtype)
    got = shard_run(lambda v: strata.all_gather(v, "x", tiled=tiled), mesh8, x)
    want = shard_run(lambda v: lax.all_gather(v, "x", tiled=tiled), mesh8, x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape", [(1,), (5,), (2, 3, 4)])
@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather_every_axis(mesh8, shape, tiled):
    x = random_array(np.random.default_rng(5), (8 * shape[0],) + shape[1:], np.float32)
    for axis in range(len(shape) + (0 if tiled else 1)):
        got = shard_run(lambda v: strata.all_gather(v, "x", axis=axis, tiled=tiled), mesh8, x)
        want = shard_run(lambda v: lax.all_gather(v, "x", axis=axis, tiled=tiled), mesh8, x)
        np.testing.assert_array_equal(got, want, err_msg=f"axis={axis}")


@pytest.mark.parametrize("axis_name", AXES_2D, ids=str)
@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather_2d(mesh2x4, axis_name, tiled):
    x = random_array(np.random.default_rng(6), (8 * 3, 5), np.int32)
    got = shard_run(lambda v: strata.all_gather(v, axis_name, axis=1, tiled=tiled), mesh2x4, x)
    want = shard_run(lambda v: lax.all_gather(v, axis_name, axis=1, tiled=tiled), mesh2x4, x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("elems", [1, 13, 1 << 18])
def test_all_gather_sizes(mesh8, elems):
    x = random_array(np.random.default_rng(elems), (8 * elems,), np.float32)
    got = shard_run(lambda v: strata.all_gather(v, "x", tiled=True), mesh8, x)
    np.testing.assert_array_equal(per_rank(got)[5], x)


@pytest.mark.parametrize("dtype", REDUCIBLE, ids=str)
def test_reduce_scatter_dtypes(mesh8, dtype):
    x = random_array(np.random.default_rng(7), (8 * 16, 3), dtype)
    got = shard_run(lambda v: strata.reduce_scatter(v, "x", tiled=True), mesh8, x)
    want = shard_run(lambda v: lax.psum_scatter(v, "x", tiled=True), mesh8, x)
    assert_matches(got, want, dtype)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_reduce_scatter_every_dimension(mesh8, tiled, dim):
    local = [2, 3, 5]
    local[dim] = 8 * (2 if tiled else 1)
    x = random_array(np.random.default_rng(8), (8 * local[0],) + tuple(local[1:]), np.float64)
    got = shard_run(lambda v: strata.reduce_scatter(v, "x", scatter_dimension=dim, tiled=tiled), mesh8, x)
    want = shard_run(lambda v: lax.psum_scatter(v, "x", scatter_dimension=dim, tiled=tiled), mesh8, x)
    assert_matches(got, want, np.float64)


@pytest.mark.parametrize("axis_name", AXES_2D, ids=str)
def test_reduce_scatter_2d(mesh2x4, axis_name):
    x = random_array(np.random.default_rng(9), (8 * 8, 7), np.float32)
    got = shard_run(lambda v: strata.reduce_scatter(v, axis_name, scatter_dimension=0, tiled=True), mesh2x4, x)
    want = shard_run(lambda v: lax.psum_scatter(v, axis_name, scatter_dimension=0, tiled=True), mesh2x4, x)
    assert_matches(got, want, np.float32)


@pytest.mark.parametrize("op", ["max", "min", "prod"])
def test_reduce_scatter_other_ops(mesh8, op):
    x = random_array(np.random.default_rng(10), (8 * 8, 3), np.int32)
    got = shard_run(lambda v: strata.reduce_scatter(v, "x", tiled=True, op=op), mesh8, x)
    full = {"max": np.max, "min": np.min, "prod": np.prod}[op](x.reshape(8, 8, 3), axis=0).astype(np.int32)
    np.testing.assert_array_equal(got, full)  # rank r holds row r of the reduced block


def test_reduce_scatter_large(mesh8):
    x = random_array(np.random.default_rng(11), (8 * 8, 40003), np.float32)
    got = shard_run(lambda v: strata.reduce_scatter(v, "x", tiled=True), mesh8, x)
    np.testing.assert_allclose(got, x.reshape(8, 8, 40003).astype(np.float64).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_all_to_all_dtypes(mesh8, dtype):
    x = random_array(np.random.default_rng(12), (8 * 8, 3), dtype)
    got = shard_run(lambda v: strata.all_to_all(v, "x", 0, 0, tiled=True), mesh8, x)
    want = shard_run(lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True), mesh8, x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("tiled", [False, True])
def test_all_to_all_every_axis_pair(mesh8, tiled):
    rng = np.random.default_rng(13)
    for split, concat in itertools.product(range(3), range(3)):
        local = [2, 3, 5]
        local[split] = 8 * (2 if tiled else 1)
        x = random_array(rng, (8 * local[0],) + tuple(local[1:]), np.float32)
        got = shard_run(lambda v: strata.all_to_all(v, "x", split, concat, tiled=tiled), mesh8, x)
        want = shard_run(lambda v: lax.all_to_all(v, "x", split, concat, tiled=tiled), mesh8, x)
        np.testing.assert_array_equal(got, want, err_msg=f"split={split} concat={concat}")


@pytest.mark.parametrize("axis_name", AXES_2D, ids=str)
def test_all_to_all_2d(mesh2x4, axis_name):
    x = random_array(np.random.default_rng(14), (8 * 8, 5), np.uint8)
    got = shard_run(lambda v: strata.all_to_all(v, axis_name, 0, 1, tiled=True), mesh2x4, x)
    want = shard_run(lambda v: lax.all_to_all(v, axis_name, 0, 1, tiled=True), mesh2x4, x)
    np.testing.assert_array_equal(got, want)


def test_all_to_all_large(mesh8):
    x = random_array(np.random.default_rng(15), (8 * 8, 30001), np.float32)
    got = shard_run(lambda v: strata.all_to_all(v, "x", 0, 0, tiled=True), mesh8, x)
    want = x.reshape(8, 8, 30001).transpose(1, 0, 2).reshape(64, 30001)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("root", [0, 5])
def test_broadcast(mesh8, dtype, root):
    x = random_array(np.random.default_rng(16), (8 * 3, 4), dtype)
    got = shard_run(lambda v: strata.broadcast(v, "x", root=root), mesh8, x)
    np.testing.assert_array_equal(per_rank(got), np.broadcast_to(per_rank(x)[root], (8, 3, 4)))


@pytest.mark.parametrize("axis_name", AXES_2D, ids=str)
def test_broadcast_2d(mesh2x4, axis_name):
    x = random_array(np.random.default_rng(17), (8 * 2, 3), np.float32)
    got = per_rank(shard_run(lambda v: strata.broadcast(v, axis_name, root=1), mesh2x4, x))
    xs = per_rank(x)
    for r in range(8):
        node, npu = divmod(r, 4)
        src = {"node": 4 * 1 + npu, "npu": 4 * node + 1}.get(axis_name, 1) if isinstance(axis_name, str) else 1
        np.testing.assert_array_equal(got[r], xs[src])


PERMS = {
    "shift": [(i, (i + 1) % 8) for i in range(8)],
    "partial": [(0, 3), (3, 0), (5, 6)],
    "identity": [(i, i) for i in range(8)],
}


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("perm", list(PERMS), ids=str)
def test_ppermute(mesh8, dtype, perm):
    x = random_array(np.random.default_rng(18), (8 * 2, 5), dtype)
    got = shard_run(lambda v: strata.ppermute(v, "x", PERMS[perm]), mesh8, x)
    want = shard_run(lambda v: lax.ppermute(v, "x", PERMS[perm]), mesh8, x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis_name", AXES_2D, ids=str)
def test_ppermute_2d(mesh2x4, axis_name):
    n = 8 if isinstance(axis_name, tuple) else {"node": 2, "npu": 4}[axis_name]
    perm = [(i, (i + 1) % n) for i in range(n)]
    x = random_array(np.random.default_rng(19), (8 * 2, 3), np.float32)
    got = shard_run(lambda v: strata.ppermute(v, axis_name, perm), mesh2x4, x)
    want = shard_run(lambda v: lax.ppermute(v, axis_name, perm), mesh2x4, x)
    np.testing.assert_array_equal(got, want)


def test_zero_size_operand(mesh8):
    x = np.zeros((8 * 2, 0), np.float32)
    got = shard_run(lambda v: strata.all_reduce(v, "x"), mesh8, x)
    assert got.shape == (16, 0)


def test_scalar_per_rank(mesh8):
    x = np.arange(8, dtype=np.float32) * 1.5
    got = shard_run(lambda v: strata.all_reduce(v.reshape(()), "x").reshape(1), mesh8, x)
    np.testing.assert_array_equal(got, np.full(8, x.sum(), np.float32))
