"""A/B of two commits, interleaved in one run: does a change slow anything
down? (issue 28's "nothing slows down").

Both commits (--before, e.g. main's previous head, and --after, default HEAD)
are built the same way, once each, non-editable, into a cache directory
(~/.cache/stratacl_ab/<commit>: a couple of minutes the first time): a
checkout's editable build against a pip-built one differed by up to 1.5x at
64 KiB with the same code (a build's code layout, not the change). Then --rounds rounds each start one process per side,
alternating which side goes first; each process times every case (MoE
dispatch, combine and combine's backward in both modes and two dtypes, the six collectives at two
sizes) on 8 emulated NPUs from plain jax.device_put inputs, --calls individually
blocked calls after a warm-up, and reports the median and 25th percentile.
Prints a markdown table: per case the median over rounds of each side's
median, the ratio after / before (< 1: --after is faster), the range of
the per-round ratios, and in how many rounds --after was faster.

    python scripts/ab_against_ref.py --before dcc4dd8            # against HEAD
    python scripts/ab_against_ref.py --before main~3 --rounds 8 --only moe
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# MoE at a shape whose rows are DeepEP-like in count per rank, small enough
# for 2 cores: 256 tokens/rank of hidden 1024, top-8 of 64 experts.
MOE_SHAPE = dict(n=8, tokens=256, hidden=1024, top_k=8, experts=64)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute")
COLLECTIVE_BYTES = (64 << 10, 1 << 20)


def cases(only: str) -> list[str]:
    out = []
    if only in ("all", "moe", "moe_backward"):
        ops = ("combine_backward",) if only == "moe_backward" else ("dispatch", "combine", "combine_backward")
        out += [f"moe_{op} {mode} {dt}" for mode in ("strata", "buffer_centric")
                for dt in ("float32", "bfloat16") for op in ops]
    if only in ("all", "collectives"):
        out += [f"{op} strata float32 {nbytes >> 10}K" for nbytes in COLLECTIVE_BYTES for op in COLLECTIVES]
    return out


# --- the worker: one side, one process ---------------------------------------------------------

def worker(site: str | None, calls: int, only: str) -> None:
    if site:
        # The given build first; the editable install's finder would win otherwise.
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__
                            and "skbc" not in type(f).__module__]
        sys.path.insert(0, site)
    import numpy as np

    import stratacl_jax as strata  # first: it sizes XLA's thread pool
    if site:
        assert strata.__file__.startswith(site), strata.__file__
    n = MOE_SHAPE["n"]
    strata.emulator.ensure_devices(n)
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = strata.emulator.make_mesh((n,), ("x",))
    sharded = NamedSharding(mesh, P("x"))
    rng = np.random.default_rng(0)

    def smap(fn, n_in, n_out=1):
        out_specs = P("x") if n_out == 1 else (P("x"),) * n_out
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * n_in, out_specs=out_specs))

    def timed(f, args):
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append((time.perf_counter() - t0) * 1e6)
        return {"median": float(np.median(ts)), "p25": float(np.percentile(ts, 25))}

    results = {}
    t, h, k, e = (MOE_SHAPE[key] for key in ("tokens", "hidden", "top_k", "experts"))
    cap = math.ceil(1.25 * n * t * k / e)  # rows per expert: 1.25x the mean load
    idx = jax.device_put(np.argsort(rng.random((n * t, e)), axis=1)[:, :k].astype(np.int32), sharded)
    w = jax.device_put(rng.random((n * t, k)).astype(np.float32), sharded)
    for case in cases(only):
        name, mode, dt = case.split()[:3]
        with strata.config(mode=mode, comm_buffer_bytes=1 << 30):
            if name.startswith("moe_"):
                x = jax.device_put(rng.standard_normal((n * t, h)).astype(dt), sharded)
                ey = jax.device_put(rng.standard_normal((e, cap, h)).astype(dt), sharded)

                def disp(x, i):
                    recv, handle = strata.moe.dispatch(x, i, axis_name="x", num_experts=e, capacity=cap)
                    return recv, jax.tree.map(lambda a: a[None], handle)
                dispatch = smap(disp, 2, 2)
                if name == "moe_dispatch":
                    results[case] = timed(dispatch, (x, idx))
                    continue
                _, handle = dispatch(x, idx)
                if name == "moe_combine_backward":
                    # The VJP on its own (jax.vjp would run the forward too).
                    from stratacl_jax import moe as moe_module
                    ct = jax.device_put(rng.standard_normal((n * t, h)).astype(dt), sharded)

                    def backward(y, hd, w, ct):
                        hd = jax.tree.map(lambda a: a[0], hd)
                        return tuple(moe_module._combine_bwd(("x",), (y, w, hd.pair_slot, hd.slot_source), ct)[:2])
                    results[case] = timed(smap(backward, 4, 2), (ey, handle, w, ct))
                    continue
                combine = smap(lambda y, hd, w: strata.moe.combine(y, jax.tree.map(lambda a: a[0], hd), w), 3)
                results[case] = timed(combine, (ey, handle, w))
            else:
                per_rank = int(case.split()[3][:-1]) << 10
                count = per_rank // np.dtype(dt).itemsize // n * n
                body = {"all_reduce": lambda v: strata.all_reduce(v, "x"),
                        "all_gather": lambda v: strata.all_gather(v, "x", tiled=True),
                        "reduce_scatter": lambda v: strata.reduce_scatter(v, "x", tiled=True),
                        "all_to_all": lambda v: strata.all_to_all(v, "x", 0, 0, tiled=True),
                        "broadcast": lambda v: strata.broadcast(v, "x", root=0),
                        "ppermute": lambda v: strata.ppermute(v, "x", [(r, (r + 1) % n) for r in range(n)]),
                        }[name]
                x = jax.device_put(rng.standard_normal(n * count).astype(dt), sharded)
                results[case] = timed(smap(body, 1), (x,))
    print("AB_RESULT " + json.dumps(results), flush=True)


# --- the driver --------------------------------------------------------------------------------

def build_commit(ref: str) -> tuple[str, str]:
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", ref + "^{commit}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    cache = os.path.join(os.path.expanduser("~/.cache/stratacl_ab"), commit)
    site = os.path.join(cache, "site")
    if os.path.isdir(os.path.join(site, "stratacl_jax")):
        return commit, site
    with tempfile.TemporaryDirectory() as src:
        archive = subprocess.run(["git", "-C", ROOT, "archive", commit], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
        print(f"[ab] building {ref} ({commit[:10]}) into {site} (once)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--target", site, src], check=True)
    return commit, site


def run_side(site: str, calls: int, only: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--calls", str(calls), "--only", only,
           "--site", site]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("AB_RESULT "):
            return json.loads(line[len("AB_RESULT "):])
    raise RuntimeError(f"a side failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="the earlier commit (any git ref)")
    ap.add_argument("--after", default="HEAD", help="the later commit (default HEAD; uncommitted changes are not in it)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=25)
    ap.add_argument("--only", choices=["all", "moe", "moe_backward", "collectives"], default="all")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--site", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.site, args.calls, args.only)
    if not args.before:
        ap.error("--before REF is required")
    sites = {"before": build_commit(args.before), "after": build_commit(args.after)}
    rounds: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for side in order:
            rounds[side].append(run_side(sites[side][1], args.calls, args.only))
        print(f"[ab] round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"after = {args.after} ({sites['after'][0][:10]}), before = {args.before} ({sites['before'][0][:10]}); "
          f"{args.rounds} rounds alternating which side goes first, {args.calls} blocked calls per case "
          f"and round; time = median over rounds of the per-round median (µs)\n")
    print("| case | before (µs) | after (µs) | after / before | per-round range | rounds after faster |")
    print("|---|---:|---:|---:|---|---:|")
    for case in cases(args.only):
        b = [res[case]["median"] for res in rounds["before"]]
        a = [res[case]["median"] for res in rounds["after"]]
        ratios = [x / y for x, y in zip(a, b)]
        med_b, med_a = statistics.median(b), statistics.median(a)
        wins = sum(x < y for x, y in zip(a, b))
        print(f"| {case} | {med_b:.0f} | {med_a:.0f} | {med_a / med_b:.2f} | "
              f"{min(ratios):.2f}-{max(ratios):.2f} | {wins}/{len(ratios)} |")


if __name__ == "__main__":
    main()
