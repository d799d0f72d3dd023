"""Long-run memory soak: RSS every --every calls of one jitted program, for
collectives on fresh XLA buffers (jax.device_put each call), on arena buffers
(strata.memory.device_put each call) and for MoE dispatch + combine.

    python tests/soak.py --calls 10000 --every 1000 [--case fresh|arena|moe|all]

Prints one line per report and, per case, the growth from the first report
(taken after warm-up, so compilation and first-touch caches are excluded) to
the last (heap trimmed before each reading: see _trim). --max-growth-mb makes
it exit 1 when a case grows more than that.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import sys

import numpy as np

import stratacl_jax as strata

strata.emulator.ensure_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def _trim() -> None:
    """Returns glibc's free heap pages to the OS before a reading, so that the
    series shows memory still in use, not what the allocator keeps cached
    (which moves by a few MB either way from one reading to the next)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_mb() -> float:
    _trim()
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * 4096 / 2**20


def collective_case(mesh, put):
    sharding = NamedSharding(mesh, P("x"))
    host = np.random.default_rng(0).standard_normal(8 * 4096).astype(np.float32)
    f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "x"), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    want = host.reshape(8, -1).sum(0)

    def step(i):
        out = f(put(host, sharding))
        if i % 997 == 0:  # now and then, check the result is still right
            np.testing.assert_allclose(np.asarray(out)[:4096], want, rtol=1e-4, atol=1e-4)
        return out
    return step


def moe_case(mesh):
    sharding = NamedSharding(mesh, P("x"))
    rng = np.random.default_rng(1)
    t, h, k, e = 64, 32, 2, 16
    x = rng.standard_normal((8 * t, h)).astype(np.float32)
    idx = rng.integers(0, e, (8 * t, k)).astype(np.int32)
    w = rng.random((8 * t, k)).astype(np.float32)

    def layer(xs, ids, ws):
        recv, handle = strata.moe.dispatch(xs, ids, axis_name="x", num_experts=e, capacity=2 * t)
        return strata.moe.combine(recv * 2, handle, ws)

    f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
    g = jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 2)))
    args = [jax.device_put(a, sharding) for a in (x, idx, w)]

    def step(i):
        return g(*args) if i % 2 else f(*args)
    return step


def run(name, step, calls, every):
    series = []
    out = None
    for i in range(calls + 1):
        out = step(i)
        if i % every == 0:
            jax.block_until_ready(out)
            gc.collect()
            series.append(rss_mb())
            print(f"{name:6s} calls={i:6d} rss={series[-1]:8.1f} MB", flush=True)
    jax.block_until_ready(out)
    return series


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--case", default="all", choices=["fresh", "arena", "moe", "all"])
    ap.add_argument("--max-growth-mb", type=float, default=None)
    args = ap.parse_args(argv)
    mesh = strata.emulator.make_mesh((8,), ("x",))
    cases = {"fresh": lambda: collective_case(mesh, jax.device_put),
             "arena": lambda: collective_case(mesh, strata.memory.device_put),
             "moe": lambda: moe_case(mesh)}
    names = list(cases) if args.case == "all" else [args.case]
    failed = False
    for name in names:
        step = cases[name]()
        for i in range(args.warmup):
            step(i)
        series = run(name, step, args.calls, args.every)
        growth = series[-1] - series[0]
        print(f"{name:6s} growth over {args.calls} calls: {growth:+.1f} MB", flush=True)
        if args.max_growth_mb is not None and growth > args.max_growth_mb:
            failed = True
    print(f"registry: {dict((k, v) for k, v in strata.stats().items() if 'regist' in k)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
