"""`python -m benchmarks collectives --processes P`: the collectives over a mesh
that spans P processes on this machine (jax.distributed, gloo between them),
next to the same mesh in one process, strata and lax each.

Columns, per op and size (bytes per rank, float32, the op over every mesh
axis ("proc", "npu"), time = median over rounds of the mean of -n calls,
each blocked):
  P procs x L strata / lax  -- P worker processes of L devices each, the mesh (P, L);
                               strata splits each op into its in-process part and
                               XLA's cross-process collectives (README: several processes)
  1 proc x P*L strata / lax -- one process of P*L devices, the same (P, L) mesh
Each variant runs in processes of its own (started here), so their XLA
clients do not share threads. Process 0 of each run reports its timing.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _body(op, impl, axes, n):
    import jax.numpy as jnp
    from jax import lax

    if impl == "strata":
        import stratacl_jax as strata

        return {
            "all_reduce": lambda x: strata.all_reduce(x, axes),
            "all_gather": lambda x: strata.all_gather(x, axes, tiled=True),
            "reduce_scatter": lambda x: strata.reduce_scatter(x, axes, tiled=True),
            "all_to_all": lambda x: strata.all_to_all(x, axes, 0, 0, tiled=True),
            "broadcast": lambda x: strata.broadcast(x, axes, root=n - 1),
            "ppermute": lambda x: strata.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)]),
        }[op]
    return {
        "all_reduce": lambda x: lax.psum(x, axes),
        "all_gather": lambda x: lax.all_gather(x, axes, tiled=True),
        "reduce_scatter": lambda x: lax.psum_scatter(x, axes, tiled=True),
        "all_to_all": lambda x: lax.all_to_all(x, axes, 0, 0, tiled=True),
        # lax.pbroadcast lowers only on GPU in jax 0.10.2: the usual CPU spelling.
        "broadcast": lambda x: lax.psum(jnp.where(lax.axis_index(axes) == n - 1, x, jnp.zeros_like(x)), axes),
        "ppermute": lambda x: lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)]),
    }[op]


def worker(cfg):
    """One process of one variant: times every (op, size); process 0 prints JSON rows."""
    import stratacl_jax as strata

    strata.emulator.ensure_devices(cfg["n_local"])
    import jax

    if cfg["nproc"] > 1:
        jax.distributed.initialize(f"127.0.0.1:{cfg['port']}", cfg["nproc"], cfg["pid"], initialization_timeout=60,
                                   heartbeat_timeout_seconds=30, shutdown_timeout_seconds=30)
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    shape = tuple(cfg["mesh"])
    mesh = strata.emulator.make_mesh(shape, ("proc", "npu"))
    axes = ("proc", "npu")
    n = int(np.prod(shape))
    spec = P(axes)
    rows = []
    for op in cfg["ops"]:
        for size in cfg["sizes"]:
            count = max(n, size // 4 // n * n)
            f = jax.jit(jax.shard_map(_body(op, cfg["impl"], axes, n), mesh=mesh, in_specs=spec, out_specs=spec))
            host = np.random.default_rng(0).standard_normal((n * count,)).astype(np.float32)
            x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec), lambda i: host[i])
            for _ in range(cfg["warmup"]):
                f(x).block_until_ready()
            rounds = []
            for _ in range(cfg["repeats"]):
                if cfg["nproc"] > 1:
                    multihost_utils.sync_global_devices(f"{op}{size}")
                t = time.perf_counter()
                for _ in range(cfg["iters"]):
                    f(x).block_until_ready()
                rounds.append((time.perf_counter() - t) / cfg["iters"] * 1e6)
            rows.append({"op": op, "size": count * 4, "us": float(np.median(rounds))})
    if cfg["pid"] == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    if cfg["nproc"] > 1:
        multihost_utils.sync_global_devices("done")
        jax.distributed.shutdown()


def _variant(nproc, n_local, impl, args, ops, sizes, timeout):
    port = _free_port()
    procs = []
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    for pid in range(nproc):
        cfg = dict(pid=pid, nproc=nproc, port=port, n_local=n_local, mesh=[args.processes, args.local_devices],
                   impl=impl, ops=ops, sizes=sizes, iters=args.iters, warmup=args.warmup_iters,
                   repeats=args.repeats)
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.multiprocess", json.dumps(cfg)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    out = None
    deadline = time.monotonic() + timeout
    for pid, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"{nproc} x {n_local} {impl}: timed out after {timeout:.0f} s")
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"{nproc} x {n_local} {impl}: process {pid} exited {p.returncode}:\n{se[-3000:]}")
        if pid == 0:
            out = next(json.loads(line[5:]) for line in so.splitlines() if line.startswith("ROWS "))
    return {(r["op"], r["size"]): r["us"] for r in out}


def run(args):
    from . import common

    ops = common.split_list(args.ops, OPS, "--op")
    if args.sizes:
        sizes = [common.parse_size(t) for t in args.sizes.split(",") if t.strip()]
    else:
        sizes = common.size_sweep(common.parse_size(args.minbytes), common.parse_size(args.maxbytes),
                                  args.stepfactor)
    P, L = args.processes, args.local_devices
    timeout = args.child_timeout
    variants = [(f"{P} procs x {L} strata", P, L, "strata"), (f"{P} procs x {L} lax", P, L, "lax"),
                (f"1 proc x {P * L} strata", 1, P * L, "strata"), (f"1 proc x {P * L} lax", 1, P * L, "lax")]
    results = {}
    for label, nproc, n_local, impl in variants:
        print(f"# running {label} ...", file=sys.stderr, flush=True)
        results[label] = _variant(nproc, n_local, impl, args, ops, sizes, timeout)
    keys = sorted(next(iter(results.values())), key=lambda k: (ops.index(k[0]), k[1]))
    head = ["op", "size (B/rank)"] + [f"{v[0]} (us)" for v in variants] + [f"{P}p strata / {P}p lax",
                                                                          f"{P}p strata / 1p strata"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = []
    for op, size in keys:
        t = [results[v[0]][(op, size)] for v in variants]
        rows.append({"op": op, "size": size, **{v[0]: x for v, x in zip(variants, t)}})
        lines.append(f"| {op} | {size} | " + " | ".join(f"{x:.0f}" for x in t) +
                     f" | {t[0] / t[1]:.2f} | {t[0] / t[2]:.2f} |")
    table = "\n".join(lines)
    report = common.Report("collectives", {"processes": P, "local_devices": L, "ops": ops, "sizes": sizes,
                                           "iters": args.iters, "repeats": args.repeats,
                                           "mesh": [P, L], "axes": ["proc", "npu"]}, rows=rows)
    report.emit(f"# collectives over a ({P}, {L}) mesh, all axes, float32: {P} processes x {L} devices vs "
                f"1 process x {P * L}, strata and lax (time per call, us; lower is better)\n" + table)
    return report


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
