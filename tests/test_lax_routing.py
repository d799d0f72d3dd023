"""strata.config(lax_collectives="strata"): unmodified lax programs on strata.

Each program is written with jax.lax collectives only (the shard_map
tutorial's patterns). With the switch on, the compiled HLO holds no XLA
collective (the gradients' psum_invariant from the transpose of shard_map's
implicit pvary included) and values and gradients equal the switch-off run
bit for bit (strata's sum, gather, scatter, all-to-all and permute are
bitwise lax's on these float32 programs)."""
import re

import numpy as np
import pytest

import stratacl_jax as strata
from conftest import P, NamedSharding, jax

from jax import lax
import jax.numpy as jnp

XLA_COLLECTIVES = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
                             r"collective-broadcast|ragged-all-to-all)")


def _run_both(f, *args):
    """(switch-off result, switch-on result, switch-on compiled HLO); each
    run traces afresh (a new jax.jit of f)."""
    off = jax.jit(f)(*args)
    with strata.config(lax_collectives="strata"):
        compiled = jax.jit(f).lower(*args).compile()
    on = compiled(*args)
    return off, on, compiled.as_text()


def _assert_routed(hlo):
    found = sorted(set(XLA_COLLECTIVES.findall(hlo)))
    assert not found, f"XLA collectives left in the routed program: {found}"
    assert "strata_" in hlo


def _assert_same(off, on, exact=True):
    for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(on)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_data_parallel_training_with_check_vma(mesh8):
    """Replicated parameters under check_vma=True: their gradients are reduced by
    the psum_invariant jax inserts (transpose of pvary), which must route too."""
    params = {"w": _rand(16, 8, seed=1), "b": _rand(8, seed=2)}
    batch = _rand(64, 16, seed=3)

    def loss(params, x):
        y = jnp.tanh(x @ params["w"] + params["b"])
        return lax.pmean(jnp.mean(y ** 2), "x")

    step_loss = jax.shard_map(loss, mesh=mesh8, in_specs=(P(), P("x")), out_specs=P())

    def train_step(params, x):
        value, grads = jax.value_and_grad(step_loss)(params, x)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    strata.reset_stats()
    off, on, hlo = _run_both(train_step, params, _put(mesh8, batch, P("x")))
    _assert_routed(hlo)
    _assert_same(off, on)
    routed = strata.stats()["lax_routed"]
    assert routed.get("psum_invariant", 0) >= 3, routed  # loss + the two gradients


def test_fsdp(mesh8):
    """Parameters sharded over the data axis, gathered per layer (all_gather;
    its transpose is psum_scatter), in a scan over layers."""
    ws = _rand(3, 16, 16, seed=4) * 0.3
    x = _rand(32, 16, seed=5)

    def loss(ws, x):
        def layer(h, w):
            w = lax.all_gather(w, "x", tiled=True)
            return jnp.tanh(h @ w), None

        h, _ = lax.scan(layer, x, ws)
        return lax.psum(jnp.sum(h ** 2), "x")

    f = jax.shard_map(loss, mesh=mesh8, in_specs=(P(None, "x"), P("x")), out_specs=P())
    grad = jax.value_and_grad(f)
    off, on, hlo = _run_both(grad, _put(mesh8, ws, P(None, "x")), _put(mesh8, x, P("x")))
    _assert_routed(hlo)
    _assert_same(off, on)


def test_tp_collective_matmul_in_fori_loop(mesh8):
    """The tutorial's collective matmul: lhs blocks travel the ring by ppermute
    in a fori_loop while each rank multiplies the block it holds."""
    n = 8
    lhs, rhs = _rand(64, 32, seed=6), _rand(32, 64, seed=7)

    def matmul(lhs_block, rhs_block):
        idx = lax.axis_index("x")
        out = lax.pcast(jnp.zeros((lhs_block.shape[0] * n, rhs_block.shape[1]), lhs_block.dtype), "x",
                        to="varying")

        def body(i, carry):
            out, block = carry
            src = (idx + i) % n
            out = lax.dynamic_update_slice_in_dim(out, block @ rhs_block, src * block.shape[0], axis=0)
            block = lax.ppermute(block, "x", [(j, (j - 1) % n) for j in range(n)])
            return out, block

        out, _ = lax.fori_loop(0, n, body, (out, lhs_block))
        return out

    f = jax.shard_map(matmul, mesh=mesh8, in_specs=(P("x"), P(None, "x")), out_specs=P(None, "x"))

    def value_and_grad(lhs, rhs):
        return f(lhs, rhs), jax.grad(lambda a, b: jnp.sum(jnp.sin(f(a, b))), argnums=(0, 1))(lhs, rhs)

    off, on, hlo = _run_both(value_and_grad, _put(mesh8, lhs, P("x")), _put(mesh8, rhs, P(None, "x")))
    _assert_routed(hlo)
    _assert_same(off, on)
    np.testing.assert_allclose(np.asarray(on[0]), lhs @ rhs, rtol=1e-4, atol=1e-4)


def test_tp_mlp_with_remat_in_scan_on_a_2d_mesh(mesh2x4):
    """Megatron MLP (column then row parallel, psum) per layer under
    jax.checkpoint inside lax.scan, data parallel over 'node', tensor
    parallel over 'npu'; loss pmean over 'node'."""
    w1, w2 = _rand(2, 16, 32, seed=8) * 0.3, _rand(2, 32, 16, seed=9) * 0.3
    x = _rand(8, 16, seed=10)

    @jax.checkpoint
    def block(h, w):
        a, b = w
        return h + lax.psum(jax.nn.gelu(h @ a) @ b, "npu")

    def loss(w1, w2, x):
        h, _ = lax.scan(lambda h, w: (block(h, w), None), x, (w1, w2))
        return lax.pmean(jnp.mean(h ** 2), "node")  # h is npu-invariant after the psum

    f = jax.shard_map(loss, mesh=mesh2x4, in_specs=(P(None, None, "npu"), P(None, "npu"), P("node")),
                      out_specs=P())
    g = jax.value_and_grad(f, argnums=(0, 1))
    off, on, hlo = _run_both(g, _put(mesh2x4, w1, P(None, None, "npu")), _put(mesh2x4, w2, P(None, "npu")),
                             _put(mesh2x4, x, P("node")))
    _assert_routed(hlo)
    _assert_same(off, on)


def test_vmap_of_a_jitted_shard_map(mesh8):
    """vmap over a jitted shard_map with psum, all_gather and psum_scatter,
    plus a psum over the vmap axis itself (which stays local: no traffic)."""
    x = _rand(3, 64, seed=11)

    inner = jax.jit(jax.shard_map(
        lambda v: (lax.psum(v, "x"), lax.all_gather(v, "x", tiled=True, to="invarying"),
                   lax.psum_scatter(v, "x", tiled=True)),
        mesh=mesh8, in_specs=P("x"), out_specs=(P(), P(), P("x"))))

    def f(x):
        return jax.vmap(inner)(x)

    def g(x):  # a vmap inside the shard_map: psum over (vmap axis, mesh axis)
        body = jax.vmap(lambda r: lax.psum(r, ("b", "x")) * lax.axis_index("b"), axis_name="b")
        return jax.shard_map(body, mesh=mesh8, in_specs=P(None, "x"), out_specs=P(), check_vma=False)(x)

    off, on, hlo = _run_both(f, _put(mesh8, x, P(None, "x")))
    _assert_routed(hlo)
    _assert_same(off, on)
    off, on, hlo = _run_both(g, _put(mesh8, x, P(None, "x")))
    _assert_routed(hlo)
    _assert_same(off, on)


def test_gpipe_scan(mesh8):
    """GPipe: 8 stages, micro-batches shifted stage to stage by ppermute in a
    scan; gradient through the whole pipeline."""
    n, mb, micro = 8, 4, 6
    ws = _rand(n, 16, 16, seed=12) * 0.4
    xs = _rand(micro, mb, 16, seed=13)

    def pipeline(w, xs):
        w = w[0]
        stage = lax.axis_index("x")
        steps = micro + n - 1
        inputs = jnp.concatenate([xs, jnp.zeros((n - 1,) + xs.shape[1:], xs.dtype)])

        def step(carry, t):
            state, outs = carry
            state = jnp.where(stage == 0, inputs[t], state)
            state = jnp.tanh(state @ w)
            outs = outs.at[t].set(state)
            state = lax.ppermute(state, "x", [(i, (i + 1) % n) for i in range(n)])
            return (state, outs), None

        outs = jnp.zeros((steps,) + xs.shape[1:], xs.dtype)
        init = lax.pcast((jnp.zeros_like(xs[0]), outs), "x", to="varying")
        (_, outs), _ = lax.scan(step, init, jnp.arange(steps))
        last = outs[n - 1:]
        return lax.psum(jnp.where(stage == n - 1, jnp.sum(last ** 2), 0.0), "x")

    f = jax.shard_map(pipeline, mesh=mesh8, in_specs=(P("x"), P()), out_specs=P())
    g = jax.value_and_grad(f)
    off, on, hlo = _run_both(g, _put(mesh8, ws, P("x")), xs)
    _assert_routed(hlo)
    _assert_same(off, on)


def test_every_routed_primitive_and_what_stays_on_xla(mesh8, mesh2x4):
    """all_to_all, pmax/pmin, all_gather(to="invarying"), ppermute over an axis tuple
    given out of mesh order; axis_index_groups stays on XLA and is counted."""
    x = _rand(8 * 8, 4, seed=14)

    def body(v):
        a = lax.all_to_all(v, ("npu", "node"), 0, 0, tiled=True)
        b = lax.pmax(v, "npu") + lax.pmin(v, "node")
        c = lax.all_gather(v, ("node", "npu"), tiled=True, to="invarying")
        d = lax.ppermute(v, ("npu", "node"), [(i, (i + 3) % 8) for i in range(8)])
        e = lax.psum_scatter(v, "npu", scatter_dimension=0, tiled=True)
        f = lax.all_to_all(v.reshape(4, 2, 4), "node", 1, 2, tiled=True)
        return a, b, c, d, e, f

    spec = P(("node", "npu"))
    f = jax.shard_map(body, mesh=mesh2x4, in_specs=spec, out_specs=(spec, spec, P(), spec, spec, spec))
    xs = _put(mesh2x4, x, P(("node", "npu")))
    off, on, hlo = _run_both(f, xs)
    _assert_routed(hlo)
    _assert_same(off, on)
    # Negative dimensions: XLA cannot lower them in jax 0.10.2 (psum_scatter
    # fails verification, all_to_all crashes), so compare with the positive
    # spelling's switch-off run.
    neg = jax.shard_map(lambda v: (lax.psum_scatter(v, "npu", scatter_dimension=-2, tiled=True),
                                   lax.all_to_all(v.reshape(4, 2, 4), "node", -2, -1, tiled=True)),
                        mesh=mesh2x4, in_specs=spec, out_specs=(spec, spec))
    with strata.config(lax_collectives="strata"):
        got = jax.jit(neg)(xs)
    _assert_same(off[4:], got)

    grouped = jax.shard_map(lambda v: lax.psum(v, "x", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]),
                            mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    strata.reset_stats()
    off, on, hlo = _run_both(grouped, _put(mesh8, x, P("x")))
    _assert_same(off, on)
    assert "all-reduce" in hlo
    assert strata.stats()["lax_left_to_xla"] == {"psum: axis_index_groups": 1}


def test_switch_off_programs_stay_on_xla(mesh8):
    f = jax.jit(jax.shard_map(lambda v: lax.psum(v, "x"), mesh=mesh8, in_specs=P("x"), out_specs=P()))
    x = _put(mesh8, _rand(8, 4, seed=15), P("x"))
    assert "all-reduce" in f.lower(x).compile().as_text()
    with strata.config(lax_collectives="strata"):
        assert strata.config().__enter__().lax_collectives == "strata"
    with pytest.raises(ValueError, match="lax_collectives must be one of"):
        strata.config(lax_collectives="nccl")


def test_parity_constant_sum_folds_to_the_axis_size(mesh8):
    seen = {}

    def body(v):
        seen["strata"] = strata.all_reduce(1, "x")
        seen["lax"] = lax.psum(1, "x")
        seen["mean"] = (strata.all_reduce(2.0, "x", op="mean"), lax.pmean(2.0, "x"))
        for i in range(strata.all_reduce(1, "x")):  # the tutorial's loop
            v = v + i
        return v

    jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P("x")))(jnp.ones(8))
    assert seen["strata"] == seen["lax"] == 8 and type(seen["strata"]) is type(seen["lax"])
    assert seen["mean"][0] == seen["mean"][1]


def test_parity_axis_index_groups_none_is_accepted(mesh8):
    x = _put(mesh8, _rand(64, seed=16), P("x"))

    def body(v):
        return (strata.all_reduce(v, "x", axis_index_groups=None),
                strata.all_gather(v, "x", axis_index_groups=None, tiled=True),
                strata.reduce_scatter(v, "x", axis_index_groups=None, tiled=True),
                strata.all_to_all(v, "x", 0, 0, tiled=True, axis_index_groups=None))

    f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=(P(), P("x"), P("x"), P("x"))))
    g = jax.jit(jax.shard_map(
        lambda v: (lax.psum(v, "x"), lax.all_gather(v, "x", tiled=True), lax.psum_scatter(v, "x", tiled=True),
                   lax.all_to_all(v, "x", 0, 0, tiled=True)),
        mesh=mesh8, in_specs=P("x"), out_specs=(P(), P("x"), P("x"), P("x"))))
    _assert_same(g(x), f(x))
    with pytest.raises(NotImplementedError, match="axis_index_groups=.* is not supported"):
        jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "x", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]),
                              mesh=mesh8, in_specs=P("x"), out_specs=P("x"), check_vma=False))(x)


def test_parity_gather_to_reduced_is_a_clear_error(mesh8):
    x = _put(mesh8, _rand(64, seed=17), P("x"))
    with pytest.raises(NotImplementedError, match="to='reduced' is not supported.*Varying -> Reduced"):
        jax.jit(jax.shard_map(lambda v: strata.all_gather(v, "x", to="reduced"), mesh=mesh8, in_specs=P("x"),
                              out_specs=P()))(x)


def test_ops_xla_cpu_cannot_run_work_routed(mesh8):
    """lax.pbroadcast (jax 0.10.2 lowers it only on GPU) and
    lax.ragged_all_to_all (jax#34755) run on CPU once routed; checked against
    numpy (there is no switch-off run to compare with)."""
    from test_ragged_all_to_all import VECTORS, args_of, make_case, reference, run_per_rank

    x = _rand(8, 5, seed=18)
    f = jax.jit(jax.shard_map(lambda v: lax.pbroadcast(v, "x", source=3), mesh=mesh8, in_specs=P("x"),
                              out_specs=P("x")))
    with strata.config(lax_collectives="strata"):
        got = f(_put(mesh8, x, P("x")))
    np.testing.assert_array_equal(np.asarray(got), np.tile(x[3:4], (8, 1)))

    c = make_case(np.random.default_rng(19), 8)

    def body(op, out, *vs):
        return lax.ragged_all_to_all(op, out, *vs, axis_name="x")

    with strata.config(lax_collectives="strata"):
        got = run_per_rank(body, mesh8, *args_of(c))
    np.testing.assert_array_equal(got, reference(c))
    assert set(VECTORS) <= set(c)
