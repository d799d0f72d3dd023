"""Drop-in parity with jax.lax: every collective against a lax-built twin on
random data under forward and reverse mode (check_grads to order 2, jvp,
linearize, jacfwd, Hessian-vector products), vmap (over a batch axis, over the
collective's own axis), pytrees of mixed dtypes, complex data, bool sums,
Explicit-axis meshes, eager and jitted shard_map, control flow."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_array
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import stratacl_jax as strata

AXES = ("node", "npu")
SPEC = P(AXES)
CYCLE = [(i, (i + 1) % 4) for i in range(4)]
PARTIAL = [(0, 2), (2, 1), (3, 0)]  # rank 3 receives nothing (zeros)


def _own_block(v, axis, dim):
    """Rank r's block r of `dim` (what psum_scatter keeps)."""
    n = lax.axis_size(axis)
    size = v.shape[dim] // n
    return lax.dynamic_slice_in_dim(v, lax.axis_index(axis) * size, size, axis=dim)


# name -> (strata op, lax-built twin, per-rank shape, axis). The twins are
# differentiable where lax's own are not (pmax/pmin: jax#7167) with jnp's
# rule for ties, which strata follows.
OPS = {
    "sum": (lambda v, a: strata.all_reduce(v, a), lambda v, a: lax.psum(v, a), (2, 3), "npu"),
    "sum_2d": (lambda v, a: strata.all_reduce(v, a), lambda v, a: lax.psum(v, a), (2, 3), AXES),
    "mean": (lambda v, a: strata.all_reduce(v, a, op="mean"), lambda v, a: lax.pmean(v, a), (3,), "node"),
    "max": (lambda v, a: strata.all_reduce(v, a, op="max"), lambda v, a: jnp.max(lax.all_gather(v, a), 0), (2, 3), "npu"),
    "min": (lambda v, a: strata.all_reduce(v, a, op="min"), lambda v, a: jnp.min(lax.all_gather(v, a), 0), (5,), AXES),
    "prod": (lambda v, a: strata.all_reduce(v, a, op="prod"), lambda v, a: jnp.prod(lax.all_gather(v, a), 0), (2, 3), "npu"),
    "all_gather": (lambda v, a: strata.all_gather(v, a, axis=1), lambda v, a: lax.all_gather(v, a, axis=1), (2, 3), "npu"),
    "all_gather_tiled": (lambda v, a: strata.all_gather(v, a, axis=1, tiled=True),
                         lambda v, a: lax.all_gather(v, a, axis=1, tiled=True), (2, 3), AXES),
    "all_gather_invariant": (lambda v, a: strata.all_gather(v, a, to="invarying"),
                             lambda v, a: lax.all_gather(v, a, to="invarying"), (3,), "npu"),
    "reduce_scatter": (lambda v, a: strata.reduce_scatter(v, a, scatter_dimension=1, tiled=True),
                       lambda v, a: lax.psum_scatter(v, a, scatter_dimension=1, tiled=True), (3, 8), "npu"),
    "reduce_scatter_untiled": (lambda v, a: strata.reduce_scatter(v, a, scatter_dimension=0),
                               lambda v, a: lax.psum_scatter(v, a, scatter_dimension=0), (4, 3), "npu"),
    "reduce_scatter_max": (lambda v, a: strata.reduce_scatter(v, a, scatter_dimension=1, tiled=True, op="max"),
                           lambda v, a: _own_block(jnp.max(lax.all_gather(v, a), 0), a, 1), (3, 4), "npu"),
    "reduce_scatter_prod": (lambda v, a: strata.reduce_scatter(v, a, tiled=True, op="prod"),
                            lambda v, a: _own_block(jnp.prod(lax.all_gather(v, a), 0), a, 0), (4, 2), "npu"),
    "all_to_all": (lambda v, a: strata.all_to_all(v, a, 0, 1, tiled=True),
                   lambda v, a: lax.all_to_all(v, a, 0, 1, tiled=True), (4, 3), "npu"),
    # lax's own untiled all_to_all with split > concat has a wrong transpose in
    # jax 0.10.2 (cotangent [1,3,2] expected, [3,1,2] given): the twin is the tiled one.
    "all_to_all_untiled": (lambda v, a: strata.all_to_all(v, a, 1, 0),
                           lambda v, a: lax.all_to_all(v, a, 1, 0, tiled=True).reshape(2, 3), (3, 2), "node"),
    "ppermute": (lambda v, a: strata.ppermute(v, a, CYCLE), lambda v, a: lax.ppermute(v, a, CYCLE), (2, 3), "npu"),
    "ppermute_partial": (lambda v, a: strata.ppermute(v, a, PARTIAL), lambda v, a: lax.ppermute(v, a, PARTIAL),
                         (3,), "npu"),
    "broadcast": (lambda v, a: strata.broadcast(v, a, root=2), lambda v, a: lax.all_gather(v, a)[2], (2, 3), "npu"),
}
NAMES = list(OPS)
MAX_LIKE = {"max", "min", "reduce_scatter_max"}


def placed(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, SPEC))


def sharded(op, axis, mesh, *, check_vma=True):
    """x [8 * local...] -> op on every rank's block (nonlinear first, so
    second derivatives are not trivially zero)."""
    return jax.shard_map(lambda u: op(jnp.sin(u) * u, axis), mesh=mesh, in_specs=SPEC, out_specs=SPEC,
                         check_vma=check_vma)


def data(name, dtype=np.float64, seed=0):
    shape = OPS[name][2]
    return random_array(np.random.default_rng(seed), (8 * shape[0],) + shape[1:], dtype)


# Every primitive and every JVP rule once (the other variants differ only in
# parameters and are checked against the twin's derivatives below).
CHECK_GRADS = ["sum_2d", "mean", "max", "min", "prod", "all_gather_tiled", "all_gather_invariant", "reduce_scatter",
               "reduce_scatter_max", "reduce_scatter_prod", "all_to_all_untiled", "ppermute_partial", "broadcast"]


def test_check_grads_to_second_order_both_modes(mesh2x4):
    """The ops at once (one program per derivative check keeps this fast)."""
    xs = {name: placed(mesh2x4, data(name)) for name in CHECK_GRADS}
    body = lambda tree: {name: OPS[name][0](jnp.sin(u) * u, OPS[name][3]) for name, u in tree.items()}
    f = jax.jit(jax.shard_map(body, mesh=mesh2x4, in_specs=SPEC, out_specs=SPEC))
    check_grads(f, (xs,), order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("name", NAMES)
def test_forward_and_second_order_transforms_match_twin(mesh2x4, name):
    sop, lop, _, axis = OPS[name]
    x = placed(mesh2x4, data(name, seed=1))
    t = placed(mesh2x4, data(name, seed=2))

    def transforms(op):
        f = sharded(op, axis, mesh2x4)
        loss = lambda v: (jnp.cos(f(v)) * jnp.arange(f(v).size).reshape(f(v).shape)).sum()
        y, y_dot = jax.jvp(f, (x,), (t,))
        _, f_lin = jax.linearize(f, x)
        return dict(y=y, y_dot=y_dot, lin=f_lin(t), jacfwd=jax.jacfwd(loss)(x), grad=jax.grad(loss)(x),
                    hvp=jax.jvp(jax.grad(loss), (x,), (t,))[1])

    got, want = jax.jit(lambda: transforms(sop))(), jax.jit(lambda: transforms(lop))()
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-9, atol=1e-9, err_msg=key)


@pytest.mark.parametrize("name", ["sum_2d", "max", "prod", "all_gather_invariant", "reduce_scatter", "broadcast"])
def test_forward_mode_without_vma_checks(mesh2x4, name):
    """check_vma=False: no varying types, so sums transpose to sums."""
    sop, lop, _, axis = OPS[name]
    if name == "all_gather_invariant":
        sop, lop = OPS["all_gather"][:2]
    x, t = placed(mesh2x4, data(name, seed=16)), placed(mesh2x4, data(name, seed=17))

    def transforms(op):
        f = sharded(op, axis, mesh2x4, check_vma=False)
        loss = lambda v: (jnp.cos(f(v)) * jnp.arange(f(v).size).reshape(f(v).shape)).sum()
        return jax.jvp(f, (x,), (t,))[1], jax.grad(loss)(x), jax.jvp(jax.grad(loss), (x,), (t,))[1]

    for g, w in zip(jax.jit(lambda: transforms(sop))(), jax.jit(lambda: transforms(lop))()):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("in_axes", [0, -1])
def test_vmap_inside_shard_map_matches_twin(mesh2x4, name, in_axes):
    """The batch at the front or at the back of the operand; the twin always
    batches at the front (lax's own psum_scatter batching fails on a trailing
    batch dimension in jax 0.10.2)."""
    sop, lop, shape, axis = OPS[name]
    x = placed(mesh2x4, random_array(np.random.default_rng(3), (8 * shape[0], 2) + shape[1:], np.float32))

    def run(op, where):
        def body(u):  # u [local0, 2, ...]: the batch is dim 1, moved to `where`
            u = jnp.moveaxis(jnp.moveaxis(u, 1, 0), 0, where)
            return jax.vmap(lambda w: op(w, axis), in_axes=where % u.ndim)(u)
        return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh2x4, in_specs=SPEC, out_specs=SPEC))(x))

    np.testing.assert_allclose(run(sop, in_axes), run(lop, 0), rtol=1e-6, atol=1e-6)


def test_vmap_of_vmap_and_eager_shard_map(mesh2x4):
    """Nested vmaps inside shard_map, and unjitted shard_map on an Auto mesh:
    the twin's values and shardings."""
    x = placed(mesh2x4, random_array(np.random.default_rng(14), (8 * 4, 3, 2), np.float32))
    for name in ("sum", "max", "all_gather", "ppermute", "broadcast"):
        sop, lop, _, axis = OPS[name]
        nested = lambda op: jax.shard_map(jax.vmap(jax.vmap(lambda w: op(w, axis), in_axes=1), in_axes=2),
                                          mesh=mesh2x4, in_specs=SPEC, out_specs=SPEC)
        got, want = nested(sop)(x), nested(lop)(x)  # eager: no jax.jit
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, err_msg=name)
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), name


@pytest.mark.parametrize("name", ["sum", "max", "all_gather", "ppermute"])
def test_pmap_runs_strata(name):
    """Under jax.pmap (a shard_map in jax 0.10.2) the strata op runs, with grads."""
    sop, lop = VMAP_AXIS_OPS[name]
    x = random_array(np.random.default_rng(15), (8, 3), np.float32)
    f = jax.pmap(sop, axis_name="i")
    assert "strata_" in f.lower(x).as_text()
    np.testing.assert_allclose(f(x), jax.pmap(lop, axis_name="i")(x), rtol=1e-6)
    if name != "max":  # lax's pmax has no gradient
        grad = lambda op: jax.pmap(jax.grad(lambda v: (jnp.sin(op(v)) ** 2).sum()), axis_name="i")(x)
        np.testing.assert_allclose(grad(sop), grad(lop), rtol=1e-5, atol=1e-6)


VMAP_AXIS_OPS = {
    "sum": (lambda v: strata.all_reduce(v, "i"), lambda v: lax.psum(v, "i")),
    "mean": (lambda v: strata.all_reduce(v, "i", op="mean"), lambda v: lax.pmean(v, "i")),
    "max": (lambda v: strata.all_reduce(v, "i", op="max"), lambda v: lax.pmax(v, "i")),
    "prod": (lambda v: strata.all_reduce(v, "i", op="prod"), lambda v: jnp.prod(lax.all_gather(v, "i"), 0)),
    "all_gather": (lambda v: strata.all_gather(v, "i", axis=1), lambda v: lax.all_gather(v, "i", axis=1)),
    "reduce_scatter": (lambda v: strata.reduce_scatter(v, "i", tiled=True), lambda v: lax.psum_scatter(v, "i", tiled=True)),
    "all_to_all": (lambda v: strata.all_to_all(v, "i", 0, 1, tiled=True), lambda v: lax.all_to_all(v, "i", 0, 1, tiled=True)),
    "ppermute": (lambda v: strata.ppermute(v, "i", CYCLE), lambda v: lax.ppermute(v, "i", CYCLE)),
    "broadcast": (lambda v: strata.broadcast(v, "i", root=1), lambda v: lax.all_gather(v, "i")[1]),
}


@pytest.mark.parametrize("name", list(VMAP_AXIS_OPS))
def test_vmap_over_the_collectives_own_axis(mesh2x4, name):
    """jax.vmap(..., axis_name="i") makes "i" a batch axis on one device; the
    collective over it is lax's (no communication), also inside shard_map
    next to a mesh-axis collective (check_vma=False: lax's own vmap-axis psum
    fails an assertion under check_vma in jax 0.10.2)."""
    sop, lop = VMAP_AXIS_OPS[name]
    x = random_array(np.random.default_rng(4), (4, 8, 3), np.float32)
    got = jax.vmap(sop, axis_name="i")(x)
    np.testing.assert_allclose(got, jax.vmap(lop, axis_name="i")(x), rtol=1e-6)

    def body(u, op):
        return jax.vmap(lambda w: (op(w), strata.all_reduce(w, "npu")), axis_name="i")(u)

    run = lambda op: jax.jit(jax.shard_map(lambda u: body(u, op), mesh=mesh2x4, in_specs=P(None, AXES),
                                           out_specs=P(None, AXES), check_vma=False))(jax.device_put(
                                               np.tile(x, (1, 8, 1)), NamedSharding(mesh2x4, P(None, AXES))))
    for g, w in zip(run(sop), run(lop)):
        np.testing.assert_allclose(g, w, rtol=1e-5)


def test_vmap_mixing_its_axis_with_mesh_axes(mesh2x4):
    x = random_array(np.random.default_rng(5), (4, 8, 3), np.float32)
    spec = P(None, AXES)
    xs = jax.device_put(np.tile(x, (1, 8, 1)), NamedSharding(mesh2x4, spec))
    for op, twin in ((lambda v, a: strata.all_reduce(v, a), lax.psum),
                     (lambda v, a: strata.all_reduce(v, a, op="max"), lax.pmax),
                     (lambda v, a: strata.all_reduce(v, a, op="mean"), lax.pmean)):
        run = lambda f: np.asarray(jax.jit(jax.shard_map(
            jax.vmap(lambda w: f(w, ("i", "npu")), axis_name="i"), mesh=mesh2x4, in_specs=spec, out_specs=spec,
            check_vma=False))(xs))
        np.testing.assert_allclose(run(op), run(twin), rtol=1e-5)


PYTREE_OPS = {
    "sum": (lambda t: strata.all_reduce(t, "npu"), lambda t: lax.psum(t, "npu")),
    "mean": (lambda t: strata.all_reduce(t, "npu", op="mean"), lambda t: lax.pmean(t, "npu")),
    "all_gather": (lambda t: strata.all_gather(t, "npu", axis=0), lambda t: lax.all_gather(t, "npu", axis=0)),
    "reduce_scatter": (lambda t: strata.reduce_scatter(t, "npu", tiled=True),
                       lambda t: lax.psum_scatter(t, "npu", tiled=True)),
    "all_to_all": (lambda t: strata.all_to_all(t, "npu", 0, 0, tiled=True),
                   lambda t: jax.tree.map(lambda v: lax.all_to_all(v, "npu", 0, 0, tiled=True), t)),
    "ppermute": (lambda t: strata.ppermute(t, ("node", "npu"), [(i, (i + 3) % 8) for i in range(8)]),
                 lambda t: lax.ppermute(t, ("node", "npu"), [(i, (i + 3) % 8) for i in range(8)])),
}


@pytest.mark.parametrize("name", list(PYTREE_OPS))
def test_pytrees_of_mixed_dtypes(mesh2x4, name):
    rng = np.random.default_rng(6)
    tree = {"f": random_array(rng, (8 * 4, 3), np.float32), "c": random_array(rng, (8 * 4,), np.complex64),
            "ints": (random_array(rng, (8 * 4, 2), np.int32), random_array(rng, (8 * 4,), np.bool_)),
            "h": random_array(rng, (8 * 4, 1), jnp.bfloat16)}
    if name == "reduce_scatter":
        del tree["ints"]  # lax.psum_scatter takes no bools
    sop, lop = PYTREE_OPS[name]
    run = lambda op: jax.tree.map(np.asarray, jax.jit(jax.shard_map(
        op, mesh=mesh2x4, in_specs=SPEC, out_specs=SPEC))(jax.tree.map(lambda v: placed(mesh2x4, v), tree)))
    got, want = run(sop), run(lop)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.complex128), w.astype(np.complex128), rtol=1e-2, atol=1e-2)


def test_bool_sums_count_as_lax_psum_does(mesh2x4):
    x = placed(mesh2x4, random_array(np.random.default_rng(7), (8 * 5, 3), np.bool_))
    run = lambda op: jax.jit(jax.shard_map(op, mesh=mesh2x4, in_specs=SPEC, out_specs=SPEC))(x)
    for a in ("npu", AXES):
        got, want = run(lambda v: strata.all_reduce(v, a)), run(lambda v: lax.psum(v, a))
        assert got.dtype == want.dtype and np.issubdtype(got.dtype, np.integer)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(run(lambda v: strata.all_reduce(v, a, op="max")), run(lambda v: lax.pmax(v, a)))
        np.testing.assert_allclose(run(lambda v: strata.all_reduce(v, a, op="mean")), run(lambda v: lax.pmean(v, a)))


COMPLEX_OPS = [n for n in NAMES if n not in MAX_LIKE]


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
@pytest.mark.parametrize("name", COMPLEX_OPS)
def test_complex_values_and_gradients(mesh2x4, name, dtype):
    sop, lop, _, axis = OPS[name]
    x = placed(mesh2x4, data(name, dtype, seed=8))
    got = np.asarray(jax.jit(sharded(sop, axis, mesh2x4))(x))
    want = np.asarray(jax.jit(sharded(lop, axis, mesh2x4))(x))
    assert got.dtype == want.dtype == dtype
    eps = 1e-5 if dtype == np.complex64 else 1e-12
    np.testing.assert_allclose(got, want, rtol=eps, atol=eps)
    if dtype == np.complex128:
        check_grads(jax.jit(sharded(sop, axis, mesh2x4)), (x,), order=1, modes=("fwd", "rev"))


@pytest.mark.parametrize("name", ["sum", "max", "prod", "all_gather_invariant", "reduce_scatter", "all_to_all",
                                  "ppermute", "broadcast", "mean"])
def test_varying_types_match_twin(mesh2x4, name):
    sop, lop, shape, axis = OPS[name]
    if name in ("max", "prod", "broadcast"):  # twins with lax's own typing for these
        lop = {"max": lambda v, a: lax.pmax(v, a), "prod": lambda v, a: lax.psum(v, a),
               "broadcast": lambda v, a: v}[name]
    types = {}

    def body(u):
        types["strata"], types["lax"] = jax.typeof(sop(u, axis)), jax.typeof(lop(u, axis))
        return u

    jax.jit(jax.shard_map(body, mesh=mesh2x4, in_specs=SPEC, out_specs=SPEC))(placed(mesh2x4, data(name)))
    assert types["strata"].mat.varying == types["lax"].mat.varying
    assert types["strata"].shape == types["lax"].shape and types["strata"].dtype == types["lax"].dtype


@pytest.fixture(scope="module")
def explicit_mesh():
    return jax.make_mesh((2, 4), AXES, axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:8])


@pytest.mark.parametrize("name", ["sum", "max", "all_gather_tiled", "reduce_scatter", "all_to_all", "ppermute",
                                  "broadcast"])
def test_explicit_axis_mesh_eager_jitted_and_vmapped(explicit_mesh, name):
    """Under jax.set_mesh of an Explicit-axis mesh: eager and jitted shard_map,
    and vmap of them, give the twin's values, shardings and types."""
    sop, lop, shape, axis = OPS[name]
    x = random_array(np.random.default_rng(9), (3, 8 * shape[0]) + shape[1:], np.float32)
    with jax.set_mesh(explicit_mesh):
        xs = jax.device_put(x, NamedSharding(explicit_mesh, P(None, AXES)))
        for transform in ("eager", "jit", "vmap_eager", "vmap_jit"):
            results = []
            for op in (sop, lop):
                f = jax.shard_map(lambda u, op=op: op(u, axis), in_specs=SPEC, out_specs=SPEC)
                if transform.startswith("vmap"):
                    f = jax.vmap(f)
                if transform.endswith("jit"):
                    f = jax.jit(f)
                results.append(f(xs if transform.startswith("vmap") else xs[0]))
            got, want = results
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5, err_msg=transform)
            assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (transform, got.sharding, want.sharding)
            assert jax.typeof(got) == jax.typeof(want), transform


def test_second_order_through_a_pytree_with_a_symbolic_zero(mesh8):
    x = jax.device_put(random_array(np.random.default_rng(10), (8 * 2, 3), np.float64), NamedSharding(mesh8, P("x")))

    def loss(op):
        def f(v):
            tree = {"used": jnp.sin(v), "unused": v * 2.0, "int": jnp.ones(v.shape, jnp.int32)}
            out = jax.shard_map(lambda t: op(t, "x"), mesh=mesh8, in_specs=P("x"), out_specs=P("x"))(tree)
            return (out["used"] ** 3).sum()
        return f

    for order in (jax.grad, jax.hessian):
        got = jax.jit(order(loss(strata.all_reduce)))(x)
        want = jax.jit(order(loss(lax.psum)))(x)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    grads = jax.jit(jax.grad(lambda t: (strata_tree_loss(t, mesh8))))({"a": x, "b": x})
    np.testing.assert_array_equal(grads["b"], np.zeros_like(x))


def strata_tree_loss(tree, mesh):
    out = jax.shard_map(lambda t: strata.all_gather(t, "x", tiled=True), mesh=mesh, in_specs=P("x"),
                        out_specs=P("x"))(tree)
    return (out["a"] ** 2).sum() + 0.0 * jax.lax.stop_gradient(out["b"]).sum()


def test_checkpoint_scan_while_cond(mesh8):
    x = jax.device_put(random_array(np.random.default_rng(11), (8 * 2, 3), np.float64), NamedSharding(mesh8, P("x")))

    def program(ar, gather, perm):
        def body(u):
            step = jax.checkpoint(lambda c: jnp.sin(ar(c, "x")) * 0.1 + perm(c, "x", [(i, (i + 1) % 8) for i in range(8)]))
            u = lax.scan(lambda c, _: (step(c), None), u, None, length=3)[0]
            u = lax.fori_loop(0, 2, lambda i, c: c + 0.1 * jnp.cos(ar(c, "x")), u)
            # The predicate is the same on every rank (it is reduced), so all take one branch.
            u = lax.cond(ar(u, "x").sum() > 0, lambda c: gather(c, "x").sum(0), lambda c: -c, u)
            return u
        f = jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x"))
        loss = lambda v: (f(v) ** 2).sum()
        return jax.jit(lambda v: (f(v), jax.grad(loss)(v), jax.jvp(f, (v,), (jnp.cos(v),))[1]))(x)

    got = program(strata.all_reduce, strata.all_gather, strata.ppermute)
    want = program(lax.psum, lax.all_gather, lax.ppermute)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.complex64])
def test_bit_identical_across_reruns_and_ranks(mesh8, dtype):
    x = jax.device_put(random_array(np.random.default_rng(12), (8 * 64, 33), dtype), NamedSharding(mesh8, P("x")))
    second_op = "prod" if dtype == np.complex64 else "max"  # complex numbers have no max
    f = jax.jit(jax.shard_map(lambda v: (strata.all_reduce(v, "x"), strata.reduce_scatter(v, "x", tiled=True),
                                         jax.grad(lambda w: strata.all_reduce(w, "x", op=second_op).real.sum(),
                                                  holomorphic=False)(v) if dtype != np.complex64 else
                                         strata.all_reduce(v, "x", op=second_op)),
                              mesh=mesh8, in_specs=P("x"), out_specs=P("x")))
    first = [np.asarray(o) for o in f(x)]
    second = [np.asarray(o) for o in f(x)]
    for a, b in zip(first, second):
        assert a.tobytes() == b.tobytes()
    per_rank = first[0].reshape(8, 64, 33)
    assert all(per_rank[r].tobytes() == per_rank[0].tobytes() for r in range(8))


def test_empty_operands_through_every_transform(mesh8):
    x = jax.device_put(np.zeros((8 * 8, 0, 3), np.float32), NamedSharding(mesh8, P("x")))
    empty_vectors = [jnp.zeros(8, jnp.int32)] * 4
    for op in (lambda v: strata.all_reduce(v, "x", op="prod"), lambda v: strata.all_gather(v, "x", axis=1, tiled=True),
               lambda v: strata.reduce_scatter(v, "x", tiled=True), lambda v: strata.all_to_all(v, "x", 0, 2, tiled=True),
               lambda v: strata.ragged_all_to_all(v, v, *empty_vectors, axis_name="x")):
        f = jax.shard_map(op, mesh=mesh8, in_specs=P("x"), out_specs=P("x"))
        y, y_dot = jax.jit(lambda v: jax.jvp(f, (v,), (v,)))(x)
        g = jax.jit(jax.grad(lambda v: f(v).sum()))(x)
        assert y.size == y_dot.size == g.size == 0 and g.shape == x.shape


def test_python_scalars_keep_the_twins_weak_type(mesh8):
    """strata.all_reduce(2.0, ...) * bf16 stays bf16, as with lax.psum."""
    pairs = [(lambda u: strata.all_reduce(u, "x"), lambda u: lax.psum(u, "x")),
             (lambda u: strata.all_reduce(u, "x", op="mean"), lambda u: lax.pmean(u, "x")),
             (lambda u: strata.all_gather(u, "x"), lambda u: lax.all_gather(u, "x")),
             (lambda u: strata.ppermute(u, "x", [(0, 1)]), lambda u: lax.ppermute(u, "x", [(0, 1)]))]
    seen = []

    def body(v):
        for sop, lop in pairs:
            s, w = sop(2.5), lop(2.5)
            seen.append((jax.typeof(s), jax.typeof(w), (s * v).dtype, (w * v).dtype))
        return v

    jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x")))(jnp.ones(8, jnp.bfloat16))
    for s_type, l_type, s_dtype, l_dtype in seen:
        assert (s_type.shape, s_type.dtype, s_type.weak_type, s_type.mat.varying) == \
            (l_type.shape, l_type.dtype, l_type.weak_type, l_type.mat.varying)
        assert s_type.weak_type and s_dtype == l_dtype == jnp.bfloat16
