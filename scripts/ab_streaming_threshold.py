"""A/B of strata's output stores: the default rule (non-temporal stores once the
group's outputs reach half the last-level cache) against streaming always.

Interleaved in one process, 8 emulated NPUs, blocked calls (15 per figure, the
median), 7 rounds alternating which side goes first. Besides each op alone it
times what users do with an output: an XLA consumer reading it (`+use`) and four
chained collectives (`x4`), where cached outputs are what plain stores buy.
Both sides must give the same bytes; the script checks that first.

    python scripts/ab_streaming_threshold.py 128K 256K 512K 1024K 2048K   # sizes per rank
"""
import sys
import time

import numpy as np

import stratacl_jax as strata  # first: it sizes XLA's thread pool
from benchmarks.common import parse_size
from stratacl_jax import _core

strata.emulator.ensure_devices(8)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

ROUNDS, CALLS = 7, 15
THRESHOLDS = {"default": -1, "always": 0}  # -1: back to the default rule

mesh = strata.emulator.make_mesh((8,), ("x",))
perm = [(i, (i + 3) % 8) for i in range(8)]


def program(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def use(y):
    return jnp.sum(y * 1.5, keepdims=True)


def chain4(op):
    def run(v):
        for _ in range(4):
            v = op(v)
        return v
    return run


ar = lambda v: strata.all_reduce(v, "x")  # noqa: E731
pp = lambda v: strata.ppermute(v, "x", perm)  # noqa: E731
a2a = lambda v: strata.all_to_all(v.reshape(8, -1), "x", 0, 0, tiled=True).reshape(-1)  # noqa: E731
ag = lambda v: strata.all_gather(v, "x", tiled=True)  # noqa: E731
bc = lambda v: strata.broadcast(v, "x", root=0)  # noqa: E731
rs = lambda v: strata.reduce_scatter(v, "x", tiled=True)  # noqa: E731
OPS = {"ar": ar, "ar+use": lambda v: use(ar(v)), "ar x4": chain4(ar),
       "pp": pp, "pp+use": lambda v: use(pp(v)), "pp x4": chain4(pp),
       "a2a": a2a, "a2a x4": chain4(a2a), "bc": bc, "bc+use": lambda v: use(bc(v)),
       "ag": ag, "ag+use": lambda v: use(ag(v)), "rs": rs}


def median_us(f, x):
    times = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main(sizes):
    for n in (parse_size(text) // 4 for text in sizes):  # float32 elements per rank
        x = jax.device_put(np.random.default_rng(0).standard_normal(8 * n).astype(np.float32),
                           NamedSharding(mesh, P("x")))
        fs = {name: program(fn) for name, fn in OPS.items()}
        for name, f in fs.items():
            outs = []
            for value in THRESHOLDS.values():
                _core.set_streaming_threshold_bytes(value)
                outs.append(np.asarray(f(x)))
            assert all(np.array_equal(outs[0], o) for o in outs[1:]), f"{name}: stores changed the result"
        res = {}
        for r in range(ROUNDS):
            order = list(THRESHOLDS.items()) if r % 2 == 0 else list(THRESHOLDS.items())[::-1]
            for name, f in fs.items():
                for side, value in order:
                    _core.set_streaming_threshold_bytes(value)
                    res.setdefault((name, side), []).append(median_us(f, x))
        _core.set_streaming_threshold_bytes(-1)
        print(f"--- {n * 4 / 1024:.0f} KiB per rank", flush=True)
        for name in OPS:
            d, a = np.array(res[(name, "default")]), np.array(res[(name, "always")])
            print(f"{name:8s} default {np.median(d):7.0f}  always {np.median(a):7.0f}  "
                  f"default/always {np.median(d) / np.median(a):5.2f}  "
                  f"always faster in {int(np.sum(a < d))}/{ROUNDS} rounds", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["1024K"])
