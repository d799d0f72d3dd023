"""strata.emulator.model(): what an op would take on the supernode.

The C++ model (xla_ffi/model/model.h) builds the plan the runtime would
execute for the op (collectives: the partitioned transfer plan; MoE: the
expert-row and token tasks from the routing) and times it on the preset's
links, HBM and lanes. No host execution: any size, up to the preset's NPUs.
"""
from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass, field

import numpy as np

from .. import _config
from .. import _core
from .spec import preset

# The extension's tables (xla_ffi/algorithms/op_registry.h, runtime/dtypes.h), not copies of them.
OPS = tuple(_core.op_names())  # the plan ops in OpKind order: a name's index is its code
OP_KIND = {name: i for i, name in enumerate(OPS)}
# Ops whose plan follows from a block size, and those planned from the sizes their ranks publish.
COLLECTIVES = tuple(op for op in OPS if not _core.op_planned_at_rendezvous(op))
MOE_OPS = ("moe_dispatch", "moe_combine", "moe_combine_backward")
RAGGED_OPS = tuple(op for op in OPS if op not in COLLECTIVES and op not in MOE_OPS)
DTYPE_CODE = _core.dtype_codes()
DTYPE_SIZE = _core.dtype_sizes()
_REDUCE_OPS = _core.reduce_ops()
REDUCE_CODE = {**{k: v for k, v in _REDUCE_OPS.items() if k != "none"}, "mean": _REDUCE_OPS["sum"]}
MODES = tuple(_core.mode_codes())
_PLANNER_CODE = _core.planner_codes()


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(size, what: str = "size") -> int:
    """A byte count as the benchmarks' CLI takes it: an int, or a string with an optional
    binary suffix ("4096", "4K", "1.5M", "4MiB", "1GB": K/M/G/T are powers of 1024, as in
    nccl-tests). A fraction of a byte is an error, not a silent rounding."""
    if isinstance(size, (bool, np.bool_)):
        raise TypeError(f"{what} must be a byte count (int or a string like '4M'), got {size!r}")
    if isinstance(size, (int, np.integer)):
        return int(size)
    if isinstance(size, str):
        m = _SIZE_RE.match(size)
        if not m:
            raise ValueError(f"{what} {size!r} is not a size: use a number with an optional K, M, G or T "
                             f"suffix (binary: 4K = 4096), e.g. '4M'")
        value = float(m.group(1)) * _SIZE_MULT[m.group(2).lower()]
        if value != int(value):
            raise ValueError(f"{what} {size!r} is not a whole number of bytes ({value:g})")
        return int(value)
    raise TypeError(f"{what} must be a byte count (int or a string like '4M'), got {type(size).__name__} {size!r}")


def format_bytes(nbytes: float) -> str:
    """4096 -> '4K', 1572864 -> '1.5M', 4000 -> '4000B': exact, in the largest binary unit
    that shows it with at most one decimal."""
    nbytes = int(nbytes)
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes * 10 % mult == 0:
            return f"{nbytes // mult}{unit}" if nbytes % mult == 0 else f"{nbytes / mult:.1f}{unit}"
    return f"{nbytes}B"


def round_bytes(op: str, bytes_per_rank, npus: int, dtype: str = "float32") -> int:
    """The size `model` times for `bytes_per_rank` (an int or "4M"): whole elements of `dtype`,
    and for reduce_scatter / all_to_all a whole element per rank; 0 when less than that.
    Sweeps call it to pick valid sizes without model's rounding warning."""
    item = DTYPE_SIZE[dtype]
    per_rank_blocks = op in COLLECTIVES and _core.op_block_counts(op, int(npus))[0] > 1
    unit = item * (int(npus) if per_rank_blocks else 1)
    nbytes = parse_bytes(bytes_per_rank, "bytes_per_rank")
    return max(0, nbytes - nbytes % unit)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw (doc/PERFORMANCE.md), from the op registry; 1 for other ops."""
    return _core.bus_factor(op, int(n)) if op in OP_KIND else 1.0


@dataclass
class ModeledOp:
    """One op as the supernode model times it."""

    op: str
    npus: int
    mode: str
    bytes_per_rank: int      # the benchmarks' `size (B)`; MoE: DeepEP's received bytes per rank
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    breakdown: dict          # where the time goes (us)
    lane_busy_us: dict       # the busiest rank's lanes: {"core": [...], "sdma": [...]}
    lower_bound_us: float    # alpha-beta bound of the op's UB traffic on the preset's ports
    fits_hbm: bool           # the op's buffers fit one rank's HBM
    spec: str = "cloudmatrix384"
    settings: dict = field(default_factory=dict)
    lane_busy_all_us: np.ndarray | None = field(default=None, repr=False)
    slices: np.ndarray | None = field(default=None, repr=False)  # rank, kind, lane, phase, start, end, bytes
    phase_kinds: list | None = field(default=None, repr=False)
    lanes: str = "core"      # the kind of lane that moved the data: "core" or "sdma" (the runtime's rule)
    # [rank, core lanes then SDMA lanes]: bytes each lane read + wrote in the exchange (what
    # strata.stats()' core_bytes / sdma_bytes count when the op runs), and [rank]: bytes staged
    # through comm buffers (stats' staged_bytes); plan ops only (MoE's executor differs).
    lane_bytes: np.ndarray | None = field(default=None, repr=False)
    staged_bytes: np.ndarray | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (f"ModeledOp({self.op}, {format_bytes(self.bytes_per_rank)} per rank on {self.npus} NPUs of "
                f"{self.spec}, mode={self.mode}: {self.time_us:.3g} us, busbw {self.busbw_gbps:.3g} GB/s)")

    def table(self) -> list[dict]:
        """Where the time goes, as rows {"part", "us"} (the nonzero parts of `breakdown`)."""
        return [{"part": k.removesuffix("_us"), "us": v} for k, v in self.breakdown.items() if v]

    def summary(self) -> str:
        """A few lines: the op, its bandwidths, the bound, where the time goes, the lanes."""
        lines = [repr(self),
                 f"  algbw {self.algbw_gbps:.4g} GB/s, busbw {self.busbw_gbps:.4g} GB/s; "
                 f"alpha-beta bound of its UB traffic {self.lower_bound_us:.3g} us; moved by {self.lanes} lanes; "
                 f"fits one NPU's HBM: {'yes' if self.fits_hbm else 'NO'}"]
        parts = self.table()
        if parts:
            lines.append("  " + ", ".join(f"{r['part']} {r['us']:.3g} us" for r in parts))
        busy = {k: max(v) for k, v in self.lane_busy_us.items() if v}
        if busy:
            lines.append("  busiest lane of the busiest rank: "
                         + ", ".join(f"{k} {v:.3g} us" for k, v in busy.items()))
        for k in ("capacity", "accepted_pairs", "dropped_pairs"):
            if k in self.settings:
                lines.append(f"  {k.replace('_', ' ')}: {self.settings[k]}")
        return "\n".join(lines)


def _settings(planner, cores_per_npu, sdma_engines_per_npu, comm_buffer_bytes) -> dict:
    s = _config.current()
    out = {"planner": s.planner if planner is None else planner,
           "cores_per_npu": s.cores_per_npu if cores_per_npu is None else cores_per_npu,
           "sdma_engines_per_npu": s.sdma_engines_per_npu if sdma_engines_per_npu is None else sdma_engines_per_npu,
           "comm_buffer_bytes": s.comm_buffer_bytes if comm_buffer_bytes is None else comm_buffer_bytes}
    if out["planner"] not in _PLANNER_CODE:
        raise ValueError(f"strata.emulator.model: planner must be one of {tuple(_PLANNER_CODE)}, got {out['planner']!r}")
    for name in ("cores_per_npu", "sdma_engines_per_npu", "comm_buffer_bytes"):
        v = out[name]
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"strata.emulator.model: {name} must be a positive int, got {v!r}")
    return out


def _result(op, n, mode, nbytes, s_bytes, bus_bytes, raw, spec, settings, footprint) -> ModeledOp:
    t = float(raw["time_us"])
    cores, engines = int(raw["cores"]), int(raw["engines"])
    busy = np.asarray(raw["lane_busy_us"])
    worst = int(np.argmax(busy.max(axis=1))) if busy.size else 0
    egress = np.asarray(raw["egress_bytes"], dtype=np.float64)
    ingress = np.asarray(raw["ingress_bytes"], dtype=np.float64)
    wire = 0.0
    if egress.size:
        wire = max(float(egress.max()) / (spec.ub_egress_gbps_per_rank * 1e3),
                   float(ingress.max()) / (spec.ub_ingress_gbps_per_rank * 1e3))
    lower = (float(raw["min_remote_latency_us"]) + wire) if wire > 0 else 0.0
    breakdown = {k: float(raw[k]) for k in (
        "sync_us", "exchange_us", "stage_us", "latency_us", "descriptor_us", "message_us", "busiest_lane_us",
        "busiest_hbm_us", "busiest_egress_us", "busiest_ingress_us", "busiest_path_us")}
    return ModeledOp(
        op=op, npus=n, mode=mode, bytes_per_rank=int(nbytes), time_us=t,
        algbw_gbps=s_bytes / (t * 1e3) if t > 0 else 0.0,  # nothing to move: 0, as nccl-tests
        busbw_gbps=bus_bytes / (t * 1e3) if t > 0 else 0.0,
        breakdown=breakdown,
        lane_busy_us={"core": busy[worst, :cores].tolist() if busy.size else [],
                      "sdma": busy[worst, cores:].tolist() if busy.size else []},
        lower_bound_us=lower, fits_hbm=footprint <= spec.hbm_bytes_per_rank, spec=spec.name,
        settings=settings, lane_busy_all_us=busy, slices=np.asarray(raw["slices"]),
        phase_kinds=list(raw["phase_kinds"]), lanes="sdma" if raw["on_sdma"] else "core",
        lane_bytes=np.asarray(raw["lane_bytes"]), staged_bytes=np.asarray(raw["staged_bytes"]))


def model(op: str, bytes_per_rank: int | None = None, *, npus: int = 8, mode: str = "strata",
          spec="cloudmatrix384", dtype: str = "float32", planner: str | None = None,
          cores_per_npu: int | None = None, sdma_engines_per_npu: int | None = None,
          comm_buffer_bytes: int | None = None, keep_slices: bool = False, rank_npu=None,
          **op_args) -> ModeledOp:
    """Times `op` on the supernode `spec` from the plan the runtime would run.

    Collectives (`all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all`,
    `broadcast`, `ppermute`): `bytes_per_rank` is the input per rank (the
    `size (B)` column of `python -m benchmarks collectives`), an int or a
    size like "4M" (binary units, as the CLI's -b/-e); a size that is not a
    whole number of elements (of blocks, for reduce_scatter and all_to_all)
    is rounded down with a warning, one that rounds to zero is an error;
    op_args: `redop=`
    (sum, max, min, prod), `root=`, `perm=` (pairs; default a ring), `rows=`.
    `ragged_all_to_all`: op_args `send_rows=` ([npus, npus]: rows rank s sends
    rank d; each rank's slices packed in rank order on both sides) and
    `hidden=` (elements per row); or, for any layout (a trace's), every
    rank's `send_sizes=`, `input_offsets=`, `output_offsets=` ([npus, npus *
    slices_per_peer], lax.ragged_all_to_all's vectors; receivers' recv_sizes
    follow from them) with `hidden=`; `operand_rows=` / `output_rows=` default
    to the fewest rows that hold the slices. The plan is the runtime's
    (BuildRaggedPlan), run as its PlanJob runs it; `bytes_per_rank` reports
    the mean bytes a rank sends, busbw the bytes that leave their rank.
    MoE (`moe_dispatch`, `moe_combine`, `moe_combine_backward`): op_args
    `tokens=`, `hidden=`, `top_k=`, `num_experts=`, optionally `topk_idx=`
    ([npus, tokens, top_k]; default uniform at random, distinct experts per
    token), `capacity=` (default: no drops), `seed=`.
    The `strata.config` settings to assume default to those in force.
    """
    sp = preset(spec)
    if mode not in MODES:
        raise ValueError(f"strata.emulator.model: mode must be one of {MODES}, got {mode!r}")
    if dtype not in DTYPE_CODE:
        raise ValueError(f"strata.emulator.model: dtype must be one of {tuple(DTYPE_CODE)}, got {dtype!r}")
    if not isinstance(npus, (int, np.integer)) or npus < 1 or npus > sp.num_ranks:
        raise ValueError(f"strata.emulator.model: npus must be in 1..{sp.num_ranks} (preset {sp.name!r}), got {npus!r}")
    settings = _settings(planner, cores_per_npu, sdma_engines_per_npu, comm_buffer_bytes)
    if rank_npu is not None:
        rank_npu = [int(v) for v in rank_npu]
        if len(rank_npu) != npus or len(set(rank_npu)) != npus or min(rank_npu) < 0 or max(rank_npu) >= sp.num_ranks:
            raise ValueError(f"strata.emulator.model: rank_npu must place the {npus} ranks on distinct NPUs of the preset")
    if op in COLLECTIVES:
        return _model_collective(op, bytes_per_rank, int(npus), mode, sp, dtype, settings, keep_slices,
                                 rank_npu or [], **op_args)
    if op in RAGGED_OPS:
        if bytes_per_rank is not None:
            raise TypeError(f"strata.emulator.model({op!r}): give send_rows= (or send_sizes=, ...) and "
                            f"hidden=, not bytes_per_rank")
        return _model_ragged(op, int(npus), mode, sp, dtype, settings, keep_slices, rank_npu or [], **op_args)
    if op in MOE_OPS:
        if bytes_per_rank is not None:
            raise TypeError(f"strata.emulator.model({op!r}): give tokens=, hidden=, top_k=, num_experts=, not bytes_per_rank")
        return _model_moe(op, int(npus), mode, sp, dtype, settings, keep_slices, rank_npu or [], **op_args)
    raise ValueError(f"strata.emulator.model: unknown op {op!r}; known: {COLLECTIVES + RAGGED_OPS + MOE_OPS}")


def _model_collective(op, bytes_per_rank, n, mode, sp, dtype, settings, keep_slices, rank_npu, *,
                      redop: str = "sum", root: int = 0, perm=None, rows: int = 1, **extra):
    if extra:
        raise TypeError(f"strata.emulator.model({op!r}): unknown arguments {sorted(extra)}")
    name = f"strata.emulator.model({op!r})"
    if bytes_per_rank is None:
        raise TypeError(f"{name}: give bytes_per_rank (an int or a size like '4M')")
    asked = parse_bytes(bytes_per_rank, f"{name}: bytes_per_rank")
    if asked < 0:
        raise ValueError(f"{name}: bytes_per_rank must be >= 0, got {bytes_per_rank!r}")
    itemsize = DTYPE_SIZE[dtype]
    reduces = op in ("all_reduce", "reduce_scatter")
    if reduces:
        if redop not in REDUCE_CODE:
            raise ValueError(f"strata.emulator.model({op!r}): op must be one of {tuple(REDUCE_CODE)}, got {redop!r}")
        if dtype == "bool":
            raise TypeError(f"strata.emulator.model({op!r}): bool cannot be reduced")
    if op == "broadcast" and not 0 <= root < n:
        raise ValueError(f"strata.emulator.model('broadcast'): root {root} is outside 0..{n - 1}")
    split = op in ("reduce_scatter", "all_to_all")  # the input splits into n equal blocks
    count = round_bytes(op, asked, n, dtype) // itemsize
    if asked and not count:
        unit = f"{n} elements of {dtype} ({n * itemsize} B), one per rank" if split else f"one {dtype} element ({itemsize} B)"
        raise ValueError(f"{name}: bytes_per_rank={bytes_per_rank!r} rounds to zero: the op moves at least {unit}")
    block = count // n * itemsize if split else count * itemsize
    nbytes = count * itemsize
    if nbytes != asked:
        why = f"a multiple of {n} {dtype} elements (one block per rank)" if split else f"whole {dtype} elements"
        warnings.warn(f"{name}: bytes_per_rank={bytes_per_rank!r} rounded down to {nbytes} B ({format_bytes(nbytes)}), "
                      f"{why}", stacklevel=3)
    flat_perm: list[int] = []
    if op == "ppermute":
        pairs = [(i, (i + 1) % n) for i in range(n)] if perm is None else [tuple(map(int, p)) for p in perm]
        for s, d in pairs:
            if not (0 <= s < n and 0 <= d < n):
                raise ValueError(f"strata.emulator.model('ppermute'): pair {(s, d)} is outside 0..{n - 1}")
        if len({s for s, _ in pairs}) != len(pairs) or len({d for _, d in pairs}) != len(pairs):
            raise ValueError("strata.emulator.model('ppermute'): sources and destinations must not repeat")
        flat_perm = [v for p in pairs for v in p]
    raw = _core.model_collective(
        OP_KIND[op], DTYPE_CODE[dtype], REDUCE_CODE[redop] if reduces else 4, int(root), flat_perm, n,
        int(block), int(rows), MODES.index(mode), int(settings["cores_per_npu"]),
        int(settings["sdma_engines_per_npu"]), _PLANNER_CODE[settings["planner"]],
        int(settings["comm_buffer_bytes"]), sp.machine(), rank_npu, bool(keep_slices))
    s_bytes = n * nbytes if op == "all_gather" else nbytes
    out_bytes = n * nbytes if op == "all_gather" else (nbytes // n if op == "reduce_scatter" else nbytes)
    footprint = (nbytes + out_bytes) * rows
    return _result(op, n, mode, nbytes, s_bytes * rows, s_bytes * rows * bus_factor(op, n), raw, sp,
                   settings, footprint)


def _row_vectors(name: str, what: str, value, shape) -> np.ndarray:
    """`value` as an int64 [npus, entries] matrix of whole numbers >= 0, or a ValueError naming it."""
    a = np.asarray(value)
    if a.shape != shape:
        raise ValueError(f"{name}: {what} must be {list(shape)} (npus x npus * slices_per_peer), got shape {list(a.shape)}")
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"{name}: {what} must hold integers (rows), got dtype {a.dtype}")
    a = a.astype(np.int64)
    if a.size and a.min() < 0:
        raise ValueError(f"{name}: {what} must be >= 0, got {int(a.min())}")
    return np.ascontiguousarray(a)


def packed_ragged_layout(send_sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(input_offsets, output_offsets) of every rank's `send_sizes` ([n, n * k]) packed: a
    sender's slices back to back in entry order, a receiver's in (sender, slice) order."""
    send_sizes = np.asarray(send_sizes, np.int64)
    n, entries = send_sizes.shape
    k = entries // n
    input_offsets = np.cumsum(send_sizes, axis=1) - send_sizes
    # recv[d, s * k + j] = send_sizes[s, d * k + j]: what d receives, in its order.
    recv = send_sizes.reshape(n, n, k).transpose(1, 0, 2).reshape(n, entries)
    recv_offsets = np.cumsum(recv, axis=1) - recv
    output_offsets = recv_offsets.reshape(n, n, k).transpose(1, 0, 2).reshape(n, entries)
    return input_offsets, np.ascontiguousarray(output_offsets)


def _model_ragged(op, n, mode, sp, dtype, settings, keep_slices, rank_npu, *, hidden: int, send_rows=None,
                  send_sizes=None, input_offsets=None, output_offsets=None, operand_rows: int | None = None,
                  output_rows: int | None = None, **extra):
    name = f"strata.emulator.model({op!r})"
    if extra:
        raise TypeError(f"{name}: unknown arguments {sorted(extra)}")
    if not isinstance(hidden, (int, np.integer)) or isinstance(hidden, bool) or hidden < 1:
        raise ValueError(f"{name}: hidden (elements per row) must be a positive int, got {hidden!r}")
    if (send_rows is None) == (send_sizes is None):
        raise TypeError(f"{name}: give send_rows= ([npus, npus]) or send_sizes= ([npus, npus * slices_per_peer]), "
                        f"one of them")
    if send_rows is not None:
        if input_offsets is not None or output_offsets is not None:
            raise TypeError(f"{name}: send_rows= packs the slices; give send_sizes= to place them with offsets")
        sizes = _row_vectors(name, "send_rows", send_rows, (n, n))
    else:
        entries = np.shape(send_sizes)[1] if np.ndim(send_sizes) == 2 else 0
        if entries == 0 or entries % n:
            raise ValueError(f"{name}: send_sizes must be [npus, npus * slices_per_peer], got shape "
                             f"{list(np.shape(send_sizes))}")
        sizes = _row_vectors(name, "send_sizes", send_sizes, (n, entries))
    packed_in, packed_out = packed_ragged_layout(sizes)
    in_off = packed_in if input_offsets is None else _row_vectors(name, "input_offsets", input_offsets, sizes.shape)
    out_off = packed_out if output_offsets is None else _row_vectors(name, "output_offsets", output_offsets, sizes.shape)
    k = sizes.shape[1] // n
    # The fewest rows that hold every nonempty slice (output offsets are in the receiver's buffer).
    if operand_rows is None:
        operand_rows = int(np.where(sizes > 0, in_off + sizes, 0).max(initial=0))
    if output_rows is None:
        output_rows = int(np.where(sizes > 0, out_off + sizes, 0).max(initial=0))
    for k_, v in (("operand_rows", operand_rows), ("output_rows", output_rows)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name}: {k_} must be an int >= 0, got {v!r}")
    row_bytes = int(hidden) * DTYPE_SIZE[dtype]
    # Out-of-range slices are refused by the runtime's own checks (BuildRaggedPlan), naming the rank.
    raw = _core.model_ragged(
        DTYPE_CODE[dtype], n, int(operand_rows), int(output_rows), row_bytes, in_off, sizes, out_off,
        MODES.index(mode), int(settings["cores_per_npu"]), int(settings["sdma_engines_per_npu"]),
        _PLANNER_CODE[settings["planner"]], int(settings["comm_buffer_bytes"]), sp.machine(), rank_npu,
        bool(keep_slices))
    sent = int(sizes.sum()) * row_bytes
    to_self = sum(int(sizes[r, r * k:(r + 1) * k].sum()) for r in range(n)) * row_bytes
    footprint = (int(operand_rows) + int(output_rows)) * row_bytes
    settings = {**settings, "operand_rows": int(operand_rows), "output_rows": int(output_rows),
                "slices_per_peer": k}
    return _result(op, n, mode, sent // n, sent / n, (sent - to_self) / n, raw, sp, settings, footprint)


@functools.lru_cache(maxsize=16)
def _uniform_routing(n: int, tokens: int, top_k: int, num_experts: int, seed: int) -> np.ndarray:
    """[n, tokens, top_k] distinct experts per token, uniform at random."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, tokens, top_k), np.int32)
    for r in range(n):
        out[r] = np.argpartition(rng.random((tokens, num_experts)), top_k - 1, axis=1)[:, :top_k]
    out.setflags(write=False)
    return out


def moe_routing_stats(pair_slot: np.ndarray, slots_per_rank: int, top_k: int) -> tuple[int, int]:
    """(accepted pairs, DeepEP's (token, destination rank) pairs) over all ranks."""
    pair_slot = np.asarray(pair_slot).reshape(-1, top_k)
    owners = np.where(pair_slot >= 0, pair_slot // slots_per_rank, -1)
    accepted = int(np.count_nonzero(pair_slot >= 0))
    s = np.sort(owners, axis=-1)
    distinct = (s[..., 1:] != s[..., :-1]) & (s[..., 1:] >= 0)
    unique = int(np.count_nonzero(s[..., :1] >= 0) + np.count_nonzero(distinct))
    return accepted, unique


def _model_moe(op, n, mode, sp, dtype, settings, keep_slices, rank_npu, *, tokens: int, hidden: int,
               top_k: int, num_experts: int, topk_idx=None, capacity: int | None = None, seed: int = 0,
               pair_slot=None):
    name = f"strata.emulator.model({op!r})"
    for k, v in (("tokens", tokens), ("hidden", hidden), ("top_k", top_k), ("num_experts", num_experts)):
        if not isinstance(v, (int, np.integer)) or v < (0 if k == "tokens" else 1):
            raise ValueError(f"{name}: {k} must be a positive int, got {v!r}")
    if num_experts % n:
        raise ValueError(f"{name}: num_experts={num_experts} must be a multiple of npus={n}")
    if top_k > num_experts:
        raise ValueError(f"{name}: top_k={top_k} exceeds num_experts={num_experts}")
    if dtype not in ("float32", "float64", "float16", "bfloat16"):
        raise TypeError(f"{name}: rows must be a float dtype, got {dtype}")
    if pair_slot is None:
        if topk_idx is None:
            idx = _uniform_routing(n, int(tokens), int(top_k), int(num_experts), int(seed))
        else:
            idx = np.asarray(topk_idx, dtype=np.int32)
            if idx.shape != (n, tokens, top_k):
                raise ValueError(f"{name}: topk_idx must be [npus, tokens, top_k] = {(n, tokens, top_k)}, got {idx.shape}")
            if idx.size and (idx.min() < 0 or idx.max() >= num_experts):
                raise ValueError(f"{name}: expert ids must be in [0, {num_experts})")
        flat = np.ascontiguousarray(idx.reshape(n, tokens * top_k))
        if capacity is None:
            capacity = max(1, int(np.bincount(flat.ravel(), minlength=num_experts).max())) if flat.size else 1
        pair_slot = _core.moe_pair_slots(n, int(num_experts), int(capacity), flat)
    else:
        pair_slot = np.ascontiguousarray(np.asarray(pair_slot, dtype=np.int32).reshape(n, tokens * top_k))
        if capacity is None:
            raise ValueError(f"{name}: pair_slot needs capacity=")
    if capacity < 1:
        raise ValueError(f"{name}: capacity must be positive, got {capacity}")
    row_bytes = int(hidden) * DTYPE_SIZE[dtype]
    weight_bytes = 8 if dtype == "float64" else 4
    el = num_experts // n
    raw = _core.model_moe(
        MOE_OPS.index(op), n, int(num_experts), int(tokens), int(top_k), int(capacity), row_bytes,
        weight_bytes, int(settings["cores_per_npu"]), int(settings["sdma_engines_per_npu"]),
        mode == "buffer_centric", int(settings["comm_buffer_bytes"]), pair_slot, sp.machine(), rank_npu,
        bool(keep_slices), DTYPE_CODE[dtype], _PLANNER_CODE[settings["planner"]])
    accepted, unique = moe_routing_stats(pair_slot, el * int(capacity), int(top_k))
    # DeepEP: bytes of tokens received, a token counted once per destination rank.
    deepep_per_rank = unique * row_bytes / n
    footprint = tokens * row_bytes + el * capacity * row_bytes
    settings = {**settings, "capacity": int(capacity), "accepted_pairs": accepted, "dropped_pairs": n * tokens * top_k - accepted}
    return _result(op, n, mode, int(deepep_per_rank), accepted * row_bytes / n, deepep_per_rank, raw, sp,
                   settings, footprint)
