"""How ranks resume after an op: a few runtime threads run every rank's program
on from one collective to the next (xla_ffi/runtime/executor.cc, Resumers).
A rank's program may block on the way, in XLA's own collectives or in long
compute, while other ranks still wait in the queue; these programs must finish
with exact results, never hang."""
import jax
import jax.numpy as jnp
import numpy as np
from conftest import random_array
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata


def smap(fn, mesh, in_specs=P("x"), out_specs=P("x"), check_vma=True):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


def _mixed(v):
    """strata and lax collectives alternating; per rank r of 8 with v (24,):
    c + total, where total = sum of every rank's v, b = 4 * total and
    c = concat over ranks q of (b[:3] + q)."""
    r = lax.axis_index("x")
    a = strata.all_reduce(v, "x")
    b = lax.psum(a * 0.5, "x")
    c = strata.all_gather(b[:3] + r.astype(b.dtype), "x", tiled=True)
    d = lax.all_gather(lax.dynamic_slice(c, (3 * r,), (3,)), "x", tiled=True)
    return d + strata.reduce_scatter(jnp.tile(v, 8), "x", tiled=True)


def _mixed_want(x):
    total = x.reshape(8, 24).astype(np.float64).sum(0)
    b = 4 * total
    c = np.concatenate([b[:3] + q for q in range(8)])
    return np.tile(c + total, 8)


def test_strata_and_lax_collectives_alternate_in_one_program(mesh8):
    """Each rank resumed after strata's op runs into lax.psum, which blocks its
    thread until all 8 ranks are there, some of them still queued behind it."""
    x = random_array(np.random.default_rng(1), (8 * 24,), np.float32)
    got = np.asarray(smap(_mixed, mesh8)(jax.device_put(x, NamedSharding(mesh8, P("x")))))
    np.testing.assert_allclose(got, _mixed_want(x), rtol=1e-5, atol=1e-4)


def test_mixed_programs_back_to_back_never_hang(mesh8):
    """60 executions queued without blocking, then 20 chained: XLA's launches,
    lax's blocking rendezvous and strata's resumptions all overlap."""
    x = random_array(np.random.default_rng(2), (8 * 24,), np.float32)
    xs = jax.device_put(x, NamedSharding(mesh8, P("x")))
    f = smap(_mixed, mesh8)
    outs = [f(xs) for _ in range(60)]
    y = xs
    for _ in range(20):
        y = f(y) * 1e-3
    jax.block_until_ready((outs, y))
    want = _mixed_want(x)
    for out in outs[::15] + outs[-1:]:
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-4)
    assert np.isfinite(np.asarray(y)).all()


def test_loop_alternating_strata_and_lax_matches_lax(mesh8):
    """A scan whose every trip runs strata.all_reduce then lax.psum: the same
    values as the all-lax program, bit for bit (both sum in rank order)."""
    x = random_array(np.random.default_rng(3), (8 * 16,), np.float32)
    xs = jax.device_put(x, NamedSharding(mesh8, P("x")))

    def loop(first):
        def body(v):
            def trip(u, _):
                u = first(u, "x") * 0.125
                return lax.psum(jnp.sin(u), "x") * 0.125, None
            return lax.scan(trip, v, None, length=12)[0]
        return smap(body, mesh8, check_vma=False)  # the carry goes varying -> invariant

    got = np.asarray(loop(strata.all_reduce)(xs))
    want = np.asarray(loop(lax.psum)(xs))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_one_rank_computing_long_between_ops_is_waited_for(mesh8):
    """Rank 3 runs ~tens of ms of matmuls between two strata ops, on whichever
    thread resumed it: the others queue behind, the result is exact."""
    x = random_array(np.random.default_rng(4), (8 * 64,), np.float32)
    m = jnp.asarray(random_array(np.random.default_rng(5), (64, 64), np.float32) / 64)

    def body(v):
        a = strata.all_reduce(v, "x")
        slow = lambda u: lax.fori_loop(0, 300, lambda i, w: jnp.tanh(m @ w), jnp.outer(u, u))[0] * 0 + u  # noqa: E731
        a = lax.cond(lax.axis_index("x") == 3, slow, lambda u: u, a)
        return strata.all_gather(a[:8], "x", tiled=True)

    got = np.asarray(smap(body, mesh8)(jax.device_put(x, NamedSharding(mesh8, P("x")))))
    total = x.reshape(8, 64).astype(np.float64).sum(0)
    np.testing.assert_allclose(got, np.tile(np.tile(total[:8], 8), 8), rtol=1e-5, atol=1e-4)


def test_xla_collective_ordered_after_an_independent_strata_op(mesh8):
    """The data-parallel step as users write it: strata averages the loss, XLA's
    psum (here written out) reduces an independent gradient-sized matrix. When
    XLA's buffer assignment gives the psum's output the strata op's operand
    slot, XLA makes the psum wait for strata's op, and every rank but the last
    one in reaches lax.psum on a resumer thread (issue 27)."""
    rng = np.random.default_rng(7)
    x = random_array(rng, (8 * 32, 64), np.float32)
    w = random_array(rng, (64, 64), np.float32)

    def step(x, w):
        h = jnp.tanh(x @ w)
        loss = strata.all_reduce(jnp.mean(h * h), "x", op="mean")
        return loss, lax.psum(x.T @ h, "x")

    f = smap(step, mesh8, in_specs=(P("x"), P()), out_specs=(P(), P()), check_vma=False)
    xs = jax.device_put(x, NamedSharding(mesh8, P("x")))
    before = strata.stats()["waits_handed_off"]
    for _ in range(3):
        loss, g = jax.block_until_ready(f(xs, w))
    assert strata.stats()["waits_handed_off"] > before
    hs = [np.tanh(x[32 * r:32 * (r + 1)].astype(np.float64) @ w) for r in range(8)]
    np.testing.assert_allclose(float(loss), np.mean([np.mean(h * h) for h in hs]), rtol=1e-5)
    want = sum(x[32 * r:32 * (r + 1)].astype(np.float64).T @ hs[r] for r in range(8))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=1e-4)


def test_runtime_threads_are_named(mesh8):
    """top, perf and profilers tell strata's threads from XLA's by name."""
    import os
    x = random_array(np.random.default_rng(8), (8 * 24,), np.float32)
    jax.block_until_ready(smap(_mixed, mesh8)(jax.device_put(x, NamedSharding(mesh8, P("x")))))
    names = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        except OSError:  # the thread exited meanwhile
            pass
    assert {"strata-resume", "strata-worker", "strata-monitor"} <= names, names
