"""DeepEP's traffic rule in strata.moe: a token crosses to a destination rank
once, however many of its experts live there, and combine sends one partial
row back per (token, rank). The stats count those crossings exactly (both
modes), and the results keep the contract: dispatch bit-exact, combine in its
documented order (bitwise against numpy summing in that order)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from stratacl_jax import moe
from random_data import random_array

N, T, H, K, E = 8, 16, 8, 4, 16
EL = E // N
CAP = 18  # N*T*K/E = 32 pairs per expert on average: drops


def clustered_routing(rng):
    """[N, T, K] expert ids: each token has a home rank and picks most of its
    experts there (repeats allowed), so pairs often share a destination rank."""
    home = rng.integers(0, N, (N, T, 1))
    local = home * EL + rng.integers(0, EL, (N, T, K))
    anywhere = rng.integers(0, E, (N, T, K))
    return np.where(rng.random((N, T, K)) < 0.7, local, anywhere).astype(np.int32)


def np_pair_slots(idx_all):
    """The layout contract: slot of every pair (e*CAP + row) or -1, in (rank, token, k) order."""
    fill = np.zeros(E, np.int64)
    slot = np.full(idx_all.shape, -1, np.int64)
    for (r, t, k), e in np.ndenumerate(idx_all):
        if fill[e] < CAP:
            slot[r, t, k] = e * CAP + fill[e]
        fill[e] += 1
    return slot


def crossings(slot):
    """Distinct (token, destination rank) pairs among accepted pairs."""
    owners = np.where(slot >= 0, slot // (EL * CAP), -1).reshape(-1, K)
    return sum(len(set(o[o >= 0].tolist())) for o in owners)


def lone_pairs(slot):
    """(token, destination rank) pairs holding one accepted pair of the token."""
    owners = np.where(slot >= 0, slot // (EL * CAP), -1).reshape(-1, K)
    return sum(int((np.unique(o[o >= 0], return_counts=True)[1] == 1).sum()) for o in owners)


def np_combine_in_order(ey_rows, flat_slot, w, dtype):
    """combine's documented order in numpy (which rounds every product and sum):
    per token, from zero, ranks ascending, float32: w * row for a rank holding
    one pair, else that rank's pairs summed in k order and rounded to the
    rows' dtype; the total rounded to the rows' dtype."""
    y = np.zeros((flat_slot.shape[0], H), dtype)
    for t, token_slots in enumerate(flat_slot):
        groups = {}
        for k, s in enumerate(token_slots):
            if s >= 0:
                groups.setdefault(s // (EL * CAP), []).append(k)
        acc = np.zeros(H, np.float32)
        for owner in sorted(groups):
            part = np.zeros(H, np.float32)
            for k in groups[owner]:
                part = part + w[t, k] * ey_rows[token_slots[k]].astype(np.float32)
            acc = acc + (part if len(groups[owner]) == 1 else part.astype(dtype).astype(np.float32))
        y[t] = acc.astype(dtype)
    return y


def place(mesh, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in arrays]


def smap(fn, mesh, n_in, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * n_in, out_specs=out_specs))


def expand(handle):
    return jax.tree.map(lambda a: a[None], handle)


def squeeze(handle):
    return jax.tree.map(lambda a: a[0], handle)


def measured(f, *args):
    strata.reset_stats()
    out = jax.tree.map(np.asarray, f(*args))
    s = strata.stats()
    return out, {k: s[k] for k in ("bytes_exchanged", "bytes_direct", "bytes_staged", "bytes_local")}


@pytest.mark.parametrize("mode", ["strata", "buffer_centric"])
@pytest.mark.parametrize("dtype", ["float32", jnp.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_token_crosses_once_per_rank(mesh8, mode, dtype, seed):
    rng = np.random.default_rng(seed)
    idx = clustered_routing(rng)
    slot = np_pair_slots(idx)
    accepted = int((slot >= 0).sum())
    pairs = crossings(slot)
    assert accepted - pairs >= N * T // 2 and (slot < 0).sum() > 0  # the rule matters here, and drops happen
    rb = H * np.dtype(dtype).itemsize
    wsize = 4
    x = random_array(rng, (N * T, H), dtype)
    ey = random_array(rng, (E, CAP, H), dtype)
    w = random_array(rng, (N * T, K), np.float32)
    ct = random_array(rng, (N * T, H), dtype)
    x_d, idx_d, ey_d, w_d, ct_d = place(mesh8, x, idx.reshape(N * T, K), ey, w, ct)

    disp = smap(lambda x, i: (lambda r, hd: (r, expand(hd)))(
        *strata.moe.dispatch(x, i, axis_name="x", num_experts=E, capacity=CAP)), mesh8, 2, P("x"))
    comb = smap(lambda y, hd, w: strata.moe.combine(y, squeeze(hd), w), mesh8, 3, P("x"))
    # The combine's VJP on its own (a forward would add its own crossings).
    bwd = smap(lambda y, hd, w, ct: moe._combine_bwd(("x",), (y, w, squeeze(hd).pair_slot,
                                                              squeeze(hd).slot_source), ct)[:2],
               mesh8, 4, P("x"))
    ref = smap(lambda x, i, y, w: (lambda r, st: (r, moe.reference_combine(y, st, w, axis_name="x")))(
        *moe.reference_dispatch(x, i, axis_name="x", num_experts=E, capacity=CAP)), mesh8, 4, P("x"))

    with strata.config(mode=mode):
        (recv, handle), d_stats = measured(disp, x_d, idx_d)
        handle_d = jax.device_put(handle, NamedSharding(mesh8, P("x")))
        y, c_stats = measured(comb, ey_d, handle_d, w_d)
        (d_ey, d_w), b_stats = measured(bwd, ey_d, handle_d, w_d, ct_d)
    want_recv, want_y = jax.tree.map(np.asarray, ref(x_d, idx_d, ey_d, w_d))

    # The contract is unchanged: dispatch bit-exact, combine bitwise in its
    # documented order; the library's reference sums in that order too (XLA
    # may fuse a multiply-add there, hence the tolerance).
    np.testing.assert_array_equal(np.asarray(handle.pair_slot).reshape(N, T, K), slot)
    np.testing.assert_array_equal(recv, want_recv)
    flat = slot.reshape(N * T, K)
    np.testing.assert_array_equal(y, np_combine_in_order(ey.reshape(E * CAP, H), flat, w, dtype))
    np.testing.assert_allclose(y.astype(np.float64), want_y.astype(np.float64),
                               rtol=1e-5 if dtype == "float32" else 1e-2, atol=1e-5)
    owner_rows = ey.reshape(E * CAP, H).astype(np.float64)
    want_dw = np.where(flat >= 0, np.einsum("th,tkh->tk", ct.astype(np.float64),
                                            owner_rows[np.maximum(flat, 0)]), 0)
    np.testing.assert_allclose(d_w, want_dw, rtol=1e-5 if dtype == "float32" else 2e-2, atol=1e-4)
    want_dey = np.zeros((E * CAP, H))
    for (t, k), s in np.ndenumerate(flat):
        if s >= 0:
            want_dey[s] = w[t, k] * ct[t].astype(np.float64)
    np.testing.assert_allclose(d_ey.reshape(E * CAP, H).astype(np.float64), want_dey,
                               rtol=1e-6 if dtype == "float32" else 1e-2)

    staged = mode == "buffer_centric"
    # dispatch: a row per (token, rank) crosses; the other accepted rows are local copies.
    assert d_stats["bytes_exchanged"] == pairs * rb
    assert d_stats["bytes_direct"] == (0 if staged else pairs * rb)
    assert d_stats["bytes_local"] == (accepted - pairs) * rb
    # buffer_centric stages in the x rows the plan reads (tokens with a kept
    # pair) and out the rows that crossed; the owning rank copies the rest of
    # a token's rows from its staged one and zeroes empty rows itself.
    read = int((slot >= 0).any(axis=-1).sum())
    assert d_stats["bytes_staged"] == ((read + pairs) * rb if staged else 0)
    # combine: one partial row back per (token, rank), summed where it lives
    # (local); in strata mode a rank's lone row of a token crosses as it is,
    # in buffer_centric its owner stages it (a local copy).
    lone = lone_pairs(slot)
    assert 0 < lone < pairs
    assert c_stats["bytes_exchanged"] == pairs * rb
    assert c_stats["bytes_direct"] == (0 if staged else pairs * rb)
    assert c_stats["bytes_local"] == (accepted if staged else accepted - lone) * rb
    assert c_stats["bytes_staged"] == ((pairs + N * T) * rb if staged else 0)
    # backward: ct_y crosses once per (token, rank), one d_weights scalar back
    # per pair; every accepted row's gradient is scaled from the crossed row
    # where it landed (local).
    assert b_stats["bytes_exchanged"] == pairs * rb + accepted * wsize
    assert b_stats["bytes_direct"] == (0 if staged else pairs * rb + accepted * wsize)
    assert b_stats["bytes_local"] == accepted * rb
