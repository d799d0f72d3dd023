"""`python -m benchmarks latency`: the per-op cost of small collectives inside one program.

What it measures (issue: small collectives near the limit):
- A jitted shard_map program holds K ops ("--chain"), either chained (each op consumes the
  previous op's result) or independent (K ops on K slightly different copies of the input,
  their results summed). Per-op cost = (time of the program - time of the launch reference)
  / K, where the launch reference is the same mesh's program with no op at all.
- Beside strata and lax, references (measured programs, not lower bounds: the barrier costs
  more than strata's ops, and a copy call can cost less than the launch program's own add, so
  they are never called floors in printed text; the JSON keys keep their *_floor_us names):
  an FFI custom call that only copies its input (what
  XLA charges per custom call); one that meets every rank in a spin-then-yield barrier twice
  and sums a value (what meeting the group costs when each rank waits on its own thread); and
  an asynchronous meeting with the same result, as strata's ops meet: ranks return pending
  futures and the last one in sums for all and hands them to strata's resumer threads (what
  meeting costs with strata's resumption alone, no rendezvous bookkeeping, checks or plans).
  Each reference is measured in both patterns, K times, and every row sits beside the
  references of its own pattern: independent ops cost XLA more than chained ones even when
  the op does nothing (its thunk executor runs a graph, not a sequence).
- Noise: a per-op cost is a difference of two noisy timings. Its noise (*_spread_us) is the
  spread over rounds of that difference (each program block minus the launch block timed just
  before it), over K, and never less than the launch's block-to-block jitter over K. A cost within its
  noise prints as '< noise (±x us)', and a speedup only when both costs stand above theirs;
  the JSON/CSV keep the raw numbers, negative ones included.
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
import os
import tempfile
from typing import Callable

import numpy as np

from . import common, style
from .common import Col, Report

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute", "moe")
PATTERNS = ("chained", "independent")
IMPLS = ("strata", "lax")
MOE_HIDDEN, MOE_TOPK = 64, 2


def _list_type(allowed, what):
    """A comma list of `allowed` names, or all -> list; a bad name is a one-line error."""
    def parse(text):
        try:
            return common.split_list(str(text), allowed, what)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = what.strip("-")
    return parse


def npus_type(text) -> list[int]:
    """'8,64,384' -> [8, 64, 384]; each count in 1..MAX_NPUS."""
    if isinstance(text, (list, tuple)):
        return [int(v) for v in text]
    try:
        out = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or any(not 1 <= v <= common.MAX_NPUS for v in out):
        raise argparse.ArgumentTypeError(
            f"bad --npus {text!r}: a comma list of NPU counts in 1..{common.MAX_NPUS}, e.g. 8,64,384")
    return out


def sizes_type(text) -> list[int]:
    """'1K,64K' -> [1024, 65536]."""
    if isinstance(text, (list, tuple)):
        return [int(v) for v in text]
    try:
        out = [common.parse_size(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        out = []
    if not out or any(v < 1 for v in out):
        raise argparse.ArgumentTypeError(
            f"bad size list {text!r}: bytes per rank, comma list with K/M/G suffixes, e.g. 1K,64K")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--npus", type=npus_type, default="8,64,384",
                   help="comma list of NPU counts (8,64,384)")
    p.add_argument("--sizes", type=sizes_type, default="1K,64K",
                   help="bytes per rank, comma list (1K,64K)")
    p.add_argument("--op", dest="ops", type=_list_type(OPS, "--op"), default="all",
                   help=f"comma list of {', '.join(OPS)}, or all")
    p.add_argument("--pattern", type=_list_type(PATTERNS, "--pattern"), default="all",
                   help="chained, independent, or all")
    p.add_argument("--impl", type=_list_type(IMPLS, "--impl"), default="all",
                   help="strata, lax, or all")
    p.add_argument("--chain", default="8",
                   help="ops per program, K: one value, or one per --npus count (8)")
    p.add_argument("--big-sizes", type=sizes_type, default="1K",
                   help="sizes used above 64 NPUs, where every program costs tens of ms (1K)")
    p.add_argument("-n", "--iters", type=int, default=10, help="timed calls per round (10)")
    p.add_argument("-w", "--warmup_iters", type=int, default=2, help="warm-up calls (2)")
    p.add_argument("--repeats", type=int, default=5,
                   help="interleaved rounds; medians, and their spread is the noise (5)")
    p.add_argument("--max-seconds", type=float, default=1.0,
                   help="cap one timed block near this many seconds by lowering -n (1)")
    p.add_argument("--verbose", action="store_true",
                   help="also print every reference (copy call, barrier, async meet, out fill) "
                        "and the launch time with their noise (always in the JSON/CSV)")
    p.add_argument("--child-timeout", type=float, default=1200, help=argparse.SUPPRESS)
    p.add_argument("--peer-timeout", type=float, default=300,
                   help="seconds a lax child above 64 NPUs may take before its cells read "
                        "'timed out' (300): lax's MoE at 384 NPUs compiles for many minutes, "
                        "past 14 GB, without finishing")
    p.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)  # NPUs of a child
    p.add_argument("--rows-jsonl", default=None, help=argparse.SUPPRESS)  # child -> parent
    common.add_output_args(p)
    common.one_line_errors(p, validate)


def validate(args, parser: argparse.ArgumentParser) -> None:
    """Checks that need several arguments at once; one-line errors through the parser."""
    try:
        chains(args)
    except SystemExit as e:
        parser.error(str(e.code))
    for name in ("iters", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


def _listed(value, allowed) -> list[str]:
    return list(value) if isinstance(value, (list, tuple)) else \
        common.split_list(str(value), allowed, "list")


def npus_list(args) -> list[int]:
    try:
        return npus_type(args.npus)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(str(e)) from None


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
    return sizes_type(args.sizes if n <= 64 else args.big_sizes)


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
        samples: dict[tuple, list] = {key: [] for key in progs}  # per-op cost, each round
        prog_samples: dict[tuple, list] = {key: [] for key in progs}  # program time, each round
        paired_launch: dict[tuple, list] = {key: [] for key in progs}  # the launch block before it
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
                    prog_samples[key].append(t.mean_us)
                    paired_launch[key].append(t_launch.mean_us)
                    samples[key].append((t.mean_us - t_launch.mean_us) / k)
                except Exception as e:  # noqa: BLE001 - a failing cell must not cost the run
                    errors[key] = common.one_line(e)
        med = {key: float(np.median(v)) for key, v in samples.items() if v}
        launch = float(np.median(launch_samples)) if launch_samples else None
        # What noise alone makes of a difference of two back-to-back timings: the median
        # change between successive launch blocks (one before each program's block, so there
        # are many even with one round). No per-op cost is credited below this.
        launch_jitter = (float(np.median(np.abs(np.diff(launch_samples))))
                         if len(launch_samples) > 1 else 0.0)

        def per_op(key):
            return med.get(key)

        def noise(key):
            """Noise of one per-op cost, a difference of two timings over K: the spread over
            rounds of that difference (program minus the launch block timed just before it:
            the two rise and fall together with the machine's load, so the paired difference
            is what varies), divided by K; never less than the launch's block-to-block
            jitter / K, so one round still carries a noise."""
            if key not in med:
                return None
            rounds = style.spread([p - q for p, q in zip(prog_samples[key], paired_launch[key])])
            return max(rounds, launch_jitter) / k

        for op in ops:
            for pattern in patterns:
                for impl in impls:
                    key = (op, impl, pattern)
                    if key not in progs:
                        continue
                    row = _row(n, size, op, impl, pattern, status="error" if key in errors else "ok",
                               reason=errors.get(key))
                    fill = ("fill", "-", pattern) if op == "all_gather" else None
                    row.update(launch_us=launch,
                               launch_spread_us=style.spread(launch_samples) if launch else None,
                               launch_jitter_us=launch_jitter if launch else None,
                               per_op_us=per_op(key), per_op_spread_us=noise(key),
                               copy_floor_us=per_op(("copy", "-", pattern)),
                               copy_floor_spread_us=noise(("copy", "-", pattern)),
                               barrier_floor_us=per_op(("barrier", "-", pattern)),
                               barrier_floor_spread_us=noise(("barrier", "-", pattern)),
                               meet_floor_us=per_op(("meet", "-", pattern)),
                               meet_floor_spread_us=noise(("meet", "-", pattern)),
                               fill_floor_us=per_op(fill) if fill else None,
                               fill_floor_spread_us=noise(fill) if fill else None,
                               rounds_us=samples.get(key), program_rounds_us=prog_samples.get(key),
                               launch_rounds_us=paired_launch.get(key),
                               chain=k)
                    other = (op, "lax" if impl == "strata" else "strata", pattern)
                    if key in outputs and other in outputs:
                        row["matches_peer"] = bool(np.allclose(outputs[key], outputs[other],
                                                               rtol=1e-4, atol=1e-4))
                    rows.append(row)
        _add_speedups(rows[first_row:])
        _emit_rows(args, rows[first_row:])
    return rows


def above_noise(row: dict | None, key: str = "per_op") -> bool:
    """The row's measured cost (per_op, copy_floor, ...) stands above its noise."""
    if not row:
        return False
    v = row.get(f"{key}_us")
    return v is not None and not style.within_noise(v, row.get(f"{key}_spread_us") or 0.0)


def _add_speedups(rows: list[dict]) -> None:
    """strata rows get `speedup` = lax / strata per-op cost, only when both stand above their
    noise (a ratio of noise is no result); None otherwise."""
    by = {(r["size"], r["op"], r["pattern"], r["impl"]): r for r in rows}
    for r in rows:
        if r["impl"] != "strata":
            continue
        peer = by.get((r["size"], r["op"], r["pattern"], "lax"))
        r["speedup"] = (peer["per_op_us"] / r["per_op_us"]
                        if above_noise(r) and above_noise(peer) else None)


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
    ops = _listed(args.ops, OPS)
    impls = _listed(args.impl, IMPLS)
    patterns = _listed(args.pattern, PATTERNS)
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
        _add_speedups(rows)  # above 64 NPUs strata and lax ran in children of their own
        report.rows += rows
        report.emit(_table(rows, n, chain[n], verbose=getattr(args, "verbose", False)))
    report.env = common.environment() if _jax_started() else {}
    return report


def _jax_started() -> bool:
    try:
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except Exception:  # noqa: BLE001
        return False


def cost_text(row: dict | None, key: str = "per_op") -> str:
    """One measured cost with its noise: '3.8 ±1.2 us', '< noise (±8.0 us)', or why not."""
    if not row:
        return "-"
    if row.get("status") not in (None, "ok"):
        return str(row.get("status"))
    v = row.get(f"{key}_us")
    if v is None:
        return "N/A"
    return style.noisy_value(v, row.get(f"{key}_spread_us") or 0.0)


def speedup_text(strata_row: dict | None, lax_row: dict | None) -> str:
    """lax / strata, printed only when both costs stand above their noise."""
    if not strata_row or not lax_row or strata_row.get("status") != "ok" \
            or lax_row.get("status") != "ok":
        return "-"
    if not (above_noise(strata_row) and above_noise(lax_row)):
        return "n/a (noise)"
    return f"{lax_row['per_op_us'] / strata_row['per_op_us']:.1f}x"


def ref_key(op: str) -> str:
    """The reference an op is set beside in the default table: all_gather's is the meeting
    that writes its N-times output (out fill), every other op's the bare async meeting."""
    return "fill_floor" if op == "all_gather" else "meet_floor"


def _table(rows: list[dict], n: int, k: int, verbose: bool = False) -> str:
    by = {(r["size"], r["op"], r["pattern"], r["impl"]): r for r in rows}
    out, notes = [], []
    for (size, op, pattern) in dict.fromkeys((r["size"], r["op"], r["pattern"]) for r in rows):
        s, lx = by.get((size, op, pattern, "strata")), by.get((size, op, pattern, "lax"))
        any_row = s or lx or {}
        match = (s or {}).get("matches_peer")
        out.append({"size": style.size_label(size), "op": op, "pattern": pattern,
                    "strata": cost_text(s), "lax": cost_text(lx), "speedup": speedup_text(s, lx),
                    "ref": cost_text(any_row, ref_key(op)) if any_row.get("launch_us") else "N/A",
                    "match": "-" if match is None else ("yes" if match else "NO")})
        for impl, r in (("strata", s), ("lax", lx)):
            if r and r.get("status") != "ok":
                note = (f"{style.size_label(size)} {op} {pattern} {impl}: {r.get('status')} "
                        f"({r.get('reason')})")
                notes.append(note if len(note) <= 116 else note[:113] + "...")
    cols = [Col("size", "size", "(B)", "", 5), Col("op", "op", "", "", 14),
            Col("pattern", "pattern", "", "", 11),
            Col("strata", "strata", "(per op)", "", 19), Col("lax", "lax (XLA)", "(per op)", "", 19),
            Col("speedup", "speedup", "lax/strata", "", 11),
            Col("ref", "meet ref", "(per op)", "", 19), Col("match", "match", "", "", 5)]
    footer = ["± noise: spread over rounds of (program - launch), / K, at least the launch's jitter / K; "
              "'< noise': within it",
              "meet ref: a reference, not a floor: the group meeting asynchronously with no op "
              "(all_gather: out fill)",
              "--verbose: the copy call, barrier, async meet and out fill references and the launch",
              *notes]
    text = common.render_table(
        cols, out, title=f"{n} emulated NPUs: per-op cost inside one program of K={k} ops "
                         f"= (program - launch) / K", footer=footer)
    if verbose:
        text += "\n" + _ref_table(rows, n, k)
    return text


REFS = (("copy_floor", "copy call"), ("barrier_floor", "barrier"), ("meet_floor", "async meet"),
        ("fill_floor", "out fill"))


def _ref_table(rows: list[dict], n: int, k: int) -> str:
    """The references of each size and pattern (the same for every op) and the launch."""
    out = []
    for (size, pattern) in dict.fromkeys((r["size"], r["pattern"]) for r in rows
                                         if r.get("launch_us") is not None):
        rs = [r for r in rows if (r["size"], r["pattern"]) == (size, pattern)
              and r.get("launch_us") is not None]
        line = {"size": style.size_label(size), "pattern": pattern,
                "launch": style.noisy_value(rs[0]["launch_us"], rs[0].get("launch_spread_us") or 0)}
        for key, _ in REFS:
            have = next((r for r in rs if r.get(f"{key}_us") is not None), None)
            line[key] = cost_text(have, key) if have else "N/A"
        out.append(line)
    cols = [Col("size", "size", "(B)", "", 5), Col("pattern", "pattern", "", "", 11),
            *[Col(key, head, "(per op)", "", 19) for key, head in REFS],
            Col("launch", "launch", "(program)", "", 17)]
    return common.render_table(
        cols, out, title=f"{n} emulated NPUs, references (same pattern, same K={k}): measured "
                         f"programs, not lower bounds",
        footer=["copy call: an FFI call that copies its input; barrier: the group meeting in a "
                "blocking barrier;",
                "async meet: meeting as strata's ops do (pending futures, resumer threads); "
                "out fill: that meeting",
                "writing an all_gather's N-times output; launch: the program with no op "
                "(its cost is subtracted)"])


def figure(report: Report):
    """The bar chart of per-op costs (smallest size, chained if measured): one bar per op, impl
    and NPU count. A cost within its noise (or <= 0) is drawn hatched at the noise level and
    labelled '< noise'; a cell that failed gets its status written where its bar would be.
    Returns (fig, ax), or None when there is nothing to draw."""
    plt = common.pyplot()
    from matplotlib.patches import Patch

    rows = [r for r in report.rows if r.get("pattern") in PATTERNS]
    pattern = "chained" if any(r["pattern"] == "chained" for r in rows) else "independent"
    rows = [r for r in rows if r["pattern"] == pattern]
    sizes = sorted({r["size"] for r in rows})
    if not rows or not sizes:
        return None
    size = sizes[0]
    rows = [r for r in rows if r["size"] == size]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    npus = sorted({r["npus"] for r in rows})
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    slots = max(1, len(npus) * len(impls))
    width = 0.8 / slots
    measured = [r["per_op_us"] for r in rows if r.get("per_op_us") is not None and above_noise(r)]
    noises = [r.get("per_op_spread_us") or 0 for r in rows if r.get("per_op_us") is not None]
    positive = [v for v in measured + noises if v > 0]
    floor_y = min(positive) / 3 if positive else 0.1  # the axis bottom, below every bar
    noisy_handle = False
    handles, labels = [], []
    for j, n in enumerate(npus):
        alpha = 1.0 - 0.6 * j / max(1, len(npus) - 1) if len(npus) > 1 else 0.9
        for i, impl in enumerate(impls):
            look = style.series(impl)
            handles.append(Patch(color=look["color"], alpha=alpha))
            labels.append(look["label"] + (f", {n} NPUs" if len(npus) > 1 else ""))
            for o, op in enumerate(ops):
                x = o + (len(impls) * j + i) * width
                r = next((r for r in rows if (r["op"], r["npus"], r["impl"]) == (op, n, impl)), None)
                if r is None:
                    continue
                v, noise = r.get("per_op_us"), r.get("per_op_spread_us") or 0.0
                if r.get("status") != "ok" or v is None:
                    ax.text(x, floor_y, str(r.get("status") or "n/a"), rotation=90, ha="center",
                            va="bottom", fontsize=6)
                    continue
                if above_noise(r):
                    ax.bar(x, v, width, yerr=noise if noise > 0 else None, color=look["color"],
                           alpha=alpha, ecolor="black", capsize=2)
                else:  # within the noise: a hatched bar up to the noise level, marked
                    ax.bar(x, max(noise, floor_y), width, facecolor="none", hatch="///",
                           edgecolor=look["color"], alpha=alpha)
                    ax.text(x, max(noise, floor_y), "< noise", rotation=90, ha="center",
                            va="bottom", fontsize=6)
                    noisy_handle = True
    ax.set_xticks([o + 0.4 - width / 2 for o in range(len(ops))], ops, rotation=20)
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor_y)
    ax.set_ylabel("per-op cost (us), log; bars ± noise")
    ax.set_title(f"Small collectives inside one program ({style.size_label(size)} per rank, "
                 f"{pattern})")
    if noisy_handle:
        handles.append(Patch(facecolor="none", hatch="///", edgecolor="gray"))
        labels.append("< noise: cost within its noise, drawn at the noise level")
    ax.legend(handles, labels, fontsize=7, ncol=2)
    fig.tight_layout()
    return fig, ax


def plot(report: Report, path: str) -> None:
    made = figure(report)
    if made is None:
        return
    fig, _ = made
    fig.savefig(path, dpi=110)
    common.pyplot().close(fig)
