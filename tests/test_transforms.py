"""grad, vmap and scan through every collective equal the same through its
jax.lax twin; several collectives in one program stay apart."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_array
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata

# (name, strata op, lax op, local shape); lax has no gradient for pmax.
PAIRS = [
    ("all_reduce", lambda v, a: strata.all_reduce(v, a), lambda v, a: lax.psum(v, a), (4, 3)),
    ("all_gather", lambda v, a: strata.all_gather(v, a, axis=1), lambda v, a: lax.all_gather(v, a, axis=1), (4, 3)),
    ("all_gather_tiled", lambda v, a: strata.all_gather(v, a, axis=1, tiled=True),
     lambda v, a: lax.all_gather(v, a, axis=1, tiled=True), (4, 3)),
    ("reduce_scatter", lambda v, a: strata.reduce_scatter(v, a, scatter_dimension=0, tiled=True),
     lambda v, a: lax.psum_scatter(v, a, scatter_dimension=0, tiled=True), (8, 3)),
    ("all_to_all", lambda v, a: strata.all_to_all(v, a, 0, 1, tiled=True),
     lambda v, a: lax.all_to_all(v, a, 0, 1, tiled=True), (8, 3)),
    ("ppermute", lambda v, a: strata.ppermute(v, a, [(0, 1), (1, 0)]),
     lambda v, a: lax.ppermute(v, a, [(0, 1), (1, 0)]), (4, 3)),
]


def grad_of(op, mesh, axis, x, check_vma):
    spec = P(tuple(mesh.axis_names))
    xs = jax.device_put(x, NamedSharding(mesh, spec))

    def loss(v):
        y = jax.shard_map(lambda u: op(jnp.sin(u) * u, axis), mesh=mesh, in_specs=spec, out_specs=spec,
                          check_vma=check_vma)(v)
        weights = jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)
        return (y * weights).sum()

    return np.asarray(jax.jit(jax.grad(loss))(xs))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("name,sop,lop,shape", PAIRS, ids=[p[0] for p in PAIRS])
def test_grad_matches_lax(mesh2x4, name, sop, lop, shape, check_vma):
    x = random_array(np.random.default_rng(0), (8 * shape[0],) + shape[1:], np.float32)
    for axis in ("npu", ("node", "npu")):
        if name == "ppermute" and axis != "npu":
            continue
        if name in ("reduce_scatter", "all_to_all") and axis == ("node", "npu"):
            continue  # the local shape is sized for 4 ranks
        got = grad_of(sop, mesh2x4, axis, x, check_vma)
        want = grad_of(lop, mesh2x4, axis, x, check_vma)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"axis={axis}")


def test_grad_all_reduce_prod_max(mesh8):
    rng = np.random.default_rng(1)
    x = rng.uniform(0.5, 1.5, (8 * 2, 3)).astype(np.float32)
    x[3, 1] = 0.0  # a zero must not break the product rule
    spec = P("x")
    xs = jax.device_put(x, NamedSharding(mesh8, spec))

    def loss(v, op):
        y = jax.shard_map(lambda u: strata.all_reduce(u, "x", op=op), mesh=mesh8, in_specs=spec, out_specs=P())(v)
        return (y * jnp.arange(1.0, 7.0).reshape(2, 3)).sum()

    got = np.asarray(jax.jit(jax.grad(lambda v: loss(v, "prod")))(xs))
    blocks = x.reshape(8, 2, 3).astype(np.float64)
    want = np.stack([np.prod(np.delete(blocks, r, axis=0), axis=0) for r in range(8)]) * np.arange(1.0, 7.0).reshape(2, 3)
    np.testing.assert_allclose(got.reshape(8, 2, 3), want, rtol=1e-5, atol=1e-6)
    got = np.asarray(jax.jit(jax.grad(lambda v: loss(v, "max")))(xs)).reshape(8, 2, 3)
    want = (blocks == blocks.max(0)) * np.arange(1.0, 7.0).reshape(2, 3)
    np.testing.assert_allclose(got, want)


def test_grad_broadcast_sums_onto_root(mesh8):
    x = random_array(np.random.default_rng(2), (8 * 2, 3), np.float32)
    spec = P("x")

    def loss(v):
        y = jax.shard_map(lambda u: strata.broadcast(u, "x", root=2), mesh=mesh8, in_specs=spec, out_specs=spec)(v)
        return (y * jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)).sum()

    got = np.asarray(jax.jit(jax.grad(loss))(jax.device_put(x, NamedSharding(mesh8, spec)))).reshape(8, 2, 3)
    want = np.zeros((8, 2, 3))
    want[2] = np.arange(48.0).reshape(8, 2, 3).sum(0)
    np.testing.assert_allclose(got, want)


@pytest.mark.parametrize("name,sop,lop,shape", PAIRS, ids=[p[0] for p in PAIRS])
def test_vmap_matches_lax(mesh2x4, name, sop, lop, shape):
    x = random_array(np.random.default_rng(3), (8 * 5,) + shape, np.float32)  # 5 batch rows per rank
    spec = P(("node", "npu"))

    def run(op, in_axes):
        f = jax.shard_map(lambda u: jax.vmap(lambda w: op(w, "npu"), in_axes=in_axes)(u if in_axes == 0 else jnp.moveaxis(u, 0, in_axes)),
                          mesh=mesh2x4, in_specs=spec, out_specs=spec)
        return np.asarray(jax.jit(f)(jax.device_put(x, NamedSharding(mesh2x4, spec))))

    for in_axes in (0, 1):
        np.testing.assert_allclose(run(sop, in_axes), run(lop, in_axes), rtol=1e-6, atol=1e-6,
                                   err_msg=f"in_axes={in_axes}")


def test_vmap_of_grad(mesh8):
    x = random_array(np.random.default_rng(4), (8 * 3, 4), np.float32)
    spec = P("x")

    def per_row(op):
        def f(u):
            return jax.vmap(jax.grad(lambda w: (op(w * w, "x") * jnp.arange(4.0)).sum()))(u)
        g = jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=spec, out_specs=spec))
        return np.asarray(g(jax.device_put(x, NamedSharding(mesh8, spec))))

    np.testing.assert_allclose(per_row(strata.all_reduce), per_row(lax.psum), rtol=1e-6)


def test_scan_of_collectives(mesh8):
    x = random_array(np.random.default_rng(5), (8 * 4, 3), np.float32)
    spec = P("x")

    def body_with(ops):
        def f(u):
            def step(carry, _):
                carry = ops["ar"](carry, "x") / 8.0 + 0.5 * carry
                carry = ops["pp"](carry, "x", [(i, (i + 3) % 8) for i in range(8)])
                return carry, ops["ag"](carry[:1], "x").sum()
            return lax.scan(step, u, None, length=6)
        g = jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=spec, out_specs=(spec, P("x"))))
        return jax.tree.map(np.asarray, g(jax.device_put(x, NamedSharding(mesh8, spec))))

    got = body_with({"ar": strata.all_reduce, "pp": strata.ppermute, "ag": strata.all_gather})
    want = body_with({"ar": lax.psum, "pp": lax.ppermute, "ag": lax.all_gather})
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_ten_independent_collectives_in_one_program(mesh2x4):
    x = random_array(np.random.default_rng(6), (8 * 8, 5), np.float32)
    spec = P(("node", "npu"))

    def program(ops):
        def f(u):
            return (
                ops.psum(u, "npu"), ops.psum(u * 2, "node"), ops.psum(u + 1, ("node", "npu")),
                ops.pmax(u, "npu"), ops.gather(u, "npu"), ops.gather(u - 1, "node"),
                ops.scatter(u, "npu"), ops.a2a(u, "npu"), ops.a2a(u * 3, "node"),
                ops.perm(u, "npu"),
            )
        g = jax.jit(jax.shard_map(f, mesh=mesh2x4, in_specs=spec, out_specs=(spec,) * 10))
        return jax.tree.map(np.asarray, g(jax.device_put(x, NamedSharding(mesh2x4, spec))))

    class S:
        psum = staticmethod(lambda v, a: strata.all_reduce(v, a))
        pmax = staticmethod(lambda v, a: strata.all_reduce(v, a, op="max"))
        gather = staticmethod(lambda v, a: strata.all_gather(v, a, tiled=True))
        scatter = staticmethod(lambda v, a: strata.reduce_scatter(v, a, tiled=True))
        a2a = staticmethod(lambda v, a: strata.all_to_all(v, a, 0, 0, tiled=True))
        perm = staticmethod(lambda v, a: strata.ppermute(v, a, [(0, 2), (2, 0), (1, 3)]))

    class L:
        psum = staticmethod(lambda v, a: lax.psum(v, a))
        pmax = staticmethod(lambda v, a: lax.pmax(v, a))
        gather = staticmethod(lambda v, a: lax.all_gather(v, a, tiled=True))
        scatter = staticmethod(lambda v, a: lax.psum_scatter(v, a, tiled=True))
        a2a = staticmethod(lambda v, a: lax.all_to_all(v, a, 0, 0, tiled=True))
        perm = staticmethod(lambda v, a: lax.ppermute(v, a, [(0, 2), (2, 0), (1, 3)]))

    for i, (g, w) in enumerate(zip(program(S), program(L))):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"output {i}")


@pytest.mark.parametrize("elems", [16, 1 << 16])
def test_strata_and_lax_collectives_interleaved(mesh8, elems):
    """A rank resumed after a strata op may block in XLA's own collective; the
    others must still be resumed (each on its own thread), not queued behind it."""
    x = random_array(np.random.default_rng(7), (8 * elems,), np.float32)
    spec = P("x")

    def body(v):
        y = strata.all_reduce(v, "x")
        z = lax.psum(y * 0.5, "x")
        return strata.ppermute(z + v, "x", [(i, (i + 1) % 8) for i in range(8)]) + lax.pmax(v, "x")

    def reference(v):
        y = lax.psum(v, "x")
        z = lax.psum(y * 0.5, "x")
        return lax.ppermute(z + v, "x", [(i, (i + 1) % 8) for i in range(8)]) + lax.pmax(v, "x")

    run = lambda f: np.asarray(jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=spec, out_specs=spec))(
        jax.device_put(x, NamedSharding(mesh8, spec))))
    np.testing.assert_allclose(run(body), run(reference), rtol=1e-5, atol=1e-5)
