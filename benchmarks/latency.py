"""`python -m benchmarks latency`: the per-op cost of small collectives inside one program.

What it measures (issue: small collectives near the limit):
- A jitted shard_map program holds K ops ("--chain"), either chained (each op consumes the
  previous op's result) or independent (K ops on K slightly different copies of the input,
  their results summed). Per-op cost = (time of the program - time of the launch reference)
  / K, where the launch reference is the same mesh's program with no op at all.
- Beside strata and lax, three floors: an FFI custom call that only copies its input (what
  XLA charges per custom call); one that meets every rank in a spin-then-yield barrier twice
  and sums a value (what meeting the group costs when each rank waits on its own thread); and
  an asynchronous meeting with the same result, as strata's ops meet: ranks return pending
  futures and the last one in sums for all and hands them to strata's resumer threads (what
  meeting costs with strata's resumption alone, no rendezvous bookkeeping, checks or plans).
  Each floor is measured in both patterns, K times, and every row sits beside the floors of
  its own pattern: independent ops cost XLA more than chained ones even when the op does
  nothing (its thunk executor runs a graph, not a sequence), and a floor must be measured
  the way the op is.
- Every measurement of one NPU count runs in one child process in interleaved rounds (each
  round times every program back to back; medians over rounds). Above 64 NPUs each (impl, op)
  gets its own child: lax.all_to_all makes XLA abort the process at 384 devices, and that
  must cost one cell ("aborted"), not the run; a lax child there that outlives --peer-timeout
  (lax's MoE compiling for minutes) is stopped and its cells read "timed out".
- Inputs are plain jax.device_put buffers (float32; MoE tokens of hidden 64), as users have.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from typing import Callable

import numpy as np

from . import common
from .common import Col, Report

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute", "moe")
PATTERNS = ("chained", "independent")
IMPLS = ("strata", "lax")
MOE_HIDDEN, MOE_TOPK = 64, 2


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--npus", default="8,64,384", help="comma list of NPU counts (8,64,384)")
    p.add_argument("--sizes", default="1K,64K", help="bytes per rank, comma list (1K,64K)")
    p.add_argument("--op", dest="ops", default="all", help=f"comma list of {', '.join(OPS)}, or all")
    p.add_argument("--pattern", default="all", help="chained, independent, or all")
    p.add_argument("--impl", default="all", help="strata, lax, or all")
    p.add_argument("--chain", default="8",
                   help="ops per program, K: one value, or one per --npus count (8)")
    p.add_argument("--big-sizes", default="1K",
                   help="sizes used above 64 NPUs, where every program costs tens of ms (1K)")
    p.add_argument("-n", "--iters", type=int, default=10, help="timed calls per round (10)")
    p.add_argument("-w", "--warmup_iters", type=int, default=2, help="warm-up calls (2)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; medians (5)")
    p.add_argument("--max-seconds", type=float, default=1.0,
                   help="cap one timed block near this many seconds by lowering -n (1)")
    p.add_argument("--child-timeout", type=float, default=1200, help=argparse.SUPPRESS)
    p.add_argument("--peer-timeout", type=float, default=300,
                   help="seconds a lax child above 64 NPUs may take before its cells read "
                        "'timed out' (300): lax's MoE at 384 NPUs compiles for many minutes, "
                        "past 14 GB, without finishing")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)  # NPUs of a child
    p.add_argument("--rows-jsonl", default=None, help=argparse.SUPPRESS)  # child -> parent
    common.add_output_args(p)


def npus_list(args) -> list[int]:
    out = [int(v) for v in str(args.npus).split(",") if v.strip()]
    if not out or any(not 1 <= v <= common.MAX_NPUS for v in out):
        raise SystemExit(f"--npus: counts in 1..{common.MAX_NPUS}")
    return out


def chains(args) -> dict[int, int]:
    """K for each NPU count: one --chain value for all, or one per --npus entry (small
    meshes are cheap per op and noisy per program, so they want a longer chain)."""
    npus = npus_list(args)
    try:
        ks = [int(v) for v in str(args.chain).split(",") if v.strip()]
    except ValueError:
        raise SystemExit("--chain: integers, one or one per --npus count") from None
    if len(ks) == 1:
        ks = ks * len(npus)
    if len(ks) != len(npus) or any(k < 1 for k in ks):
        raise SystemExit(f"--chain: one K >= 1, or one per --npus count ({len(npus)})")
    return dict(zip(npus, ks))


def sizes_for(args, n: int) -> list[int]:
    text = args.sizes if n <= 64 else args.big_sizes
    return [common.parse_size(s) for s in text.split(",") if s.strip()]


# ----------------------------------------------------------------------------------------------
# Programs (bodies run inside shard_map on the rank's 1-D float32 block)


def op_step(op: str, impl: str, strata, ax: str, n: int) -> Callable:
    """x -> x of the same shape, through one op (plus glue that costs nothing at these sizes)."""
    import jax.numpy as jnp
    from jax import lax

    ring = [(i, (i + 1) % n) for i in range(n)]
    inv_n = np.float32(1.0 / n)
    if impl == "strata":
        table = {
            "all_reduce": lambda x: strata.all_reduce(x, ax) * inv_n,
            "all_gather": lambda x: strata.all_gather(x, ax, tiled=True)[: x.shape[0]],
            "reduce_scatter": lambda x: jnp.tile(strata.reduce_scatter(x, ax, tiled=True), n) * inv_n,
            "all_to_all": lambda x: strata.all_to_all(x, ax, 0, 0, tiled=True),
            "broadcast": lambda x: strata.broadcast(x, ax, root=0),
            "ppermute": lambda x: strata.ppermute(x, ax, ring),
        }
    else:
        table = {
            "all_reduce": lambda x: lax.psum(x, ax) * inv_n,
            "all_gather": lambda x: lax.all_gather(x, ax, tiled=True)[: x.shape[0]],
            "reduce_scatter": lambda x: jnp.tile(lax.psum_scatter(x, ax, tiled=True), n) * inv_n,
            "all_to_all": lambda x: lax.all_to_all(x, ax, 0, 0, tiled=True),
            # lax.pbroadcast does not lower on CPU in jax 0.10.2: the usual spelling.
            "broadcast": lambda x: lax.psum(jnp.where(lax.axis_index(ax) == 0, x, 0), ax),
            "ppermute": lambda x: lax.ppermute(x, ax, ring),
        }
    return table[op]


def _moe_step(impl, strata, ax, n, idx, weights, capacity):
    """x [T*H] -> dispatch (fixed routing) -> identity experts -> combine -> [T*H]."""
    from . import moe as moe_bench

    num_experts = 2 * n

    def step(x):
        tokens = x.reshape(-1, MOE_HIDDEN)
        if impl == "strata":
            recv, handle = strata.moe.dispatch(tokens, idx, axis_name=ax, num_experts=num_experts,
                                               capacity=capacity)
            y = strata.moe.combine(recv, handle, weights)
        else:
            recv, handle = moe_bench.reference_dispatch(tokens, idx, axis_name=ax,
                                                        num_experts=num_experts, capacity=capacity)
            y = moe_bench.reference_combine(recv, handle, weights, axis_name=ax)
        return y.reshape(-1)

    return step


def ref_step(kind: str, ax: str, n: int) -> Callable:
    """The floors: a custom call that copies, one that meets the group in a blocking barrier,
    one that meets it asynchronously as strata's ops do (meet), and that meeting writing an
    all_gather's N-times output (fill)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    sites = iter(range(1, 1 << 30))

    def step(x):
        if kind == "copy":
            return jax.ffi.ffi_call("strata_ref_copy", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
        rank = lax.axis_index(ax).astype(jnp.int32).reshape(1)
        target = "strata_ref_barrier" if kind == "barrier" else "strata_ref_meet"
        # fill: the meeting with an all_gather's N-times output, written and sliced as its step is
        rows = n * x.shape[0] if kind == "fill" else x.shape[0]
        out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows,) + x.shape[1:], x.dtype))(
            x, rank, site_id=np.int64(next(sites)), group_size=np.int32(n))
        return out[: x.shape[0]] * np.float32(1.0 / n)

    return step


def program(step: Callable | None, pattern: str, k: int, mesh, ax: str):
    """jit(shard_map) of K steps, chained or independent; step None is the launch reference."""
    import jax
    from jax.sharding import PartitionSpec as P

    def body(x):
        if step is None:
            return x + 1
        if pattern == "chained":
            for _ in range(k):
                x = step(x)
            return x
        # Distinct operands so XLA cannot merge identical ops (CSE).
        return sum(step(x + np.float32(i)) for i in range(k))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(ax), out_specs=P(ax),
                                 check_vma=False))


# ----------------------------------------------------------------------------------------------
# One NPU count, in this process


def _moe_inputs(n: int, size: int, rng):
    tokens = max(1, size // (MOE_HIDDEN * 4))
    idx = rng.integers(0, 2 * n, size=(n * tokens, MOE_TOPK)).astype(np.int32)
    w = rng.random((n * tokens, MOE_TOPK)).astype(np.float32)
    capacity = max(1, tokens * MOE_TOPK)  # per local expert: nothing dropped at 2 experts/rank
    return tokens * MOE_HIDDEN, idx, w, capacity


def measure(args, n: int, ops: list[str], impls: list[str], patterns: list[str]) -> list[dict]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    strata, reason = common.load_strata()
    mesh = common.make_mesh((n,), ("npu",))
    ax = "npu"
    k = chains(args)[n]  # a child's n is one of the --npus its parent passes on
    rng = np.random.default_rng(0)
    rows = []
    for size in sizes_for(args, n):
        first_row = len(rows)
        count = max(n, (size // 4) // n * n)
        x = jax.device_put(rng.standard_normal(n * count).astype(np.float32),
                           NamedSharding(mesh, P(ax)))
        progs: dict[tuple, Callable] = {("launch", "-", "-"): program(None, "chained", k, mesh, ax)}
        inputs: dict[tuple, tuple] = {}
        if strata is not None:  # the floors' handlers live in strata's extension
            refs = ("copy", "barrier", "meet") + (("fill",) if "all_gather" in ops else ())
            for ref in refs:
                for pattern in patterns:
                    progs[(ref, "-", pattern)] = program(ref_step(ref, ax, n), pattern, k, mesh, ax)
        for op in ops:
            if op == "moe":
                per_rank, idx, w, cap = _moe_inputs(n, size, rng)
                moe_inputs = tuple(jax.device_put(a, NamedSharding(mesh, P(ax))) for a in (
                    rng.standard_normal(n * per_rank).astype(np.float32), idx, w))
            for impl in impls:
                if impl == "strata" and strata is None:
                    rows.append(_row(n, size, op, impl, "-", status="skipped", reason=reason))
                    continue
                for pattern in patterns:
                    key = (op, impl, pattern)
                    if op == "moe":
                        progs[key] = _moe_program(impl, strata, ax, n, k, pattern, mesh, cap)
                        inputs[key] = moe_inputs
                    else:
                        progs[key] = program(op_step(op, impl, strata, ax, n), pattern, k, mesh, ax)
        # Paired rounds: each program's block follows a block of the launch reference, and
        # its per-op cost is the difference of the two (the machine drifts between rounds).
        launch_key = ("launch", "-", "-")
        launch_fn = progs.pop(launch_key)
        common.time_calls(launch_fn, (x,), iters=1, warmup=args.warmup_iters)
        samples: dict[tuple, list] = {key: [] for key in progs}
        launch_samples: list[float] = []
        errors: dict[tuple, str] = {}
        outputs: dict[tuple, np.ndarray] = {}
        timing = dict(iters=args.iters, max_seconds=args.max_seconds)
        for _ in range(max(1, args.repeats)):
            for key, fn in progs.items():
                if key in errors:
                    continue
                call_args = inputs.get(key, (x,))
                try:
                    first = not samples[key]
                    if first:  # compile and warm up outside the pair
                        _, out = common.time_calls(fn, call_args, iters=1, warmup=args.warmup_iters)
                        if key[1] in IMPLS:
                            outputs[key] = np.asarray(out)
                    t_launch, _ = common.time_calls(launch_fn, (x,), warmup=0, first_call=False,
                                                    **timing)
                    t, _ = common.time_calls(fn, call_args, warmup=0, first_call=False, **timing)
                    launch_samples.append(t_launch.mean_us)
                    samples[key].append((t.mean_us - t_launch.mean_us) / k)
                except Exception as e:  # noqa: BLE001 - a failing cell must not cost the run
                    errors[key] = common.one_line(e)
        med = {key: float(np.median(v)) for key, v in samples.items() if v}
        launch = float(np.median(launch_samples)) if launch_samples else None

        def per_op(key):
            return med.get(key)

        for op in ops:
            for pattern in patterns:
                for impl in impls:
                    key = (op, impl, pattern)
                    if key not in progs:
                        continue
                    row = _row(n, size, op, impl, pattern, status="error" if key in errors else "ok",
                               reason=errors.get(key))
                    row.update(launch_us=launch, per_op_us=per_op(key),
                               copy_floor_us=per_op(("copy", "-", pattern)),
                               barrier_floor_us=per_op(("barrier", "-", pattern)),
                               meet_floor_us=per_op(("meet", "-", pattern)),
                               fill_floor_us=per_op(("fill", "-", pattern)) if op == "all_gather" else None,
                               rounds_us=samples.get(key), chain=k)
                    other = (op, "lax" if impl == "strata" else "strata", pattern)
                    if key in outputs and other in outputs:
                        row["matches_peer"] = bool(np.allclose(outputs[key], outputs[other],
                                                               rtol=1e-4, atol=1e-4))
                    rows.append(row)
        _emit_rows(args, rows[first_row:])
    return rows


def _moe_program(impl, strata, ax, n, k, pattern, mesh, capacity):
    import jax
    from jax.sharding import PartitionSpec as P

    def body(x, idx, w):
        step = _moe_step(impl, strata, ax, n, idx, w, capacity)
        if pattern == "chained":
            for _ in range(k):
                x = step(x)
            return x
        return sum(step(x + np.float32(i)) for i in range(k))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(ax),) * 3, out_specs=P(ax),
                                 check_vma=False))


def _row(n, size, op, impl, pattern, **kw) -> dict:
    return {"npus": n, "size": size, "op": op, "impl": impl, "pattern": pattern, **kw}


def _emit_rows(args, rows) -> None:
    if args.rows_jsonl:  # as soon as measured: a later abort must not lose it
        with open(args.rows_jsonl, "a") as f:
            for r in rows:
                f.write(json.dumps(common.jsonable(r)) + "\n")


# ----------------------------------------------------------------------------------------------
# The parent: one child process per NPU count (per impl and op above 64 NPUs)


def _children(args, n, ops, impls):
    if n <= 64:
        return [(ops, impls)]
    return [([op], [impl]) for op in ops for impl in impls]


def _run_child(args, n, ops, impls) -> tuple[list[dict], str | None, str | None]:
    """The child's rows, and if it failed, its cells' status ('aborted': XLA took the
    process down, 'timed out': stopped at its timeout, else 'error') and why."""
    # The peer alone above 64 NPUs (its own child): bounded, so it cannot hold the run.
    peer_only = n > 64 and impls == ["lax"]
    timeout = min(args.child_timeout, args.peer_timeout) if peer_only else args.child_timeout
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.jsonl")
        rc, err = common.run_child("latency", [
            *args._argv, "--child", str(n), "--op", ",".join(ops), "--impl", ",".join(impls),
            "--rows-jsonl", path], timeout)
        got = []
        if os.path.exists(path):
            with open(path) as f:
                got = [json.loads(line) for line in f if line.strip()]
    if rc == 0:
        return got, None, None
    why = common.child_failure(rc, err)
    if rc == "timeout":
        return got, "timed out", f"timed out after {timeout:.0f} s: " + why
    if common.child_aborted(rc, why):
        return got, "aborted", "aborted: " + why
    return got, "error", why


def run(args) -> Report:
    ops = common.split_list(args.ops, OPS, "--op")
    impls = common.split_list(args.impl, IMPLS, "--impl")
    patterns = common.split_list(args.pattern, PATTERNS, "--pattern")
    chain = chains(args)
    if args.child:
        common.setup_devices(args.child)
        rows = measure(args, args.child, ops, impls, patterns)
        return Report("latency", {}, rows=rows)
    params = {"npus": npus_list(args), "sizes": args.sizes, "big_sizes": args.big_sizes,
              "chain": chain, "iters": args.iters, "warmup": args.warmup_iters,
              "repeats": args.repeats, "ops": ops, "impls": impls, "patterns": patterns}
    report = Report("latency", params)
    for n in common.progress(npus_list(args), desc="latency", disable=args.no_progress):
        rows = []
        for c_ops, c_impls in _children(args, n, ops, impls):
            got, status, why = _run_child(args, n, c_ops, c_impls)
            have = {(r["size"], r["op"], r["impl"], r["pattern"]) for r in got}
            for size in sizes_for(args, n):
                for op in c_ops:
                    for impl in c_impls:
                        for pattern in patterns:
                            if why and (size, op, impl, pattern) not in have:
                                got.append(_row(n, size, op, impl, pattern,
                                                status=status, reason=why))
            rows += got
        report.rows += rows
        report.emit(_table(rows, n, chain[n]))
    report.env = common.environment() if _jax_started() else {}
    return report


def _jax_started() -> bool:
    try:
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except Exception:  # noqa: BLE001
        return False


def _table(rows: list[dict], n: int, k: int) -> str:
    by = {(r["size"], r["op"], r["pattern"], r["impl"]): r for r in rows}
    out = []
    for (size, op, pattern) in dict.fromkeys((r["size"], r["op"], r["pattern"]) for r in rows):
        s, lx = by.get((size, op, pattern, "strata"), {}), by.get((size, op, pattern, "lax"), {})
        line = {"size": size, "op": op, "pattern": pattern,
                "strata": s.get("per_op_us"), "lax": lx.get("per_op_us"),
                "launch": (s or lx).get("launch_us"), "copy": (s or lx).get("copy_floor_us"),
                "barrier": (s or lx).get("barrier_floor_us"), "meet": (s or lx).get("meet_floor_us"),
                "fill": (s or lx).get("fill_floor_us"),
                "match": s.get("matches_peer")}
        if line["strata"] and line["lax"]:
            line["speedup"] = line["lax"] / line["strata"]
        notes = [f"{impl}: {r.get('status')} ({r.get('reason')})"
                 for impl, r in (("strata", s), ("lax", lx)) if r and r.get("status") != "ok"]
        for impl, r in (("strata", s), ("lax", lx)):
            if r and r.get("status") in ("aborted", "timed out"):
                line[impl] = r["status"]
        line["_note"] = "; ".join(notes)
        out.append(line)
    cols = [Col("size", "size", "(B)", "d", 8), Col("op", "op", "", "", 14),
            Col("pattern", "pattern", "", "", 11),
            Col("strata", "strata", "(us/op)", ".1f"), Col("lax", "lax", "(us/op)", ".1f"),
            Col("speedup", "speedup", "(x)", ".2f", 8),
            Col("copy", "copy call", "(us/op)", ".1f"), Col("barrier", "barrier", "(us/op)", ".1f"),
            Col("meet", "async meet", "(us/op)", ".1f"), Col("fill", "out fill", "(us/op)", ".1f"),
            Col("launch", "launch", "(us)", ".1f"), Col("match", "match", "", "", 6)]
    return common.render_table(
        cols, out, title=f"{n} emulated NPUs: per-op cost inside one program of K={k} ops "
                         f"= (program - launch) / K; floors (same pattern, same K): a copying FFI call, "
                         f"a bare barrier, an asynchronous meeting; out fill: that meeting "
                         f"writing an all_gather's N-times output first (its floor)")


def plot(report: Report, path: str) -> None:
    plt = common.pyplot()
    rows = [r for r in report.rows if r.get("status") == "ok" and r.get("per_op_us")
            and r["pattern"] == "chained"]
    sizes = sorted({r["size"] for r in rows})
    if not rows or not sizes:
        return
    size = sizes[0]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    npus = sorted({r["npus"] for r in rows})
    width = 0.8 / max(1, 2 * len(npus))
    for j, n in enumerate(npus):
        for i, impl in enumerate(IMPLS):
            vals = [next((r["per_op_us"] for r in rows if (r["op"], r["npus"], r["impl"], r["size"])
                          == (op, n, impl, size)), math.nan) for op in ops]
            xs = [o + (2 * j + i) * width for o in range(len(ops))]
            ax.bar(xs, vals, width, label=f"{impl} {n} NPUs", alpha=0.9 if impl == "strata" else 0.5)
    ax.set_xticks([o + 0.4 - width / 2 for o in range(len(ops))], ops, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("per-op cost (us), log")
    ax.set_title(f"Small collectives inside one program ({common.format_size(size)} per rank, chained)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
