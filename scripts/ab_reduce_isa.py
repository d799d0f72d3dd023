"""A/B of the reduction kernels' instruction set (issue 31): the baseline
(x86-64, SSE2) variant against the one dispatched at load time (the widest the
CPU runs), switched in one process with _core.set_reduce_isa, so both sides
run the same compiled programs on the same inputs.

8 emulated NPUs, float32 (--dtype), plain jax.device_put inputs. Each figure is the
median of --calls individually blocked calls; --rounds rounds alternate which
side goes first; the memory floor (benchmarks.common.floor_copy_us, laid out
like the op as in benchmarks/collectives.py) is timed once per round. Both
sides must give the same bytes; the script checks that first. Prints a
markdown table: medians over rounds, the spread (min-max of the rounds'
figures), the ratio, how many rounds the dispatched side won, and the share of
the memory floor each side reaches.

    python scripts/ab_reduce_isa.py                      # 64K 1M 4M per rank, 8 rounds
    python scripts/ab_reduce_isa.py --rounds 4 --calls 30 256K
"""
import argparse
import time

import numpy as np

import stratacl_jax as strata  # first: it sizes XLA's thread pool
from benchmarks import common
from benchmarks.collectives import SPECS
from benchmarks.common import parse_size
from stratacl_jax import _core

N = 8
strata.emulator.ensure_devices(N)
import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

mesh = strata.emulator.make_mesh((N,), ("x",))
OPS = {
    "all_reduce": lambda v: strata.all_reduce(v, "x"),
    "reduce_scatter": lambda v: strata.reduce_scatter(v, "x", tiled=True),
}


def program(fn):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def median_us(f, x, calls):
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sizes", nargs="*", default=["64K", "1M", "4M"], help="bytes per rank")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16, float16, ...")
    ap.add_argument("--other", default="auto", help="the side against the baseline (default: the dispatched one)")
    args = ap.parse_args()

    before = _core.reduce_isa()
    _core.set_reduce_isa(args.other)
    other = _core.reduce_isa()
    sides = {"baseline": "baseline", other: args.other}
    print(f"# variants available: {_core.reduce_isas_available()}, dispatched at load: {before}; "
          f"A/B baseline vs {other}; {args.dtype}; {args.rounds} rounds x {args.calls} calls per figure", flush=True)
    rows = []
    for text in args.sizes:
        size = parse_size(text)
        dtype = jax.numpy.dtype(args.dtype)
        elems = size // dtype.itemsize
        x = jax.device_put(np.random.default_rng(0).standard_normal(N * elems).astype(dtype),
                           NamedSharding(mesh, P("x")))
        for name, fn in OPS.items():
            f = program(fn)
            outs = []
            for isa in sides.values():
                _core.set_reduce_isa(isa)
                outs.append(np.asarray(f(x)))
            assert outs[0].tobytes() == outs[1].tobytes(), f"{name} {text}: the variants differ"
            spec = SPECS[name]
            res = {side: [] for side in sides}
            floors = []
            for r in range(args.rounds):
                floors.append(common.floor_copy_us(spec.floor_bytes(size, N), ranks=N,
                                                   out_bytes=spec.out_bytes(size, N), in_bytes=size))
                order = list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]
                for side, isa in order:
                    _core.set_reduce_isa(isa)
                    res[side].append(median_us(f, x, args.calls))
            b, o = np.array(res["baseline"]), np.array(res[other])
            floor = float(np.median(floors))
            row = (name, text, np.median(b), b.min(), b.max(), np.median(o), o.min(), o.max(),
                   np.median(b) / np.median(o), int(np.sum(o < b)), floor,
                   100 * floor / np.median(b), 100 * floor / np.median(o))
            rows.append(row)
            print(f"# {name} {text}: baseline {row[2]:.0f} ({row[3]:.0f}-{row[4]:.0f}) us, "
                  f"{other} {row[5]:.0f} ({row[6]:.0f}-{row[7]:.0f}) us, x{row[8]:.2f}, "
                  f"{other} faster in {row[9]}/{args.rounds}", flush=True)
    _core.set_reduce_isa("auto")
    print()
    print(f"| op | size per rank | baseline µs, median (min–max) | {other} µs, median (min–max) "
          f"| baseline / {other} | {other} faster in | memory floor µs | of floor: baseline | of floor: {other} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.0f} ({r[3]:.0f}–{r[4]:.0f}) | {r[5]:.0f} ({r[6]:.0f}–{r[7]:.0f}) "
              f"| {r[8]:.2f} | {r[9]}/{args.rounds} | {r[10]:.0f} | {r[11]:.0f} % | {r[12]:.0f} % |")


if __name__ == "__main__":
    main()
