"""Unmodified programs on strata (issue 27): the same programs three ways,
timed interleaved in one run on 8 emulated NPUs.

- lax: written with jax.lax collectives, XLA runs every collective;
- strata as written: the user's lax collectives swapped for strata's; what
  autodiff inserts (psum_invariant, the transpose of shard_map's implicit
  pvary, under check_vma=True) stays on XLA: a mixed program;
- lax routed: the lax program traced under
  strata.config(lax_collectives="strata"): every collective on strata.

Plus the mixed-program probe of FACTS §7: 4 chained all-reduces (all lax,
all strata, alternating). Each row: median of `--repeats` interleaved calls,
the XLA collectives left in the compiled program, and the resumer
threads the runtime's monitor found blocked (stats()["resumers_blocked"])
per call.

    python -m benchmarks.lax_routing [--repeats 40]
"""
from __future__ import annotations

import argparse
import re
import time

import numpy as np

import stratacl_jax as strata

strata.emulator.ensure_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

XLA_COLLECTIVES = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?!-done)")


class Lax:
    psum = staticmethod(lax.psum)
    pmean = staticmethod(lax.pmean)
    all_gather = staticmethod(lambda x, a, **k: lax.all_gather(x, a, **k))
    ppermute = staticmethod(lax.ppermute)


class Strata:
    psum = staticmethod(lambda x, a: strata.all_reduce(x, a))
    pmean = staticmethod(lambda x, a: strata.all_reduce(x, a, op="mean"))
    all_gather = staticmethod(lambda x, a, **k: strata.all_gather(x, a, **k))
    ppermute = staticmethod(lambda x, a, perm: strata.ppermute(x, a, perm))


def rand(*shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def dp_step(mesh, c):
    """Data parallel MLP training step, replicated parameters, check_vma=True."""
    d = 256
    params = {"w1": rand(d, d, seed=1, scale=0.05), "w2": rand(d, d, seed=2, scale=0.05)}
    x = jax.device_put(rand(8 * 32, d, seed=3), NamedSharding(mesh, P("x")))

    def loss(p, x):
        return c.pmean(jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2), "x")

    f = jax.shard_map(loss, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())

    def step(p, x):
        v, g = jax.value_and_grad(f)(p, x)
        return v, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    return step, (params, x)


def fsdp_step(mesh, c):
    """FSDP: per-layer parameter shards all-gathered in a scan over 4 layers."""
    d = 256
    ws = jax.device_put(rand(4, d, d, seed=4, scale=0.05), NamedSharding(mesh, P(None, "x")))
    x = jax.device_put(rand(8 * 32, d, seed=5), NamedSharding(mesh, P("x")))

    def loss(ws, x):
        def layer(h, w):
            return jnp.tanh(h @ c.all_gather(w, "x", tiled=True, axis=1)), None

        h, _ = lax.scan(layer, x, ws)
        return c.psum(jnp.sum(h ** 2), "x")

    f = jax.shard_map(loss, mesh=mesh, in_specs=(P(None, None, "x"), P("x")), out_specs=P())
    ws = jax.device_put(np.asarray(ws), NamedSharding(mesh, P(None, None, "x")))
    return jax.value_and_grad(f), (ws, x)


def tp_remat_scan(mesh, c):
    """Megatron MLP per layer (column/row parallel, psum) under jax.checkpoint
    in a scan over 4 layers, 2 (data) x 4 (tensor) mesh."""
    mesh = strata.emulator.make_mesh((2, 4), ("dp", "tp"))
    d, h = 128, 512
    w1 = jax.device_put(rand(4, d, h, seed=6, scale=0.05), NamedSharding(mesh, P(None, None, "tp")))
    w2 = jax.device_put(rand(4, h, d, seed=7, scale=0.05), NamedSharding(mesh, P(None, "tp")))
    x = jax.device_put(rand(2 * 32, d, seed=8), NamedSharding(mesh, P("dp")))

    @jax.checkpoint
    def block(x, w):
        a, b = w
        return x + c.psum(jax.nn.gelu(x @ a) @ b, "tp")

    def loss(w1, w2, x):
        y, _ = lax.scan(lambda x, w: (block(x, w), None), x, (w1, w2))
        return c.pmean(jnp.mean(y ** 2), "dp")

    f = jax.shard_map(loss, mesh=mesh, in_specs=(P(None, None, "tp"), P(None, "tp"), P("dp")), out_specs=P())
    return jax.value_and_grad(f, argnums=(0, 1)), (w1, w2, x)


def pipeline(mesh, c):
    """GPipe-style loop: 8 stages, 8 micro-batches shifted by ppermute in a scan."""
    n, micro, mb, d = 8, 8, 16, 128
    ws = jax.device_put(rand(n, d, d, seed=9, scale=0.1), NamedSharding(mesh, P("x")))
    xs = rand(micro, mb, d, seed=10)

    def run(w, xs):
        w, stage = w[0], lax.axis_index("x")
        inputs = jnp.concatenate([xs, jnp.zeros((n - 1,) + xs.shape[1:], xs.dtype)])

        def step(carry, t):
            state, acc = carry
            state = jnp.tanh(jnp.where(stage == 0, inputs[t], state) @ w)
            acc = acc + jnp.where((stage == n - 1) & (t >= n - 1), jnp.sum(state ** 2), 0.0)
            return (c.ppermute(state, "x", [(i, (i + 1) % n) for i in range(n)]), acc), None

        init = lax.pcast((jnp.zeros_like(xs[0]), jnp.float32(0)), "x", to="varying")
        (_, acc), _ = lax.scan(step, init, jnp.arange(micro + n - 1))
        return c.psum(acc, "x")

    f = jax.shard_map(run, mesh=mesh, in_specs=(P("x"), P()), out_specs=P())
    return jax.value_and_grad(f), (ws, xs)


def chained(kind):
    def make(mesh, c):
        x = jax.device_put(rand(8 * 4096, seed=11), NamedSharding(mesh, P("x")))  # 16 KB per rank

        def body(v):
            for i in range(4):
                use_strata = kind == "strata" or (kind == "alternating" and i % 2 == 0)
                v = (strata.all_reduce(v, "x") if use_strata else lax.psum(v, "x")) * 0.125
                v = lax.pcast(v, "x", to="varying")
            return v

        return jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")), (x,)

    return make


PROGRAMS = [("data-parallel step, check_vma=True", dp_step), ("FSDP, 4 layers", fsdp_step),
            ("TP MLP, remat in a scan, 2x4 mesh", tp_remat_scan), ("GPipe loop, 8 stages", pipeline)]


def compile_variant(make, mesh, c, routed):
    fn, args = make(mesh, c)
    if routed:
        with strata.config(lax_collectives="strata"):
            compiled = jax.jit(fn).lower(*args).compile()
    else:
        compiled = jax.jit(fn).lower(*args).compile()
    left = sorted(set(XLA_COLLECTIVES.findall(compiled.as_text())))
    return compiled, args, left


def time_interleaved(variants, repeats):
    times = {name: [] for name in variants}
    handed = {name: 0 for name in variants}
    for compiled, args, _ in variants.values():
        for _ in range(3):
            jax.block_until_ready(compiled(*args))
    for _ in range(repeats):
        for name, (compiled, args, _) in variants.items():
            before = strata.stats()["resumers_blocked"]
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times[name].append(time.perf_counter() - t0)
            handed[name] += strata.stats()["resumers_blocked"] - before
    return {n: (np.median(t) * 1e6, handed[n] / repeats) for n, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args(argv)
    mesh = strata.emulator.make_mesh((8,), ("x",))
    print(f"# {args.repeats} interleaved calls per variant, median; 8 emulated NPUs; "
          f"jax {jax.__version__}")
    print("| program | lax (µs) | strata as written (µs) | lax routed (µs) | written / lax | routed / lax "
          "| XLA collectives left: written | routed | resumers blocked per call: lax, written, routed |")
    print("|---|---:|---:|---:|---:|---:|---|---|---|")
    for title, make in PROGRAMS:
        variants = {"lax": compile_variant(make, mesh, Lax, False),
                    "written": compile_variant(make, mesh, Strata, False),
                    "routed": compile_variant(make, mesh, Lax, True)}
        r = time_interleaved(variants, args.repeats)
        lax_us = r["lax"][0]
        print(f"| {title} | {lax_us:,.0f} | {r['written'][0]:,.0f} | {r['routed'][0]:,.0f} | "
              f"{r['written'][0] / lax_us:.2f} | {r['routed'][0] / lax_us:.2f} | "
              f"{', '.join(variants['written'][2]) or 'none'} | {', '.join(variants['routed'][2]) or 'none'} | "
              f"{r['lax'][1]:.1f}, {r['written'][1]:.1f}, {r['routed'][1]:.1f} |", flush=True)
    variants = {k: compile_variant(chained(k), mesh, None, False) for k in ("lax", "strata", "alternating")}
    r = time_interleaved(variants, args.repeats)
    print()
    print("| 4 chained 16 KB all-reduces | time (µs) | resumers blocked per call |")
    print("|---|---:|---:|")
    for k, (us, h) in r.items():
        print(f"| {k} | {us:,.0f} | {h:.1f} |")


if __name__ == "__main__":
    main()
