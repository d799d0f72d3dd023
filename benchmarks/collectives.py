"""`python -m benchmarks collectives`: nccl-tests-style sweeps of the six collectives.

Conventions (FACTS §3, nccl-tests doc/PERFORMANCE.md):
- `-b/-e` sizes are input bytes PER RANK; `count` is elements per rank.
- algbw = S / time with nccl-tests' S: the per-rank buffer for all_reduce, reduce_scatter (its
  input), all_to_all, broadcast and ppermute; N x size for all_gather (its output).
- busbw = algbw x f: 2(N-1)/N all_reduce; (N-1)/N all_gather, reduce_scatter, all_to_all;
  1 broadcast and ppermute (sendrecv).
- time = mean wall time per call of n back-to-back calls of one jitted shard_map program
  (blocking every 16 calls and after the last), median over --repeats rounds; each round
  times every variant, the launch reference and the memory reference back to back
  (interleaved), in two blocks of about n/2 calls when n >= 2. The spread printed after a
  time ("±") is half the range of all those blocks: a difference smaller than the two
  spreads is noise (a speedup then prints "≈1").
- floor = a lower bound no correct implementation beats on this machine: the bytes the op
  must write (every rank's whole output: N x its output size) at the fastest write this
  machine does, memset of cache-warm, pre-touched memory on one thread or on all cores, the
  minimum of many tries (common.write_floor_us); launch and reads are not counted. "of floor"
  = floor / op time, <= 100% (a value above would mean the argument failed: it prints
  "beaten!" rather than a number).
- memory reference (--verbose, JSON ref_*) = the op's minimal bytes read + written over all
  ranks (all_reduce N*S + N*S, all_gather N*S + N*N*S, reduce_scatter N*S + S, all_to_all and
  ppermute N*S + N*S, broadcast S + N*S), timed as np.copyto calls on every core laid out like
  the op into fresh np.empty memory (common.floor_copy_us). It is NOT a bound: strata beats it
  where XLA's buffers are warmer than malloc's, so it is a reference only.
- #wrong = elements that differ from an exact expected value: inputs are small integers that
  depend on rank and position, chosen per dtype so every sum/product is exact in any order.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import common, modeled, style
from .common import Col, Report

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute")
REDOPS = ("sum", "prod", "max", "min", "avg")  # -o all runs each (nccl-tests' order)
# avg is strata's op="mean" and lax.pmean; integers have no mean here (pmean makes floats).
STRATA_REDOP = {"avg": "mean"}

# nccl-tests spellings (-d float, half, ...) mapped to numpy/JAX names.
DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16",
                 "int": "int32", "uint": "uint32", "char": "int8", "uchar": "uint8",
                 "fp32": "float32", "fp16": "float16"}
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "uint8",
          "uint32", "bool")

# Largest integer each dtype holds exactly (sums and products are kept below it).
_EXACT_LIMIT = {"float16": 2048, "bfloat16": 256, "float32": 2**24, "float64": 2**53,
                "int8": 127, "uint8": 255, "int32": 2**31 - 1, "uint32": 2**32 - 1,
                "int64": 2**62}


def np_dtype(name: str):
    import jax.numpy as jnp

    return np.dtype(jnp.bfloat16) if name == "bfloat16" else np.dtype(name)


# ----------------------------------------------------------------------------------------------
# The ops: byte accounting, inputs and expected outputs


@dataclass(frozen=True)
class OpSpec:
    name: str
    reduces: bool
    bus_factor: Callable[[int], float]
    s_bytes: Callable[[int, int], int]  # (size per rank, N) -> nccl-tests S
    floor_bytes: Callable[[int, int], int]  # (size per rank, N) -> bytes read + written
    divisible: bool  # per-rank count must be a multiple of N
    out_bytes: Callable[[int, int], int] = lambda s, n: s  # (size per rank, N) -> output per rank
    one_source: bool = False  # every rank's output comes from one rank's input (the floor's layout)


SPECS = {
    "all_reduce": OpSpec("all_reduce", True, lambda n: 2 * (n - 1) / n, lambda s, n: s,
                         lambda s, n: 2 * n * s, False),
    "all_gather": OpSpec("all_gather", False, lambda n: (n - 1) / n, lambda s, n: n * s,
                         lambda s, n: n * s + n * n * s, False, lambda s, n: n * s),
    "reduce_scatter": OpSpec("reduce_scatter", True, lambda n: (n - 1) / n, lambda s, n: s,
                             lambda s, n: n * s + s, True, lambda s, n: s // n),
    "all_to_all": OpSpec("all_to_all", False, lambda n: (n - 1) / n, lambda s, n: s,
                         lambda s, n: 2 * n * s, True),
    "broadcast": OpSpec("broadcast", False, lambda n: 1.0, lambda s, n: s,
                        lambda s, n: s + n * s, False, one_source=True),
    "ppermute": OpSpec("ppermute", False, lambda n: 1.0, lambda s, n: s,
                       lambda s, n: 2 * n * s, False),
}


def ring(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def make_values(spec: OpSpec, redop: str, dtype: str, n: int, count: int) -> np.ndarray:
    """Integer inputs [N, count] (int64, not yet cast) that keep every result exact.

    Sums stay under the dtype's exact-integer limit whatever the order of additions (values are
    >= 0, so partial sums never exceed the total); products are 2^c with c <= 3."""
    r = np.arange(n, dtype=np.int64)[:, None]
    i = np.arange(count, dtype=np.int64)[None, :]
    if dtype == "bool":
        return (r + i) % 2
    if not spec.reduces:
        return (r + 1) + i % 7  # wraps for narrow ints: fine, data is only moved
    limit = _EXACT_LIMIT[dtype]
    signed = dtype.startswith(("int", "float", "bfloat"))
    if redop in ("sum", "avg"):
        top = min(6, limit // n)
        if top >= 1:
            return (r + i) % (top + 1)
        q = -(-n // limit)  # so that at most limit ranks hold a 1 at any position
        return ((r + i) % q == 0).astype(np.int64)
    if redop in ("max", "min"):
        return (3 * r + i) % 7 - (3 if signed else 0)
    c = min(3, n, int(math.log2(limit)))  # prod
    return np.where((r + i) % n < c, 2, 1)


def reduce_np(v: np.ndarray, redop: str) -> np.ndarray:
    if redop == "avg":  # exact sum, one division: what psum / N rounds to
        return v.sum(axis=0) / v.shape[0]
    return {"sum": v.sum, "max": v.max, "min": v.min, "prod": v.prod}[redop](axis=0)


def expected(spec: OpSpec, vals: np.ndarray, inp: np.ndarray, redop: str, root: int,
             dt) -> np.ndarray:
    """Expected per-rank outputs, [N, out_count] or broadcastable [1, out_count]."""
    n, count = inp.shape
    if spec.name == "all_reduce":
        return reduce_np(vals, redop).astype(dt)[None]
    if spec.name == "reduce_scatter":
        return reduce_np(vals, redop).astype(dt).reshape(n, count // n)
    if spec.name == "all_gather":
        return inp.reshape(1, n * count)
    if spec.name == "all_to_all":
        return inp.reshape(n, n, count // n).transpose(1, 0, 2).reshape(n, count)
    if spec.name == "broadcast":
        return inp[root][None]
    if spec.name == "ppermute":
        return np.roll(inp, 1, axis=0)  # rank r receives from r-1
    raise ValueError(spec.name)


# ----------------------------------------------------------------------------------------------
# Bodies run inside shard_map (x is the rank's 1-D block)


def strata_body(strata, op: str, ax, redop: str, root: int, n: int) -> Callable:
    redop = STRATA_REDOP.get(redop, redop)
    if op == "all_reduce":
        return lambda x: strata.all_reduce(x, ax, op=redop)
    if op == "all_gather":
        return lambda x: strata.all_gather(x, ax, axis=0, tiled=True)
    if op == "reduce_scatter":
        return lambda x: strata.reduce_scatter(x, ax, scatter_dimension=0, tiled=True, op=redop)
    if op == "all_to_all":
        return lambda x: strata.all_to_all(x, ax, 0, 0, tiled=True)
    if op == "broadcast":
        return lambda x: strata.broadcast(x, ax, root=root)
    if op == "ppermute":
        perm = ring(n)
        return lambda x: strata.ppermute(x, ax, perm)
    raise ValueError(op)


def lax_body(op: str, ax, redop: str, root: int, n: int, dtype: str) -> tuple[Callable, str]:
    """The lax peer and how it is spelled (ops lax lacks on CPU are composed from others)."""
    import jax.numpy as jnp
    from jax import lax

    def gathered_prod(x):
        return jnp.prod(lax.all_gather(x, ax), axis=0, dtype=x.dtype)

    red = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin, "avg": lax.pmean}
    if op == "all_reduce":
        if redop == "prod":
            return gathered_prod, "all_gather+prod"
        return (lambda x: red[redop](x, ax)), red[redop].__name__
    if op == "all_gather":
        return (lambda x: lax.all_gather(x, ax, tiled=True)), "all_gather"
    if op == "reduce_scatter":
        if redop == "sum":
            return (lambda x: lax.psum_scatter(x, ax, tiled=True)), "psum_scatter"

        def rs(x):
            full = gathered_prod(x) if redop == "prod" else red[redop](x, ax)
            m = x.shape[0] // n
            return lax.dynamic_slice_in_dim(full, lax.axis_index(ax) * m, m)

        return rs, f"{'all_gather+prod' if redop == 'prod' else red[redop].__name__}+slice"
    if op == "all_to_all":
        return (lambda x: lax.all_to_all(x, ax, 0, 0, tiled=True)), "all_to_all"
    if op == "broadcast":
        # lax.pbroadcast has no CPU lowering in jax 0.10.2: the usual spelling is a masked psum.
        if dtype == "bool":
            return (lambda x: lax.all_gather(x, ax)[root]), "all_gather[root]"
        return (lambda x: lax.psum(jnp.where(lax.axis_index(ax) == root, x, jnp.zeros_like(x)),
                                   ax)), "psum(masked)"
    if op == "ppermute":
        perm = ring(n)
        return (lambda x: lax.ppermute(x, ax, perm)), "ppermute"
    raise ValueError(op)


# ----------------------------------------------------------------------------------------------
# Running


def _dtype_arg(text: str) -> str:
    """-d: a dtype (nccl-tests names too), a comma list, or all; the text, checked."""
    names = [DTYPE_ALIASES.get(t.strip(), t.strip()) for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return text
    bad = [t for t in names if t not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {', '.join(bad) or repr(text)}: choose from {', '.join(DTYPES)} "
            f"(or {', '.join(DTYPE_ALIASES)}), a comma list, or all")
    return text


def dtypes_of(text: str) -> list[str]:
    names = [DTYPE_ALIASES.get(t.strip(), t.strip()) for t in text.split(",") if t.strip()]
    return list(DTYPES) if names == ["all"] else list(dict.fromkeys(names))


def redops_of(text: str) -> list[str]:
    return common.split_list(text, REDOPS, "-o")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", type=common.size_arg, default="4K",
                   help="smallest size, bytes per rank (4K)")
    p.add_argument("-e", "--maxbytes", type=common.size_arg, default="4M",
                   help="largest size, bytes per rank (4M)")
    p.add_argument("-f", "--stepfactor", type=float, default=4.0, help="size factor (4)")
    p.add_argument("--sizes", type=common.sizes_arg, default=None,
                   help="explicit comma list of sizes per rank, e.g. 4K,1M,4M,32M (overrides -b/-e/-f)")
    p.add_argument("-n", "--iters", type=common.int_at_least(1), default=10,
                   help="timed calls per size (10)")
    p.add_argument("-w", "--warmup_iters", type=common.int_at_least(0), default=3,
                   help="warm-up calls (3)")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1), help="check results")
    p.add_argument("-o", "--redop", dest="redop", default="sum",
                   type=common.list_arg(REDOPS, "-o reduction"),
                   help=f"reduction of all_reduce and reduce_scatter: {', '.join(REDOPS)}, a comma "
                        f"list, or all (each in turn; avg of integers is skipped) (sum)")
    p.add_argument("-d", "--datatype", default="float32", type=_dtype_arg,
                   help=f"dtype: {', '.join(DTYPES)} (nccl-tests names too), a comma list, or all")
    p.add_argument("-r", "--root", type=common.int_at_least(0), default=0, help="broadcast root (0)")
    p.add_argument("--op", dest="ops", default="all", type=common.list_arg(OPS, "--op"),
                   help=f"comma list of {', '.join(OPS)}, or all")
    p.add_argument("--npus", type=common.int_at_least(1), default=None,
                   help=f"emulated NPUs (8; up to {common.MAX_NPUS})")
    p.add_argument("--mesh", type=common.mesh_arg, default=None,
                   help="mesh shape, e.g. 2x4 (default: 1-D of --npus)")
    common.add_mode_impl_args(p)
    p.add_argument("--alloc", default="both", choices=("both", "jax", "strata"),
                   help="inputs of every row from plain jax.device_put (jax) or from "
                        "strata.memory arenas (strata); both (default): plain inputs for every "
                        "row, plus a strata row fed from arenas")
    common.add_timing_args(p)
    p.add_argument("-z", "--blocking", type=int, default=0, choices=(0, 1),
                   help="nccl-tests -z: 1 = block on the result after every call "
                        "(= --sync-every 1) (0)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also print the detail tables: memory reference, launch, modeled time, "
                        "every mode and input as its own table (always in the JSON/CSV)")
    p.add_argument("--isolate", default="auto", choices=("auto", "on", "off"),
                   help="run each op and impl in a child process (auto: when N > 64)")
    p.add_argument("--processes", type=common.int_at_least(1), default=1,
                   help="run over a mesh spanning this many processes on this machine (jax.distributed), "
                        "next to one process and lax (benchmarks/multiprocess.py)")
    p.add_argument("--local-devices", type=common.int_at_least(1), default=None,
                   help="with --processes: devices per process (default: --npus / --processes)")
    p.add_argument("--child-timeout", type=float, default=1800, help=argparse.SUPPRESS)
    p.add_argument("--rows-jsonl", default=None, help=argparse.SUPPRESS)  # child -> parent
    modeled.add_model_args(p, npus_default="8,32,384", sizes=True)
    common.add_output_args(p)
    common.one_line_errors(p, validate)


def validate(args, p: argparse.ArgumentParser) -> None:
    """Checks that need several arguments; p.error: one line, exit 2."""
    b, e = common.parse_size(args.minbytes), common.parse_size(args.maxbytes)
    if args.sizes is None and b > e:
        p.error(f"-b {common.format_size(b)} is larger than -e {common.format_size(e)}: "
                f"the sweep runs from -b up to -e")
    if args.stepfactor <= 0:
        p.error("-f must be > 0")
    if args.blocking:
        args.sync_every = 1
    shape = common.parse_mesh(args.mesh)
    npus = args.npus if args.npus is not None else (math.prod(shape) if shape else 8)
    if shape is not None and args.npus is not None and args.npus != math.prod(shape):
        p.error(f"--npus {args.npus} does not match --mesh {args.mesh} "
                f"({math.prod(shape)} NPUs)")
    if not getattr(args, "model_only", False) and not 1 <= npus <= common.MAX_NPUS:
        p.error(f"--npus must be in 1..{common.MAX_NPUS}")
    if args.root >= npus:
        p.error(f"--root {args.root} is not a rank of {npus} NPUs (0..{npus - 1})")


def npus_and_mesh(args) -> tuple[int, tuple[int, ...]]:
    shape = common.parse_mesh(getattr(args, "mesh", None))
    npus = getattr(args, "npus", None)
    if shape is None:
        npus = npus or 8
        shape = (npus,)
    elif npus is not None and npus != math.prod(shape):
        raise SystemExit(f"--npus {npus} does not match --mesh {args.mesh}")
    return math.prod(shape), shape


# The extra variant of --alloc both: strata mode with arena inputs (an input, not a mode).
ARENA = "strata+arena"


def _device_put(x_global: np.ndarray, sharding, alloc: str, strata):
    import jax

    if alloc != "jax" and strata is not None:
        put = getattr(getattr(strata, "memory", None), "device_put", None)
        if put is not None:
            try:
                return put(x_global, sharding), "strata.memory"
            except Exception as e:
                if alloc == "strata":
                    raise
                print(f"# warning: strata.memory.device_put failed ({common.one_line(e)})",
                      file=sys.stderr)
        elif alloc == "strata":
            raise SystemExit("--alloc strata: strata.memory.device_put is missing")
    return jax.device_put(x_global, sharding), "jax"


def isolated(args) -> bool:
    """Run each (op, impl) in a child process? XLA:CPU aborts the whole process when a
    rendezvous times out (seen: lax.all_to_all at 384 devices on 2 cores), so at large N a
    crash must cost one table cell, not the sweep."""
    if getattr(args, "processes", 1) > 1:
        return True  # the worker processes set up their own devices
    if args.isolate == "auto":
        return npus_and_mesh(args)[0] > 64
    return args.isolate == "on"


def _base_rows(op, args, dtype, n, shape, sizes):
    """Per size: the row fields that do not depend on the implementation."""
    spec, dt = SPECS[op], np_dtype(dtype)
    out = []
    for size in sizes:
        count = max(1, size // dt.itemsize)
        if spec.divisible:
            count = max(n, count - count % n)
        nbytes = count * dt.itemsize
        out.append({"op": op, "npus": n, "mesh": "x".join(map(str, shape)), "dtype": dtype,
                    "redop": args.redop if spec.reduces else "none",
                    "root": args.root if op == "broadcast" else -1, "size": nbytes,
                    "count": count, "s_bytes": spec.s_bytes(nbytes, n),
                    "bus_factor": spec.bus_factor(n),
                    # the floor: bytes every rank must write (N outputs); the memory
                    # reference: minimal bytes read + written
                    "floor_bytes": n * spec.out_bytes(nbytes, n),
                    "ref_bytes": spec.floor_bytes(nbytes, n),
                    "one_source": spec.one_source,
                    "out_bytes": spec.out_bytes(nbytes, n)})
    return out


def run(args) -> Report:
    if getattr(args, "processes", 1) > 1:
        from . import multiprocess

        if args.local_devices is None:
            args.local_devices = max(1, (args.npus or 8) // args.processes)
        return multiprocess.run(args)
    import jax

    dtypes = dtypes_of(args.datatype)
    redops = redops_of(args.redop)
    if getattr(args, "model_only", False):
        args.datatype = dtypes[0]
        return modeled.collectives_sweep(args, OPS)
    if any(d.endswith("64") for d in dtypes):
        jax.config.update("jax_enable_x64", True)
    ops = common.split_list(args.ops, OPS, "--op")
    impls = common.impls_from_arg(args.impl)
    modes = common.modes_from_arg(args.mode)
    n, shape = npus_and_mesh(args)
    names = common.mesh_axis_names(shape)
    if not 0 <= args.root < n:
        raise SystemExit(f"--root must be in 0..{n - 1}")
    if args.sizes:
        sizes = [common.parse_size(t) for t in args.sizes.split(",") if t.strip()]
    else:
        sizes = common.size_sweep(common.parse_size(args.minbytes), common.parse_size(args.maxbytes),
                                  args.stepfactor)
    iso = isolated(args)
    verbose = getattr(args, "verbose", False)
    params = {"ops": ops, "impls": impls, "modes": modes, "npus": n, "mesh": list(shape),
              "axis_names": list(names), "dtype": ",".join(dtypes), "dtypes": dtypes,
              "redop": ",".join(redops), "redops": redops, "root": args.root,
              "sizes": sizes, "iters": args.iters, "warmup": args.warmup_iters,
              "check": bool(args.check), "sync_every": args.sync_every,
              "max_seconds": args.max_seconds, "repeats": args.repeats, "isolated": iso,
              "verbose": verbose}
    report = Report("collectives", params,
                    env={} if iso else common.environment())
    variants = ([("lax", None)] if "lax" in impls else []) + \
               ([("strata", m) for m in modes] if "strata" in impls else [])
    if args.alloc == "both" and ("strata", "strata") in variants:
        variants.append(("strata", ARENA))  # strata mode, inputs from registered arenas
    # (dtype, op, redop) in nccl-tests' order: -d all / -o all run every combination
    configs = [(d, op, r) for d in dtypes for op in ops
               for r in (redops if SPECS[op].reduces else redops[:1])]
    total = len(configs) * (len(impls) if iso else len(sizes) * len(variants))
    bar = common.progress(range(total), desc="collectives", disable=args.no_progress)
    tick = _ticker(bar)
    measure = _op_rows_isolated if iso else _op_rows_inprocess
    mode_skips: dict[str, str] = {}  # mode -> why strata.config refused it (asked once)
    for dtype, op, redop in configs:
        a = argparse.Namespace(**vars(args))
        a.datatype, a.redop = dtype, redop
        op_rows = measure(op, a, dtype, n, shape, names, sizes, variants, tick, mode_skips)
        report.rows.extend(op_rows)
        if args.rows_jsonl:
            continue  # a child of an isolated run: the parent renders the tables
        modeled.collective_columns(op_rows, args.spec)
        _add_peer_fields(op_rows)
        if not any(r["status"] == "ok" for r in op_rows):
            report.emit(f"# {op} {dtype}{' ' + redop if SPECS[op].reduces else ''}: " + "; ".join(
                sorted({f"{r['status']}: {r['reason']}" for r in op_rows})))
            continue
        report.emit(common.fit_width(_compact_table(op_rows, variants, n, shape, dtype)))
        if verbose:
            _emit_detail_tables(report, op_rows, variants, impls, n, shape, dtype)
    if not args.rows_jsonl and any(r["status"] == "ok" for r in report.rows):
        report.emit(common.fit_width(_legend(params, verbose)))
    if hasattr(bar, "close"):
        bar.close()
    if iso and not report.env:
        report.env = common.environment()
        report.env["devices"] = f"{n} (in child processes)"
    return report


def _emit_detail_tables(report, op_rows, variants, impls, n, shape, dtype) -> None:
    """--verbose: the wide nccl-tests-style table of every variant (as before issue 30)."""
    strata_ok = any(r["impl"] == "strata" and r["status"] == "ok" for r in op_rows)
    for impl, mode in variants:
        if impl == "lax" and "strata" in impls and strata_ok:
            continue
        if impl == "strata" and not strata_ok and "lax" in impls:
            continue
        report.emit(_table(op_rows, impl, mode, "lax" in impls and impl == "strata", n,
                           shape, dtype))


def _ticker(bar):
    it = iter(bar)

    def tick(label: str) -> None:
        next(it, None)
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(label)

    return tick


def _op_rows_inprocess(op, args, dtype, n, shape, names, sizes, variants, tick, mode_skips):
    """Per size: compile and check every variant, then time them in interleaved rounds.

    The machine is shared and drifts by tens of percent over seconds, so comparing blocks timed
    minutes apart says more about the machine than about the op: each of --repeats rounds times
    one block of every variant, of the launch reference and of the memory reference, back to back,
    and every figure is the median over the rounds."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    spec, dt = SPECS[op], np_dtype(dtype)
    ax = names[0] if len(names) == 1 else names
    strata, strata_reason = common.load_strata()
    mesh = common.make_mesh(shape, names)
    sharding = NamedSharding(mesh, P(ax))
    rows = []
    for base in _base_rows(op, args, dtype, n, shape, sizes):
        count = base["count"]
        x = x_arena = xerr = exp = None
        if spec.reduces and dtype == "bool":
            xerr = common.Skip("bool does not reduce")
        elif spec.reduces and args.redop == "avg" and not dtype.startswith(("float", "bfloat")):
            xerr = common.Skip(f"avg of {dtype}: integers have no mean here (lax.pmean gives floats)")
        else:
            vals = make_values(spec, args.redop, dtype, n, count)
            inp = vals.astype(dt)
            exp = expected(spec, vals, inp, args.redop, args.root, dt) if args.check else None
            try:
                x, base["alloc"] = _device_put(inp.reshape(-1), sharding,
                                               "jax" if args.alloc == "both" else args.alloc, strata)
                if any(m == ARENA for _, m in variants):
                    x_arena, _ = _device_put(inp.reshape(-1), sharding, "strata", strata)
            except Exception as e:
                xerr = e
        size_rows, prepared = [], []
        for impl, mode in variants:
            tick(f"{op} {common.format_size(base['size'])} {impl}{'/' + mode if mode else ''}")
            row = dict(base, impl=impl, mode=mode)
            if mode == ARENA:
                row["alloc"] = "strata.memory"
            xin = x_arena if mode == ARENA else x
            if xerr is not None:
                row.update(common.failure(xerr))
            else:
                ready = _prepare(row, args, spec, xin, exp, mesh, ax, n, dtype, impl,
                                 "strata" if mode == ARENA else mode, strata, strata_reason,
                                 mode_skips)
                if ready is not None:
                    prepared.append((row, *ready, xin))
            size_rows.append(row)
        _time_rounds(base, size_rows, prepared, args, x, mesh, ax, n, strata)
        for row in size_rows:
            rows.append(row)
            if args.rows_jsonl:  # as soon as measured: a later abort must not lose it
                with open(args.rows_jsonl, "a") as f:
                    f.write(json.dumps(common.jsonable(row)) + "\n")
        del x, x_arena, prepared
    return rows


def _op_rows_isolated(op, args, dtype, n, shape, names, sizes, variants, tick, mode_skips):
    """One child process per implementation of this op; rows it never wrote become errors."""
    import os
    import tempfile

    rows = []
    for impl in dict.fromkeys(i for i, _ in variants):
        tick(f"{op} {impl} (child process)")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rows.jsonl")
            rc, err = common.run_child("collectives", [
                *args._argv, "--op", op, "--impl", impl, "-d", dtype, "-o", args.redop,
                "--isolate", "off", "--rows-jsonl", path],
                args.child_timeout)
            got = []
            if os.path.exists(path):
                with open(path) as f:
                    got = [json.loads(line) for line in f if line.strip()]
        have = {(r["size"], r["impl"], r["mode"]) for r in got}
        reason = common.child_failure(rc, err)
        for base in _base_rows(op, args, dtype, n, shape, sizes):
            for i, mode in variants:
                if i == impl and (base["size"], impl, mode) not in have:
                    got.append(dict(base, impl=impl, mode=mode, status="error", reason=reason))
        rows.extend(got)
    order = {v: k for k, v in enumerate(variants)}
    rows.sort(key=lambda r: (r["size"], order.get((r["impl"], r["mode"]), 0)))
    return rows


def _prepare(row, args, spec, x, exp, mesh, ax, n, dtype, impl, mode, strata, strata_reason,
             mode_skips):
    """Compile and run one variant once, count #wrong; returns (fn, ctx factory), or None with
    the row marked skipped/error and the reason."""
    import contextlib

    import jax
    from jax.sharding import PartitionSpec as P

    row.update(status="ok", reason=None)
    try:
        if impl == "strata":
            if strata is None:
                raise common.Skip(strata_reason)
            if mode in mode_skips:
                raise common.Skip(mode_skips[mode])
            try:
                common.strata_mode_context(strata, mode)
            except common.Skip as e:
                mode_skips[mode] = str(e)
                raise
            body = strata_body(strata, spec.name, ax, args.redop, args.root, n)

            def ctx():
                return common.strata_mode_context(strata, mode)
        else:
            ctx = contextlib.nullcontext
            body, row["lax_impl"] = lax_body(spec.name, ax, args.redop, args.root, n, dtype)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(ax), out_specs=P(ax)))
        with ctx():
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(x))
            row["first_call_s"] = time.perf_counter() - t0
    except Exception as e:
        row.update(common.failure(e))
        return None
    if exp is not None:
        got = np.asarray(out).reshape(n, -1)
        row["wrong"] = int(np.count_nonzero(got != exp)) if got.shape[1] == exp.shape[1] \
            else int(got.size)
    else:
        row["wrong"] = None
    return fn, ctx


def _launch_program(mesh, ax):
    """The launch reference: a shard_map program that does almost nothing (one element per
    rank), so its time is what XLA:CPU charges any program on this mesh."""
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.jit(jax.shard_map(lambda v: v[:1] + 1, mesh=mesh, in_specs=P(ax), out_specs=P(ax)))


@dataclass
class _Timed:
    """One prepared variant of a size and what its rounds measured."""
    row: dict
    fn: Callable
    ctx: Callable
    iters: int
    x: Any  # the variant's input (plain or arena)
    blocks: list = field(default_factory=list)  # per-call mean of each round's block (us)
    calls: int = 0  # calls timed or warmed up in the rounds
    stats: dict = field(default_factory=dict)  # strata's scalar counters over those calls
    all_blocks: list = field(default_factory=list)  # every timed block (us per call): the spread


def _time_rounds(base, size_rows, prepared, args, x, mesh, ax, n, strata) -> None:
    """--repeats rounds, each: one block of every prepared variant (two half blocks when -n >= 2,
    so even one round has a spread), the launch reference and the memory reference. Medians
    over rounds go into the rows, with the spread of every block (`spread_us`); the floor
    (common.write_floor_us) is measured once per byte count per run."""
    timed = [_Timed(row, fn, ctx, args.iters, xin) for row, fn, ctx, xin in prepared]
    launch = _launch_program(mesh, ax) if timed and x is not None else None
    if launch is not None:
        try:
            launch(x).block_until_ready()
        except Exception:
            launch = None
    halves = 2 if args.iters >= 2 else 1
    ref_samples, launch_samples, launch_blocks = [], [], []
    for _ in range(max(1, args.repeats)):
        ref_samples.append(common.floor_copy_us(base["ref_bytes"], ranks=n,
                                                out_bytes=base["out_bytes"],
                                                in_bytes=0 if base["one_source"] else base["size"]))
        if launch is not None:
            t, _ = common.time_calls(launch, (x,), iters=-(-args.iters // halves),
                                     warmup=args.warmup_iters, repeats=halves,
                                     first_call=False, max_seconds=args.max_seconds,
                                     sync_every=args.sync_every)
            launch_samples.append(float(np.mean(t.blocks_us)))
            launch_blocks.extend(t.blocks_us)
        for v in timed:
            if v.row["status"] != "ok":
                continue
            strata_row = v.row["impl"] == "strata"
            try:
                with v.ctx():
                    if strata_row:
                        common.reset_strata_stats(strata)
                    t, out = common.time_calls(v.fn, (v.x,), iters=-(-v.iters // halves),
                                               warmup=args.warmup_iters, repeats=halves,
                                               first_call=False,
                                               max_seconds=args.max_seconds,
                                               sync_every=args.sync_every)
                    del out
                    stats = common.strata_stats(strata) if strata_row else None
            except Exception as e:
                v.row.update(common.failure(e))
                continue
            v.iters = t.iters * halves  # --max-seconds settles it in the first round
            v.calls += t.warmup + t.iters * halves
            v.blocks.append(float(np.mean(t.blocks_us)))
            v.all_blocks.extend(t.blocks_us)
            for k, val in (stats or {}).items():  # scalar counters only (lists swamp the JSON)
                if isinstance(val, (int, float)):
                    v.stats[k] = v.stats.get(k, 0) + val
    ref_us = float(np.median(ref_samples))
    floor_us = common.write_floor_us(base["floor_bytes"])
    launch_us = float(np.median(launch_samples)) if launch_samples else None
    for row in size_rows:
        row["floor_us"], row["ref_us"], row["launch_us"] = floor_us, ref_us, launch_us
        row["launch_spread_us"] = style.spread(launch_blocks) if launch_blocks else None
    for v in timed:
        row = v.row
        if row["status"] != "ok" or not v.blocks:
            continue
        t = float(np.median(v.blocks))
        row.update(time_us=t, iters=v.iters, rounds_us=v.blocks, blocks_us=v.all_blocks,
                   spread_us=style.spread(v.all_blocks))
        row["algbw"] = row["s_bytes"] / (t * 1e-6) / 1e9
        row["busbw"] = row["algbw"] * row["bus_factor"]
        row["floor_share"] = floor_us / t  # <= 1 unless the bound's argument failed
        row["floor_beaten"] = floor_us > t
        row["ref_share"] = ref_us / t
        if launch_us is not None and not style.within_noise(
                t - launch_us, row["spread_us"] + (row["launch_spread_us"] or 0.0)):
            row["minus_launch_us"] = t - launch_us
        if v.stats and v.calls:
            row["stats_per_call"] = {k: val / v.calls for k, val in v.stats.items()}


def _add_peer_fields(rows) -> None:
    """Every ok strata row gets its lax peer's time and the speedup (JSON/CSV and tables):
    speedup = lax time / strata time; speedup_within_noise when the two times differ by no
    more than the sum of their spreads."""
    peers = {r["size"]: r for r in rows if r["impl"] == "lax" and r["status"] == "ok"}
    for r in rows:
        p = peers.get(r["size"])
        if r["impl"] != "strata" or r["status"] != "ok" or p is None:
            continue
        _, sp, within = common.fmt_speedup(p["time_us"], r["time_us"], p.get("spread_us", 0.0),
                                           r.get("spread_us", 0.0))
        r.update(lax_time_us=p["time_us"], lax_spread_us=p.get("spread_us"),
                 lax_busbw=p["busbw"], speedup=sp, speedup_within_noise=within)


def _pct_of_floor(r) -> str:
    if r.get("status") != "ok" or r.get("floor_share") is None:
        return "N/A"
    if r.get("floor_beaten"):
        return "beaten!"  # never a share above 100% of something called a floor
    return f"{100 * r['floor_share']:.1f}"


# The default table: one per (op, dtype, redop), strata vs lax, <= 120 columns.
COMPACT = [Col("size_label", "size", "", "", 5), Col("count", "count", "(elems)", "d", 8),
           Col("t_strata", "strata time", "(us)", "", 13), Col("busbw", "busbw", "(GB/s)", ".3g", 7),
           Col("t_lax", "lax time", "(us)", "", 13), Col("sp", "speedup", "(x lax)", "", 7),
           Col("wrong_all", "#wrong", "", "d", 6), Col("pct_floor", "of floor", "(%)", "", 8)]
COMPACT_BC = Col("t_bc", "buffer_centric", "(us)", "", 14)
COMPACT_ARENA = Col("t_arena", "arena inputs", "(us)", "", 13)
COMPACT_MODEL = Col("modeled_busbw", "model", "(GB/s)", ".3g", 7)


def _compact_table(rows, variants, n, shape, dtype) -> str:
    """size, count, strata time ±spread, busbw, lax time ±spread, speedup (≈1 within noise),
    #wrong over every variant, share of the floor; buffer_centric / arena-input times and the
    modeled busbw when those ran."""
    op = rows[0]["op"]
    by = {(r["size"], r["impl"], r["mode"]): r for r in rows}
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    has = {k: any(r["status"] == "ok" for r in rows if (r["impl"], r["mode"]) == k)
           for k in variants}
    cols = list(COMPACT)
    if has.get(("strata", "buffer_centric")):
        cols.append(COMPACT_BC)
    if has.get(("strata", ARENA)):
        cols.append(COMPACT_ARENA)
    if any(r.get("modeled_busbw") is not None for r in rows):
        cols.append(COMPACT_MODEL)
    main_mode = "strata" if ("strata", "strata") in variants else \
        next((m for i, m in variants if i == "strata"), None)
    out, notes = [], []
    for size in sizes:
        st = by.get((size, "strata", main_mode), {})
        lx = by.get((size, "lax", None), {})
        bc = by.get((size, "strata", "buffer_centric"), {})
        ar = by.get((size, "strata", ARENA), {})
        any_row = st or lx
        t = {"size_label": style.size_label(size), "count": any_row.get("count"),
             "busbw": st.get("busbw"), "modeled_busbw": st.get("modeled_busbw")}
        t["t_strata"] = common.fmt_time(st.get("time_us"), st.get("spread_us"))
        t["t_lax"] = common.fmt_time(lx.get("time_us"), lx.get("spread_us"))
        t["t_bc"] = common.fmt_time(bc.get("time_us"), bc.get("spread_us"))
        t["t_arena"] = common.fmt_time(ar.get("time_us"), ar.get("spread_us"))
        t["sp"] = common.fmt_speedup(lx.get("time_us"), st.get("time_us"),
                                     lx.get("spread_us", 0.0), st.get("spread_us", 0.0))[0]
        measured = [r for r in (st, lx, bc, ar) if r.get("status") == "ok"]
        wrong = [r.get("wrong") for r in measured if r.get("wrong") is not None]
        t["wrong_all"] = sum(wrong) if wrong else None
        t["pct_floor"] = _pct_of_floor(st)
        failed = [f"{_variant_name(r)} {r['status']}: {r['reason']}" for r in (st, lx, bc, ar)
                  if r and r.get("status") != "ok"]
        if failed:
            notes.extend(failed)
            t["_note"] = f"see note {len(notes) - len(failed) + 1}" + \
                (f"-{len(notes)}" if len(failed) > 1 else "")
        out.append(t)
    ok = [r for r in rows if r["status"] == "ok"]
    wrong_total = sum(r.get("wrong") or 0 for r in ok)
    lax_impls = sorted({r.get("lax_impl") for r in rows if r["impl"] == "lax" and r.get("lax_impl")})
    redop = rows[0].get("redop")
    title = (f"{op}  N={n}{' mesh=' + 'x'.join(map(str, shape)) if len(shape) > 1 else ''} {dtype}"
             f"{' ' + redop if redop not in (None, 'none') else ''}"
             f"{' root=' + str(rows[0]['root']) if op == 'broadcast' else ''}"
             f"  (strata{' vs lax ' + '/'.join(lax_impls) if lax_impls else ''})")
    footer = [f"#wrong (every variant): {wrong_total} {'OK' if not wrong_total else 'FAILED'}"
              + (f"; checked {len(ok)} rows" if ok else "")]
    avg_bw = []
    for impl, mode, name in (("strata", main_mode, "strata"), ("lax", None, "lax")):
        bws = [r["busbw"] for r in ok if r["impl"] == impl and r["mode"] == mode]
        if bws:
            avg_bw.append(f"{name} {sum(bws) / len(bws):.3g} GB/s")
    if avg_bw:
        footer.append("Avg bus bandwidth: " + ", ".join(avg_bw))
    sp = [r["speedup"] for r in rows if r.get("speedup") and r["mode"] == main_mode]
    if sp:
        noisy = sum(1 for r in rows if r.get("speedup") and r["mode"] == main_mode
                    and r.get("speedup_within_noise"))
        clear = [r["speedup"] for r in rows if r.get("speedup") and r["mode"] == main_mode
                 and not r.get("speedup_within_noise")]
        span = ""
        if clear:
            span = f"{min(clear):.2f}x" if len(clear) == 1 else \
                f"{min(clear):.2f}x to {max(clear):.2f}x"
        if not clear:
            footer.append(f"speedup vs lax: ≈1 at all {len(sp)} sizes (every difference within "
                          f"noise)")
        else:
            footer.append(f"speedup vs lax: geomean {math.exp(np.mean(np.log(sp))):.2f}x over "
                          f"{len(sp)} sizes"
                          + (f"; {noisy} within noise (≈1), the others {span}" if noisy
                             else f", {span}"))
    launches = [r.get("launch_us") for r in rows if r.get("launch_us")]
    if launches:
        footer.append(f"launch of an empty program on this mesh: {min(launches):.0f}-"
                      f"{max(launches):.0f} us (small sizes are mostly launch)")
    if any(r.get("floor_beaten") for r in ok):
        footer.append("beaten!: an op ran faster than its floor, so the floor's argument failed "
                      "here (please report it)")
    footer += [f"note {i}: {text}" for i, text in enumerate(notes, 1)]
    return common.render_table(cols, out, title=title, footer=footer)


def _variant_name(r) -> str:
    if r.get("impl") == "lax":
        return "lax"
    return {"strata": "strata", "buffer_centric": "buffer_centric", ARENA: "strata (arena inputs)"}.get(
        r.get("mode"), f"strata {r.get('mode')}")


def _legend(params, verbose: bool) -> str:
    """Printed once after the tables: what the columns mean."""
    r = params["repeats"]
    lines = [
        "How to read the tables above:",
        f"time: per call, median of {r} round{'s' if r > 1 else ''} of -n {params['iters']} calls; "
        "± = half the range of every timed block (noise). busbw as nccl-tests (bytes per rank x "
        "bus factor / time).",
        "speedup = lax time / strata time; ≈1 when the difference is within the two spreads "
        "(a ratio the noise made).",
        "of floor = floor / strata time. floor = a lower bound: the bytes every rank must write "
        "(its whole output) at this machine's fastest measured write (memset, warm memory, all "
        "cores, best of many tries); no correct implementation beats it, so it is <= 100%.",
        "buffer_centric / arena inputs: strata in buffer_centric mode / fed from strata.memory "
        "arenas; model = busbw of the same op modeled on the supernode (strata.emulator.model).",
    ]
    if not verbose:
        lines.append("--verbose: memory reference, launch and modeled times, one table per variant; "
                     "--json/--csv/--out keep every column.")
    else:
        lines.append("memory reference = np.copyto of the op's minimal bytes read + written, laid "
                     "out like the op into fresh memory: a reference, NOT a bound (strata beats it "
                     "where XLA's buffers are warmer than malloc's).")
    return "\n".join("# " + ln for ln in lines)


COLS = [Col("size", "size", "(B)", "d", 10), Col("count", "count", "(elements)", "d", 10),
        Col("dtype", "type", "", "", 8), Col("redop", "redop", "", "", 5),
        Col("root", "root", "", "d", 4),
        Col("t_cell", "time", "(us)", "", 13), Col("algbw", "algbw", "(GB/s)", ".3g", 8),
        Col("busbw", "busbw", "(GB/s)", ".3g", 8), Col("wrong", "#wrong", "", "d", 6)]
PEER_COLS = [Col("lax_cell", "lax time", "(us)", "", 13),
             Col("lax_busbw", "lax busbw", "(GB/s)", ".3g", 8),
             Col("sp_cell", "speedup", "(x)", "", 7)]
FLOOR_COLS = [Col("floor_us", "floor", "(us)", ".1f", 8),
              Col("floor_pct", "of floor", "(%)", "", 8),
              Col("ref_us", "mem ref", "(us)", ".1f", 8),
              Col("ref_pct", "of ref", "(%)", ".1f", 7),
              Col("launch_us", "launch", "(us)", ".1f", 7),
              Col("net_cell", "- launch", "(us)", "", 10)]


def _table(rows, impl, mode, with_peer, n, shape, dtype) -> str:
    """--verbose: one wide nccl-tests-style table of one variant."""
    mine = [r for r in rows if r["impl"] == impl and r["mode"] == mode]
    peers = {r["size"]: r for r in rows if r["impl"] == "lax"}
    out = []
    for r in mine:
        t = dict(r)
        if r["status"] != "ok":
            t["_note"] = f"{r['status']}: {r['reason']}"
        t["t_cell"] = common.fmt_time(r.get("time_us"), r.get("spread_us"))
        if r.get("root", -1) < 0:
            t["root"] = ""  # no root: not a negative number
        if with_peer:
            p = peers.get(r["size"], {})
            if p.get("status") == "ok":
                t["lax_cell"], t["lax_busbw"] = common.fmt_time(p["time_us"], p.get("spread_us")), p["busbw"]
                t["sp_cell"] = common.fmt_speedup(p["time_us"], r.get("time_us"), p.get("spread_us", 0.0),
                                                  r.get("spread_us", 0.0))[0]
        if r["status"] == "ok":
            t["floor_pct"] = _pct_of_floor(r)
            t["ref_pct"] = 100 * r["ref_share"]
            lu = r.get("launch_us")
            t["net_cell"] = (f"{r['minus_launch_us']:.1f}" if r.get("minus_launch_us") is not None
                             else ("< noise" if lu is not None else "N/A"))
        out.append(t)
    with_model = impl == "strata" and any(r.get("modeled_us") is not None for r in mine)
    cols = COLS + (PEER_COLS if with_peer else []) + FLOOR_COLS + (modeled.MODEL_COLS if with_model else [])
    groups = [("", 5), (impl if impl == "lax" else f"strata mode={mode}", 4)]
    groups += ([("lax peer", 3)] if with_peer else []) + [("floor, memory reference, launch", 6)]
    groups += [("modeled on the supernode", 3)] if with_model else []
    ok = [r for r in mine if r["status"] == "ok"]
    avg = sum(r["busbw"] for r in ok) / len(ok) if ok else float("nan")
    footer = [f"Out of bounds values : {sum(1 for r in ok if r.get('wrong'))} "
              f"{'OK' if all(not r.get('wrong') for r in ok) else 'FAILED'}",
              f"Avg bus bandwidth    : {avg:.4g} GB/s"]
    if with_model:
        footer.append("modeled: the same op, N and size timed by strata.emulator.model on the preset "
                      "(this row's mode); bc/strata = modeled buffer_centric time / strata time")
    if with_peer:
        lax_ok = [peers[r["size"]] for r in mine if peers.get(r["size"], {}).get("status") == "ok"]
        if lax_ok:
            footer.append(f"Avg lax bus bandwidth: "
                          f"{sum(p['busbw'] for p in lax_ok) / len(lax_ok):.4g} GB/s")
        for why in sorted({f"{p['status']}: {p['reason']}" for p in peers.values()
                           if p.get("status") != "ok"}):
            footer.append(f"lax peer {why}")
    footer.append("floor: bytes every rank must write at the machine's fastest write (a lower "
                  "bound); mem ref: np.copyto laid out like the op (a reference, not a bound); "
                  "- launch: time minus the empty program's launch, '< noise' when within the spreads")
    title = (f"{rows[0]['op']}  N={n} mesh={'x'.join(map(str, shape))} dtype={dtype}"
             f"  ({impl}{'' if mode is None else ' mode=' + mode})")
    return common.render_table(cols, out, title=title, groups=groups, footer=footer)


# ----------------------------------------------------------------------------------------------
# Plot


def _series_key(impl, mode) -> str:
    return "lax" if impl == "lax" else ("strata" if mode == "strata" else mode)


def plot(report: Report, path: str) -> None:
    """busbw vs size per op: lax, strata (each mode and input), and the floor as a busbw ceiling
    (no correct op can be above it). Colours and labels from style.SERIES; a size where a
    variant has no value (failed, skipped) is a hollow marker at the axis bottom."""
    if report.params.get("model_only"):
        return modeled.plot_collectives(report, path)
    plt = common.pyplot()
    if report.params.get("processes"):
        return  # the multi-process table has no plot
    p = report.params
    dtype0 = (p.get("dtypes") or [p["dtype"]])[0]
    redop0 = (p.get("redops") or [p.get("redop")])[0]
    rows = [r for r in report.rows if r.get("dtype") == dtype0
            and r.get("redop") in (redop0, "none")]
    ops = [o for o in p["ops"] if any(r["op"] == o and r["status"] == "ok" for r in rows)]
    if not ops:
        return
    cols = min(3, len(ops))
    nrow = -(-len(ops) // cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(5 * cols, 3.8 * nrow), squeeze=False)
    missing_any = False
    for a, op in zip(axes.flat, ops):
        rs = [r for r in rows if r["op"] == op]
        sizes = sorted({r["size"] for r in rs})
        order = ["lax"] + list(p["modes"]) + [ARENA]
        keys = sorted({(r["impl"], r["mode"]) for r in rs},
                      key=lambda kk: order.index(kk[1] if kk[0] == "strata" else "lax"))
        for impl, mode in keys:
            by = {r["size"]: r for r in rs if r["impl"] == impl and r["mode"] == mode}
            ys = [by[s_].get("busbw") if s_ in by and by[s_]["status"] == "ok" else None
                  for s_ in sizes]
            missing_any |= common.log_plot(a, sizes, ys, key=_series_key(impl, mode)) > 0
        fl = {}
        for r in rs:
            if r.get("floor_us"):
                fl[r["size"]] = r["s_bytes"] * r["bus_factor"] / r["floor_us"] / 1e3
        if fl:
            a.plot(list(fl), list(fl.values()), ls="--", color=style.SERIES["floor"][1],
                   label="floor (busbw no op can exceed)")
        a.set_yscale("log")
        style.size_axis(a, sizes)
        a.set_title(op)
        a.set_ylabel("busbw (GB/s)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    for a in list(axes.flat)[len(ops):]:
        a.axis("off")
    more = ""
    if len(p.get("dtypes") or []) > 1 or len(p.get("redops") or []) > 1:
        more = " (first of -d/-o only; every combination is in the JSON)"
    note = "; v at the bottom = no value (failed or skipped)" if missing_any else ""
    fig.suptitle(f"collectives, {p['npus']} emulated NPUs, {dtype0}"
                 f"{' ' + redop0 if redop0 else ''}{more}{note}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
