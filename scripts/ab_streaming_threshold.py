"""A/B of strata's output stores: the default rule (non-temporal stores once the
group's outputs reach half the last-level cache) against streaming always.

Interleaved in one process, 8 emulated NPUs, blocked calls (15 per figure, the
median), 7 rounds alternating which side goes first. Besides each op alone it
times what users do with an output: an XLA consumer reading it (`+use`) and four
chained collectives (`x4`), where cached outputs are what plain stores buy.

    python scripts/ab_streaming_threshold.py 128K 256K 512K 1024K 2048K   # sizes per rank
"""
import time, sys, numpy as np
import stratacl_jax as strata
from stratacl_jax import _core
strata.emulator.ensure_devices(8)
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = strata.emulator.make_mesh((8,), ("x",))
sh = NamedSharding(mesh, P("x"))
perm = [(i, (i + 3) % 8) for i in range(8)]
def sm(fn): return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
use = lambda y: jnp.sum(y * 1.5, keepdims=True)
def chain4(op):
    def f(v):
        for _ in range(4): v = op(v)
        return v
    return f
ar = lambda v: strata.all_reduce(v, "x")
pp = lambda v: strata.ppermute(v, "x", perm)
a2a = lambda v: strata.all_to_all(v.reshape(8, -1), "x", 0, 0, tiled=True).reshape(-1)
ag = lambda v: strata.all_gather(v, "x", tiled=True)
bc = lambda v: strata.broadcast(v, "x", root=0)
rs = lambda v: strata.reduce_scatter(v, "x", tiled=True)
ops = {"ar": ar, "ar+use": lambda v: use(ar(v)), "ar x4": chain4(ar),
       "pp": pp, "pp+use": lambda v: use(pp(v)), "pp x4": chain4(pp),
       "a2a": a2a, "a2a x4": chain4(a2a), "bc": bc, "bc+use": lambda v: use(bc(v)),
       "ag": ag, "ag+use": lambda v: use(ag(v)), "rs": rs}
thr = {"default": -1, "always": 0}
rounds = 7
sizes = [int(float(s[:-1]) * 1024 / 4) if s.endswith("K") else int(s) for s in sys.argv[1:]]
for n in sizes:
    x = jax.device_put(np.random.default_rng(0).standard_normal(8 * n).astype(np.float32), sh)
    fs = {k: sm(f) for k, f in ops.items()}
    for f in fs.values(): f(x).block_until_ready()
    def t(f, k=15):
        ts = []
        for _ in range(k):
            t0 = time.perf_counter(); f(x).block_until_ready(); ts.append(time.perf_counter() - t0)
        return np.median(ts) * 1e6
    res = {}
    for r in range(rounds):
        for name, f in fs.items():
            order = list(thr.items()) if r % 2 == 0 else list(thr.items())[::-1]
            for tn, tv in order:
                _core.set_streaming_threshold_bytes(tv)
                res.setdefault((name, tn), []).append(t(f))
    _core.set_streaming_threshold_bytes(-1)
    print(f"--- {n*4/1024:.0f} KiB per rank", flush=True)
    for name in ops:
        d, a = np.array(res[(name, "default")]), np.array(res[(name, "always")])
        wins = int(np.sum(a < d))
        print(f"{name:8s} default {np.median(d):7.0f}  always {np.median(a):7.0f}  default/always {np.median(d)/np.median(a):5.2f}  always faster in {wins}/{rounds} rounds", flush=True)
