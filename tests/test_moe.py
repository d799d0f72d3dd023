"""strata.moe on 8 emulated NPUs: dispatch/combine against an exact numpy
model of the layout (order by (source rank, token, k), capacity, drops), the
layer and its gradients against a dense single-device MoE and against the
lax.all_to_all reference, skewed and empty routing, bad ids, scan, stats."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from stratacl_jax import moe

N, T, H, K, E, F = 8, 16, 8, 2, 16, 8
EL = E // N


def place(mesh, *arrays, spec=None):
    spec = P(mesh.axis_names) if spec is None else spec
    return [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]


def smap(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def np_layout(idx_all, num_experts, capacity):
    """The contract in numpy. idx_all [N, T, K] -> slot [N, T, K] (e*C + row or
    -1), counts [E] (capped), dropped [N]."""
    n, t, k = idx_all.shape
    fill = np.zeros(num_experts, np.int64)
    slot = np.full(idx_all.shape, -1, np.int64)
    for r in range(n):
        for i in range(t):
            for j in range(k):
                e = idx_all[r, i, j]
                if fill[e] < capacity:
                    slot[r, i, j] = e * capacity + fill[e]
                fill[e] += 1
    return slot, np.minimum(fill, capacity), (slot < 0).sum(axis=(1, 2))


def np_dispatch(x_all, slot, num_experts, capacity):
    recv = np.zeros((num_experts * capacity,) + x_all.shape[2:], x_all.dtype)
    for (r, i, j), s in np.ndenumerate(slot):
        if s >= 0:
            recv[s] = x_all[r, i]
    return recv.reshape(num_experts, capacity, -1)


def np_combine(ey_all, slot, w_all):
    rows = ey_all.reshape(-1, ey_all.shape[-1]).astype(np.float64)
    got = np.where(slot[..., None] >= 0, rows[np.maximum(slot, 0)], 0.0)
    return (w_all[..., None].astype(np.float64) * got).sum(2)


def dispatch_combine_body(x, idx, w, scale, capacity):
    """dispatch, a per-row scale (stands in for the experts), combine."""
    recv, hd = strata.moe.dispatch(x, idx, axis_name="x", num_experts=E, capacity=capacity)
    y = strata.moe.combine(recv * scale, hd, w)
    return recv, hd.recv_counts, hd.dropped[None], y


def reference_body(x, idx, w, scale, capacity):
    recv, st = moe.reference_dispatch(x, idx, axis_name="x", num_experts=E, capacity=capacity)
    y = moe.reference_combine(recv * scale, st, w, axis_name="x")
    return recv, st["recv_counts"], st["dropped"][None], y


def routing(seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, E, (N, T, K)).astype(np.int32)  # repeats within a token allowed
    return rng, idx


@pytest.mark.parametrize("dtype", ["float32", jnp.bfloat16, "float16", "float64"], ids=str)
def test_dispatch_combine_exact_with_drops(mesh8, dtype):
    cap = 3  # tight: 32 pairs per expert on average
    rng, idx = routing(1)
    x = rng.integers(-8, 9, (N, T, H)).astype(dtype)  # exact in every dtype
    w = (2.0 ** -rng.integers(0, 3, (N, T, K))).astype(np.float32)
    scale = rng.integers(1, 4, (E, cap, H)).astype(dtype)
    slot, counts, dropped = np_layout(idx, E, cap)
    args = place(mesh8, x.reshape(N * T, H), idx.reshape(N * T, K), w.reshape(N * T, K), scale)
    spec = P("x")
    f = smap(lambda *a: dispatch_combine_body(*a, cap), mesh8, (spec,) * 4, spec)
    recv, got_counts, got_dropped, y = jax.tree.map(np.asarray, f(*args))

    want_recv = np_dispatch(x, slot, E, cap)
    np.testing.assert_array_equal(recv.reshape(E, cap, H), want_recv)
    rows = np.arange(cap)[None, :, None]
    assert not np.any(recv.reshape(E, cap, H) * (rows >= counts[:, None, None]))  # zero past count
    np.testing.assert_array_equal(got_counts, counts)
    np.testing.assert_array_equal(got_dropped, dropped)
    assert dropped.sum() == N * T * K - counts.sum() > 0
    want_y = np_combine(want_recv.astype(np.float64) * scale, slot, w)
    np.testing.assert_array_equal(y.reshape(N, T, H).astype(np.float64), want_y)

    # The lax.all_to_all reference keeps the same layout and drop rule.
    ref = smap(lambda *a: reference_body(*a, cap), mesh8, (spec,) * 4, spec)
    for got, want in zip(jax.tree.map(np.asarray, ref(*args)), (recv, got_counts, got_dropped, y)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", jnp.bfloat16], ids=str)
@pytest.mark.parametrize("comm_buffer_bytes", [1 << 30, 48 * 40], ids=["whole", "rounds"])
def test_dispatch_buffer_centric_matches_numpy(mesh8, dtype, comm_buffer_bytes):
    """buffer_centric dispatch, whole and in uneven rounds of columns (48
    blocks x 40 B windows of 148 B rows of float32: 40+40+40+28,
    of 74 B bfloat16 rows: 40+34): what crossed is
    staged out, and the owning rank fans a token out to its other experts and
    zeroes empty rows itself, round by round."""
    t, h, k, cap = 48, 37, 4, 60  # 2 experts per rank, 4 of 16 per token: fan-out on most ranks
    rng = np.random.default_rng(5)
    popularity = 1.0 / np.arange(1, E + 1)  # skewed: low experts overflow, high ones leave rows empty
    idx = rng.choice(E, (N, t, k), p=popularity / popularity.sum()).astype(np.int32)
    x = rng.standard_normal((N, t, h)).astype(dtype)
    slot, counts, dropped = np_layout(idx, E, cap)
    assert dropped.sum() > 0 and (counts < cap).any()  # drops and empty rows both
    args = place(mesh8, x.reshape(N * t, h), idx.reshape(N * t, k))
    spec = P("x")
    with strata.config(mode="buffer_centric", comm_buffer_bytes=comm_buffer_bytes):
        # A function made inside the config: jit keys its cache on the function, not on settings.
        f = smap(lambda x, i: (lambda r, hd: (r, hd.recv_counts, hd.dropped[None]))(
            *strata.moe.dispatch(x, i, axis_name="x", num_experts=E, capacity=cap)), mesh8, (spec,) * 2, spec)
        strata.reset_stats()
        recv, got_counts, got_dropped = jax.tree.map(np.asarray, f(*args))
        stats = strata.stats()
    np.testing.assert_array_equal(recv.reshape(E, cap, h), np_dispatch(x, slot, E, cap))
    np.testing.assert_array_equal(got_counts, counts)
    np.testing.assert_array_equal(got_dropped, dropped)
    assert stats["bytes_direct"] == 0 and stats["bytes_local"] > 0 and stats["bytes_staged"] > 0


def test_dispatch_combine_grads_match_reference(mesh8):
    """VJPs of dispatch (gather-sum) and combine (weighted scatter, dot
    products) with drops and repeated experts, against autodiff of the reference."""
    cap = 5
    rng, idx = routing(2)
    x = rng.standard_normal((N * T, H))
    w = rng.random((N * T, K))
    scale = rng.standard_normal((E, cap, H))
    g = rng.standard_normal((N * T, H))
    spec = P("x")
    args = place(mesh8, x, idx.reshape(N * T, K), w, scale, g)

    def loss(body):
        def per_rank(x, idx, w, scale, g):
            return jnp.sum(body(x, idx, w, scale, cap)[3] * g)[None]

        f = jax.shard_map(per_rank, mesh=mesh8, in_specs=(spec,) * 5, out_specs=spec)
        return jax.jit(jax.grad(lambda x, w, s, i, g: f(x, i, w, s, g).sum(), argnums=(0, 1, 2)))

    got = loss(dispatch_combine_body)(args[0], args[2], args[3], args[1], args[4])
    want = loss(reference_body)(args[0], args[2], args[3], args[1], args[4])
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def _layer_inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N * T, H)).astype(dtype)
    router = (rng.standard_normal((H, E)) / np.sqrt(H)).astype(dtype)
    w_in = (rng.standard_normal((E, H, F)) / np.sqrt(H)).astype(dtype)
    w_out = (rng.standard_normal((E, F, H)) / np.sqrt(F)).astype(dtype)
    g = rng.standard_normal((N * T, H)).astype(dtype)
    return x, router, w_in, w_out, g


def _layer_value_and_grad(layer, mesh, capacity, activation="gelu"):
    spec = P("x")

    def per_rank(x, router, w_in, w_out, g):
        y = layer(x, router, w_in, w_out, axis_name="x", top_k=K, capacity=capacity, activation=activation)
        return y, jnp.sum(y * g)[None]

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(spec, P(), spec, spec, spec), out_specs=spec)

    def loss(x, router, w_in, w_out, g):
        y, part = f(x, router, w_in, w_out, g)
        return part.sum(), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_layer_and_grads_match_dense(mesh8, activation):
    x, router, w_in, w_out, g = _layer_inputs(3)
    cap = N * T  # top-k experts are distinct, so no expert can overflow
    placed = place(mesh8, x) + place(mesh8, router, spec=P()) + place(mesh8, w_in, w_out, g)
    (_, y), grads = _layer_value_and_grad(strata.moe.expert_parallel_ffn, mesh8, cap, activation)(*placed)

    def dense_loss(x, router, w_in, w_out):
        y = moe.dense_moe_ffn(x, router, w_in, w_out, top_k=K, activation=activation)
        return jnp.sum(y * g), y

    (_, y_dense), dense_grads = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, router, w_in, w_out)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_dense), rtol=1e-4, atol=1e-5)
    for name, a, b in zip(("x", "router_w", "w_in", "w_out"), grads, dense_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=name)


def test_layer_tight_capacity_matches_reference(mesh8):
    x, router, w_in, w_out, g = _layer_inputs(4, np.float64)
    cap = 6  # N*T*K/E = 16 pairs per expert on average: many drops
    spec = P("x")
    placed = place(mesh8, x) + place(mesh8, router, spec=P()) + place(mesh8, w_in, w_out, g)
    (_, y), grads = _layer_value_and_grad(strata.moe.expert_parallel_ffn, mesh8, cap)(*placed)
    (_, y_ref), ref_grads = _layer_value_and_grad(moe.reference_expert_parallel_ffn, mesh8, cap)(*placed)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-10, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)

    # `dropped` is exactly the overflow of the routing the layer used.
    _, idx = moe.route(jnp.asarray(x), jnp.asarray(router), K)
    _, counts, dropped = np_layout(np.asarray(idx).reshape(N, T, K), E, cap)
    f = smap(lambda x, r: (lambda _, hd: (hd.recv_counts, hd.dropped[None]))(
        *strata.moe.dispatch(x, moe.route(x, r, K)[1], axis_name="x", num_experts=E, capacity=cap)),
        mesh8, (spec, P()), spec)
    got_counts, got_dropped = f(placed[0], placed[1])
    assert dropped.sum() > 0
    np.testing.assert_array_equal(np.asarray(got_dropped), dropped)
    np.testing.assert_array_equal(np.asarray(got_counts), counts)


def test_skewed_routing_and_empty_experts(mesh8):
    """Every pair to expert 5 (k=0) or 6 (k=1): one rank receives everything,
    the others nothing; overflow is dropped in (rank, token) order."""
    cap = 20
    rng = np.random.default_rng(5)
    x = rng.standard_normal((N, T, H)).astype(np.float32)
    idx = np.broadcast_to(np.array([5, 6], np.int32), (N, T, K)).copy()
    w = rng.random((N, T, K)).astype(np.float32)
    scale = np.ones((E, cap, H), np.float32)
    spec = P("x")
    args = place(mesh8, x.reshape(N * T, H), idx.reshape(N * T, K), w.reshape(N * T, K), scale)
    f = smap(lambda *a: dispatch_combine_body(*a, cap), mesh8, (spec,) * 4, spec)
    recv, counts, dropped, y = jax.tree.map(np.asarray, f(*args))
    recv = recv.reshape(E, cap, H)
    want_counts = np.zeros(E, np.int64)
    want_counts[[5, 6]] = cap
    np.testing.assert_array_equal(counts, want_counts)
    # 20 rows each: rank 0's 16 tokens, then rank 1's first 4.
    np.testing.assert_array_equal(dropped, [0, 2 * (T - 4)] + [2 * T] * (N - 2))
    order = x.reshape(N * T, H)[:cap]
    np.testing.assert_array_equal(recv[5], order)
    np.testing.assert_array_equal(recv[6], order)
    assert not np.any(np.delete(recv, [5, 6], axis=0))
    y = y.reshape(N * T, H)
    wf = w.reshape(N * T, K)
    np.testing.assert_allclose(y[:cap], (wf[:cap, :1] + wf[:cap, 1:]) * order, rtol=1e-6)
    assert not np.any(y[cap:])


def test_bad_expert_ids_raise(mesh8):
    rng, idx = routing(6)
    x = rng.standard_normal((N * T, H)).astype(np.float32)
    spec = P("x")

    def run(bad_value):
        bad = idx.reshape(N * T, K).copy()
        bad[3 * T + 5, 1] = bad_value  # rank 3, token 5, k=1
        f = smap(lambda x, i: strata.moe.dispatch(x, i, axis_name="x", num_experts=E, capacity=4)[0],
                 mesh8, (spec, spec), spec)
        return np.asarray(f(*place(mesh8, x, bad)))

    for bad_value in (E, -1):
        with pytest.raises(Exception, match=rf"rank 3 of 8.*token 5, k=1 .*expert id {bad_value}, outside \[0, {E}\)"):
            run(bad_value)
    run(E - 1)  # the group is healthy after the failures
    with pytest.raises(ValueError, match="not divisible"):
        smap(lambda x, i: strata.moe.dispatch(x, i, axis_name="x", num_experts=12, capacity=4)[0],
             mesh8, (spec, spec), spec)(*place(mesh8, x, idx.reshape(N * T, K)))


def test_dispatch_combine_in_scan_with_grad(mesh8):
    cap, steps = 4, 3
    rng = np.random.default_rng(7)
    x = rng.standard_normal((N * T, H))
    idx = rng.integers(0, E, (steps, N * T, K)).astype(np.int32)
    w = rng.random((steps, N * T, K))
    spec, seq = P("x"), P(None, "x")
    placed = place(mesh8, x) + place(mesh8, idx, w, spec=seq)

    def layers(dispatch, combine):
        def per_rank(x, idx, w):
            def step(carry, xs):
                i, wk = xs
                recv, hd = dispatch(carry, i)
                dropped = hd["dropped"] if isinstance(hd, dict) else hd.dropped
                return combine(jnp.tanh(recv), hd, wk) + carry, dropped

            y, dropped = lax.scan(step, x, (idx, w))
            return y, dropped[None]

        f = jax.shard_map(per_rank, mesh=mesh8, in_specs=(spec, seq, seq), out_specs=(spec, spec))

        def loss(x, idx, w):
            y, dropped = f(x, idx, w)
            return jnp.sum(y ** 2), (y, dropped)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True))

    strata_fns = (lambda x, i: strata.moe.dispatch(x, i, axis_name="x", num_experts=E, capacity=cap),
                  strata.moe.combine)
    ref_fns = (lambda x, i: moe.reference_dispatch(x, i, axis_name="x", num_experts=E, capacity=cap),
               lambda y, st, w: moe.reference_combine(y, st, w, axis_name="x"))
    (_, (y, dropped)), grads = layers(*strata_fns)(*placed)
    (_, (y_ref, dropped_ref)), ref_grads = layers(*ref_fns)(*placed)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(dropped), np.asarray(dropped_ref))
    assert np.asarray(dropped).sum() > 0
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12)


def test_groups_of_a_2d_mesh_and_stats(mesh2x4):
    """Expert parallelism over one axis of a 2-D mesh: two independent groups
    of 4; the bytes are counted on the DMA engines and cores."""
    n_ep, cap, e = 4, 8, 8
    rng = np.random.default_rng(8)
    x = rng.standard_normal((8 * T, H)).astype(np.float32)
    idx = rng.integers(0, e, (8 * T, K)).astype(np.int32)
    w = rng.random((8 * T, K)).astype(np.float32)
    spec = P(("node", "npu"))

    def body(x, idx, w):
        recv, hd = strata.moe.dispatch(x, idx, axis_name="npu", num_experts=e, capacity=cap)
        return recv, hd.dropped[None], strata.moe.combine(recv, hd, w)

    strata.reset_stats()
    recv, dropped, y = jax.tree.map(np.asarray, smap(body, mesh2x4, (spec,) * 3, spec)(*place(mesh2x4, x, idx, w)))
    stats = strata.stats()
    accepted_rows = crossing_rows = lone_rows = 0
    for node in range(2):
        rows = slice(node * n_ep * T, (node + 1) * n_ep * T)
        slot, _, want_dropped = np_layout(idx[rows].reshape(n_ep, T, K), e, cap)
        want_recv = np_dispatch(x[rows].reshape(n_ep, T, H), slot, e, cap)
        np.testing.assert_array_equal(recv.reshape(2, e, cap, H)[node], want_recv)
        np.testing.assert_array_equal(dropped[node * n_ep:(node + 1) * n_ep], want_dropped)
        want_y = np_combine(want_recv, slot, w[rows].reshape(n_ep, T, K))
        np.testing.assert_allclose(y[rows].reshape(n_ep, T, H), want_y, rtol=1e-5, atol=1e-6)
        accepted_rows += int((slot >= 0).sum())
        owners = np.where(slot >= 0, slot // (e // n_ep * cap), -1).reshape(-1, K)
        crossing_rows += sum(len(set(o[o >= 0].tolist())) for o in owners)
        lone_rows += sum(int((np.unique(o[o >= 0], return_counts=True)[1] == 1).sum()) for o in owners)
    row_bytes = H * 4
    # A row per (token, destination rank) crosses each way, user buffer to
    # user buffer; dispatch fans it out there (the other accepted rows are
    # local copies), combine sums a token's rows there first (local: every
    # row but a rank's lone one, which crosses as it is).
    assert 0 < crossing_rows < accepted_rows and 0 < lone_rows < crossing_rows
    assert stats["bytes_direct"] == 2 * crossing_rows * row_bytes
    assert stats["bytes_local"] == ((accepted_rows - crossing_rows) + (accepted_rows - lone_rows)) * row_bytes
    assert stats["bytes_staged"] == 0
    # Dispatch is small here, so it runs on cores too (the collectives' rule,
    # collective.h PlanMovesOnSdma): every row read + written by a core, then
    # combine's reads.
    assert sum(map(sum, stats["sdma_bytes"])) == 0
    assert sum(map(sum, stats["core_bytes"])) >= 3 * accepted_rows * row_bytes


def test_buffer_centric_mode(mesh8):
    """The staged baseline gives the same bits, stages every row it moves and
    moves nothing directly; an undersized comm buffer is a clear error."""
    cap = 5
    rng, idx = routing(9)
    x = rng.standard_normal((N * T, H)).astype(np.float32)
    w = rng.random((N * T, K)).astype(np.float32)
    scale = rng.standard_normal((E, cap, H)).astype(np.float32)
    spec = P("x")
    args = place(mesh8, x, idx.reshape(N * T, K), w, scale)

    def run():
        def per_rank(x, idx, w, scale):
            out = dispatch_combine_body(x, idx, w, scale, cap)
            return out, jnp.sum(out[3] ** 2)[None]

        f = jax.shard_map(per_rank, mesh=mesh8, in_specs=(spec,) * 4, out_specs=spec)
        g = jax.jit(jax.value_and_grad(lambda x, i, w, s: f(x, i, w, s)[1].sum(), argnums=(0, 2, 3)))
        return jax.tree.map(np.asarray, (jax.jit(f)(*args), g(*args)))

    want = run()
    strata.reset_stats()
    with strata.config(mode="buffer_centric"):
        got = run()
    stats = strata.stats()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert stats["bytes_direct"] == 0 and stats["bytes_staged"] > 0 and stats["bytes_exchanged"] > 0
    with strata.config(mode="buffer_centric", comm_buffer_bytes=256):  # x alone is 512 B per rank
        with pytest.raises(Exception, match=r"comm_buffer_bytes=256.*raise strata.config"):
            run()
