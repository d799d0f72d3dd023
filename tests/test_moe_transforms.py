"""strata.moe's dispatch and combine as JAX primitives: jax.jvp, jax.linear_transpose,
jax.grad (and a second derivative through the backward op) and jax.vmap, inside
shard_map on a 1-D and a 2-D mesh, in float32 and bfloat16, against the library's
lax.all_to_all reference under the same transform (or, for vmap, against a loop of
single calls)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stratacl_jax as strata
from conftest import random_array, shard_run
from stratacl_jax import moe

T, H, K, E = 8, 4, 2, 16
CAP = 3  # 8 ranks x 8 tokens x top-2 / 16 experts = 8 pairs per expert on average: drops
B = 3  # batch of independent exchanges under vmap

MESHES = [("mesh8", "x"), ("mesh2x4", "npu")]  # (fixture, expert axis); "npu" is two groups of 4
DTYPES = ["float32", jnp.bfloat16]


def tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if np.dtype(dtype) == np.float32 else dict(rtol=2e-2, atol=2e-2)


def close(a, b, dtype, what=""):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), err_msg=what,
                               **tolerance(dtype))


def ranks_of(mesh):
    return mesh.devices.size


def ops(axis):
    """(dispatch, combine) of strata and of the reference, one signature:
    dispatch(x, idx) -> (recv, state); combine(ey, state, w) -> y."""
    strata_ops = (lambda x, i: strata.moe.dispatch(x, i, axis_name=axis, num_experts=E, capacity=CAP),
                  lambda ey, hd, w: strata.moe.combine(ey, hd, w))
    reference_ops = (lambda x, i: moe.reference_dispatch(x, i, axis_name=axis, num_experts=E, capacity=CAP),
                     lambda ey, st, w: moe.reference_combine(ey, st, w, axis_name=axis))
    return strata_ops, reference_ops


def data(mesh, axis, dtype, seed):
    """Per-rank slices stacked on dim 0: x [T, H], idx [T, K], w [T, K], expert
    rows ey [E_local, CAP, H] and a second set of each (tangents, cotangents)."""
    rng = np.random.default_rng(seed)
    n = ranks_of(mesh)
    group = mesh.shape[axis]
    el = E // group
    x, dx = (random_array(rng, (n * T, H), dtype) for _ in range(2))
    idx = rng.integers(0, E, (n * T, K)).astype(np.int32)
    w, dw = (random_array(rng, (n * T, K), np.float32) for _ in range(2))
    ey, dey = (random_array(rng, (n * el, CAP, H), dtype) for _ in range(2))
    ct = random_array(rng, (n * T, H), dtype)
    return x, dx, idx, w, dw, ey, dey, ct


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mesh_name,axis", MESHES)
def test_jvp(request, mesh_name, axis, dtype):
    mesh = request.getfixturevalue(mesh_name)
    x, dx, idx, w, dw, ey, dey, _ = data(mesh, axis, dtype, seed=1)

    def body(dispatch, combine):
        def per_rank(x, dx, idx, w, dw, ey, dey):
            recv, d_recv = jax.jvp(lambda x: dispatch(x, idx)[0], (x,), (dx,))
            state = dispatch(x, idx)[1]
            y, dy = jax.jvp(lambda ey, w: combine(ey, state, w), (ey, w), (dey, dw))
            _, dy_rows = jax.jvp(lambda ey: combine(ey, state, w), (ey,), (dey,))
            _, dy_weights = jax.jvp(lambda w: combine(ey, state, w), (w,), (dw,))
            return recv, d_recv, y, dy, dy_rows, dy_weights
        return per_rank

    (s_disp, s_comb), (r_disp, r_comb) = ops(axis)
    got = shard_run(body(s_disp, s_comb), mesh, x, dx, idx, w, dw, ey, dey)
    want = shard_run(body(r_disp, r_comb), mesh, x, dx, idx, w, dw, ey, dey)
    np.testing.assert_array_equal(got[1], want[1])  # dispatch copies rows: its tangent is exact
    np.testing.assert_array_equal(got[1], shard_run(lambda dx, idx: s_disp(dx, idx)[0], mesh, dx, idx))
    for a, b in zip(got[2:], want[2:]):
        close(a, b, dtype)
    close(got[3], got[4].astype(np.float64) + got[5].astype(np.float64), dtype)  # the sum of both parts


def by_vjp(f, primal):
    """The transpose of a linear f as its VJP (the reference's scatters have
    no transpose rule)."""
    return lambda ct: jax.vjp(f, primal)[1](ct)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mesh_name,axis", MESHES)
def test_linear_transpose(request, mesh_name, axis, dtype):
    mesh = request.getfixturevalue(mesh_name)
    x, _, idx, w, _, ey, _, ct = data(mesh, axis, dtype, seed=2)
    ct_recv = ey  # a cotangent of recv_x has recv_x's shape

    def body(dispatch, combine, transpose):
        def per_rank(x, idx, w, ey, ct, ct_recv):
            (ct_x,) = transpose(lambda x: dispatch(x, idx)[0], x)(ct_recv)
            state = dispatch(x, idx)[1]
            (ct_ey,) = transpose(lambda ey: combine(ey, state, w), ey)(ct)
            (ct_w,) = transpose(lambda w: combine(ey, state, w), w)(ct)
            return ct_x, ct_ey, ct_w
        return per_rank

    (s_disp, s_comb), (r_disp, r_comb) = ops(axis)
    got = shard_run(body(s_disp, s_comb, jax.linear_transpose), mesh, x, idx, w, ey, ct, ct_recv)
    want = shard_run(body(r_disp, r_comb, by_vjp), mesh, x, idx, w, ey, ct, ct_recv)
    for name, a, b in zip(("x", "expert_y", "weights"), got, want):
        close(a, b, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mesh_name,axis", MESHES)
def test_grad_and_second_derivatives(request, mesh_name, axis, dtype):
    """grad of a dispatch -> experts -> combine step in x, expert weights and
    router weights; then forward-over-reverse and reverse-over-reverse (through
    the backward op's own JVP and transpose)."""
    mesh = request.getfixturevalue(mesh_name)
    x, dx, idx, w, dw, ey, _, ct = data(mesh, axis, dtype, seed=3)
    scale = ey[:, :1, :]  # a per-expert, per-feature scale stands in for the experts

    def body(dispatch, combine):
        def loss(x, w, scale, idx, ct):
            recv, state = dispatch(x, idx)
            y = combine(jnp.tanh(recv * scale), state, w)
            return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))

        def per_rank(x, dx, idx, w, dw, scale, ct):
            grads = jax.grad(loss, argnums=(0, 1, 2))(x, w, scale, idx, ct)
            g = lambda x, w: jax.grad(loss, argnums=(0, 1))(x, w, scale, idx, ct)
            _, hvp = jax.jvp(g, (x, w), (dx, dw))
            gg = jax.grad(lambda x, w: sum(jnp.sum(v.astype(jnp.float32) ** 2) for v in g(x, w)),
                          argnums=(0, 1))(x, w)
            return (*grads, *hvp, *gg)
        return per_rank

    (s_disp, s_comb), (r_disp, r_comb) = ops(axis)
    got = shard_run(body(s_disp, s_comb), mesh, x, dx, idx, w, dw, scale, ct)
    want = shard_run(body(r_disp, r_comb), mesh, x, dx, idx, w, dw, scale, ct)
    assert np.abs(np.asarray(got[3], np.float64)).max() > 0  # the second derivatives are not trivially zero
    for name, a, b in zip(("x", "w", "scale", "hvp x", "hvp w", "gg x", "gg w"), got, want):
        close(a, b, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mesh_name,axis", MESHES)
def test_vmap_is_a_loop_of_exchanges(request, mesh_name, axis, dtype):
    """vmap over a leading batch of B independent exchanges (each with its own
    routing, or one routing shared) equals B calls, one after another; the
    batched JVP and gradient too."""
    mesh = request.getfixturevalue(mesh_name)
    n = ranks_of(mesh)
    rng = np.random.default_rng(4)
    el = E // mesh.shape[axis]
    # [n * B * T, ...] so each rank's slice is [B * T, ...]; reshaped to [B, T, ...] per rank.
    x = random_array(rng, (n * B * T, H), dtype)
    idx = rng.integers(0, E, (n * B * T, K)).astype(np.int32)
    w = random_array(rng, (n * B * T, K), np.float32)
    ey = random_array(rng, (n * B * el, CAP, H), dtype)
    (disp, comb), _ = ops(axis)

    def step(x, idx, w, ey):
        recv, hd = disp(x, idx)
        y = comb(ey + recv, hd, w)
        return recv, y, hd.recv_counts, hd.dropped[None], hd.pair_slot

    def grads(x, idx, w, ey):
        return jax.grad(lambda x, w, ey: jnp.sum(step(x, idx, w, ey)[1].astype(jnp.float32) ** 2),
                        argnums=(0, 1, 2))(x, w, ey)

    def batched(fn, shared_idx):
        def per_rank(x, idx, w, ey):
            x, idx, w = (v.reshape((B, T) + v.shape[1:]) for v in (x, idx, w))
            ey = ey.reshape((B, el) + ey.shape[1:])
            if shared_idx:
                return jax.vmap(lambda x, w, ey: fn(x, idx[0], w, ey))(x, w, ey)
            return jax.vmap(fn)(x, idx, w, ey)
        return per_rank

    def looped(fn, shared_idx):
        def per_rank(x, idx, w, ey):
            x, idx, w = (v.reshape((B, T) + v.shape[1:]) for v in (x, idx, w))
            ey = ey.reshape((B, el) + ey.shape[1:])
            outs = [fn(x[b], idx[0 if shared_idx else b], w[b], ey[b]) for b in range(B)]
            return jax.tree.map(lambda *vs: jnp.stack(vs), *outs)
        return per_rank

    for fn in (step, grads):
        for shared_idx in (False, True):
            got = shard_run(batched(fn, shared_idx), mesh, x, idx, w, ey)
            want = shard_run(looped(fn, shared_idx), mesh, x, idx, w, ey)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
    assert (shard_run(batched(step, False), mesh, x, idx, w, ey)[3] > 0).any()  # capacity drops happened


def test_combine_is_not_linear_in_both_at_once(mesh8):
    x, _, idx, w, _, ey, _, ct = data(mesh8, "x", "float32", seed=5)

    def per_rank(x, idx, w, ey, ct):
        handle = strata.moe.dispatch(x, idx, axis_name="x", num_experts=E, capacity=CAP)[1]
        return jax.linear_transpose(lambda ey, w: strata.moe.combine(ey, handle, w), ey, w)(ct)

    with pytest.raises(NotImplementedError, match="strata.moe.combine is bilinear"):
        shard_run(per_rank, mesh8, x, idx, w, ey, ct)
