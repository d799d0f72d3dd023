"""strata.emulator.trace(): record the strata ops of real runs and write a
Chrome/Perfetto trace with two views.

    with strata.emulator.trace("step.json") as tr:
        jax.block_until_ready(step(x))
    tr.ops      # op, group_size, bytes_per_rank, mode, host_us, modeled_us, ...

Host view (process "host"): a track per emulated NPU (JAX device); each op
is a slice from the rank's arrival to the op's end on it, with a nested
"wait for peers" slice up to the last rank's arrival. Modeled view: a process per NPU of the preset with a track
per vector core and SDMA engine; the ops are laid end to end per rank in the
order the host started them, each timed by the supernode model in the mode
it ran with (per lane, one slice per phase: first piece to last).
"""
from __future__ import annotations

import json
import math
import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from .. import _core
from .. import _multiprocess
from .op_model import DTYPE_CODE, DTYPE_SIZE, MODES, OPS, format_bytes, model
from .spec import preset
from .step import simulate

_DTYPE_NAME = {v: k for k, v in DTYPE_CODE.items()}
_REDUCE_NAME = {v: k for k, v in _core.reduce_ops().items()}
_MOE_NAME = {1: "moe_dispatch", 2: "moe_combine", 3: "moe_combine_backward"}
_RAGGED_KIND = 4  # runtime/observer.h ObservedOp::kRaggedAllToAll
_PHASE_NAME = {0: "exchange", 1: "stage in", 2: "stage out"}
_active_lock = threading.Lock()
_active: list["Trace"] = []

_exit_hook_registered = False


def _register_exit_hook() -> None:
    """A trace left recording (trace() without `with` or stop()) is not lost silently: at exit
    it is stopped and written, with a warning saying how to do it explicitly."""
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    import atexit

    def stop_forgotten():
        with _active_lock:
            left = list(_active)
        for tr in left:
            import warnings

            warnings.warn(f"strata.emulator.trace({tr.path!r}) was still recording at exit: stopping it"
                          + (" and writing it" if tr.path else "") + "; use `with` or call tr.stop()",
                          RuntimeWarning, stacklevel=1)
            try:
                tr.stop()
            except Exception as e:  # the runtime may already be gone; say so, do not crash exit
                warnings.warn(f"strata.emulator.trace({tr.path!r}): could not stop it at exit: {e}",
                              RuntimeWarning, stacklevel=1)

    atexit.register(stop_forgotten)
    _exit_hook_registered = True


def _process() -> int:
    return jax_process_index() if _multiprocess.process_count() > 1 else 0


def jax_process_index() -> int:
    import jax

    return jax.process_index()


def npu_of(local_device: int) -> int:
    """The emulated NPU a local device is: with several processes, process p's
    device d is NPU p * (devices per process) + d (make_mesh's process-major
    order), so ranks are named by process and placed on the preset alike."""
    if _multiprocess.process_count() <= 1:
        return int(local_device)
    import jax

    return jax.process_index() * jax.local_device_count() + int(local_device)


def npu_name(npu: int) -> str:
    if _multiprocess.process_count() <= 1:
        return f"NPU {npu}"
    import jax

    per = jax.local_device_count()
    return f"NPU {npu} (process {npu // per}, device {npu % per})"


# Trace process ids: the host view, then one per modeled NPU.
HOST_PID = 1
MODEL_PID_BASE = 1000
STEP_PID_BASE = 3000  # modeled whole steps (Trace.simulate), after the 384 + ops views


@dataclass
class OpRecord:
    """One execution of one strata op by one group, as recorded."""

    op: str
    group_size: int
    bytes_per_rank: int
    mode: str
    dtype: str
    host_us: float                    # first arrival to last end, on this host
    modeled_us: dict                  # mode -> modeled time on the preset
    devices: list                     # rank -> emulated NPU: process_index * local devices + local device
    arrive_us: list                   # per rank, relative to the trace start
    end_us: list
    last_to_arrive: int               # rank
    site_id: int = 0
    group_id: int = 0
    ok: bool = True
    modeled_busbw_gbps: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict, repr=False)
    process: int = 0                  # the process that ran (and recorded) it

    @property
    def wait_us(self) -> float:
        """How long the first rank in waited for the last one."""
        return max(self.arrive_us) - min(self.arrive_us)

    def __repr__(self) -> str:
        modeled = self.modeled_us.get(self.mode)
        m = f"modeled {modeled:.3g} us" if modeled is not None and modeled == modeled else "not modeled"
        return (f"OpRecord({self.op}, {self.group_size} ranks, {format_bytes(self.bytes_per_rank)} per rank "
                f"{self.dtype}, mode={self.mode}: host {self.host_us:.1f} us (first rank waited "
                f"{self.wait_us:.1f} us for rank {self.last_to_arrive}), {m}{'' if self.ok else ', FAILED'})")


def trace(path: str | None = None, spec="cloudmatrix384") -> "Trace":
    """Records every strata op run from now on; ``with strata.emulator.trace(path) as tr:``
    stops at the end of the block and writes `path`. Without ``with``, call ``tr.stop()``
    (which writes `path`); a trace still recording when the interpreter exits is stopped and
    written then, with a warning."""
    tr = Trace(path, spec)
    tr.start()
    return tr


class Trace:
    def __init__(self, path: str | None = None, spec="cloudmatrix384"):
        self.path = path
        self.spec = preset(spec)
        self.ops: list[OpRecord] = []
        self.dropped = 0
        self._t0 = 0.0
        self._model_cache: dict = {}
        self.steps: list = []  # ModeledSteps added by simulate(), drawn beside the ops
        # The modeled view's time scale in the saved trace: None picks a power of ten that
        # gives it about the host view's span; 1 keeps modeled time as is.
        self.modeled_time_scale: float | None = None
        self.last_modeled_scale = 1.0

    def simulate(self, fn, *args, mode: str = "strata", **settings):
        """The step model of `fn(*args)` (strata.emulator.simulate on this
        trace's preset), kept so the saved trace shows compute and
        communication of the whole step on the modeled timeline too."""
        step = simulate(fn, *args, spec=self.spec, mode=mode, **settings)
        self.steps.append(step)
        return step

    @property
    def recording(self) -> bool:
        with _active_lock:
            return self in _active

    def start(self) -> "Trace":
        """Starts recording (trace() calls it; `with` calls it unless already started)."""
        with _active_lock:
            if self in _active:
                return self
            if _active:
                raise RuntimeError("strata.emulator.trace: a trace is already recording (they do not nest); "
                                   "stop it first (tr.stop(), or end its `with` block)")
            _active.append(self)
        _register_exit_hook()
        _core.trace_take()  # drop records of ops that ended before this trace
        self._t0 = _core.trace_now_us()
        _core.trace_enable(True)
        return self

    def stop(self, save: bool = True) -> "Trace":
        """Stops recording, collects the records and (if a path was given and `save`) writes
        the trace. Stopping a trace that is not recording does nothing."""
        import jax

        with _active_lock:
            if self not in _active:
                return self
        try:
            jax.effects_barrier()
        finally:
            _core.trace_enable(False)
            with _active_lock:
                _active.remove(self)
        self._collect()
        if self.path and save:
            self.save(self.path)
        return self

    def __enter__(self) -> "Trace":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(save=exc[0] is None)

    def __repr__(self) -> str:
        state = "recording" if self.recording else f"{len(self.ops)} ops"
        return f"Trace({self.path or 'not saved'}, {state}, modeled on {self.spec.name})"

    # ---------------------------------------------------------------- records
    def _collect(self) -> None:
        recs = _core.trace_take()
        groups = defaultdict(list)
        for r in recs:
            groups[(r["kind"], r["run_id"], r["site_id"], r["group_id"])].append(r)
        for key, rs in groups.items():
            by_rank = defaultdict(list)
            for r in rs:
                by_rank[r["rank"]].append(r)
            for lst in by_rank.values():
                lst.sort(key=lambda r: r["arrive_us"])
            size = rs[0]["group_size"]
            instances = max(len(v) for v in by_rank.values())
            for i in range(instances):
                members = [by_rank[rank][i] for rank in range(size) if len(by_rank[rank]) > i]
                if len(members) != size:
                    continue  # a rank never arrived: the op failed (timeout), nothing to model
                self.ops.append(self._record(members))
        self.ops.sort(key=lambda o: min(o.arrive_us))

    def _record(self, members: list) -> OpRecord:
        first = members[0]
        members = sorted(members, key=lambda r: r["rank"])
        devices = [npu_of(r["device"]) for r in members]
        arrive = [r["arrive_us"] - self._t0 for r in members]
        end = [r["end_us"] - self._t0 for r in members]
        mode = MODES[first["mode"]]
        if first["kind"] == 0:
            op = OPS[first["op_kind"]]
            n, dtype = first["group_size"], _DTYPE_NAME[first["dtype"]]
            bpr = first["block_bytes"] * first["in_blocks"] * first["rows"]
            params = {"kind": "collective", "op": op, "n": n, "dtype": dtype,
                      "redop": _REDUCE_NAME[first["reduce_op"]], "root": first["root"],
                      "perm": list(first["perm"]), "block_bytes": first["block_bytes"],
                      "rows": first["rows"], "cores": first["cores"], "engines": first["engines"],
                      "planner": "naive" if first["planner"] else "balanced",
                      "comm_buffer_bytes": first["comm_buffer_bytes"]}
        elif first["kind"] == _RAGGED_KIND:
            # Every rank's sizes as it published them: the model builds the same plan from them.
            op = OPS[first["op_kind"]]
            n, dtype = first["group_size"], _DTYPE_NAME[first["dtype"]]
            vectors = {v: np.stack([np.asarray(r[v], np.int64) for r in members])
                       for v in ("input_offsets", "send_sizes", "output_offsets")}
            bpr = int(vectors["send_sizes"].sum()) * first["block_bytes"] // n
            params = {"kind": "ragged", "op": op, "n": n, "dtype": dtype,
                      "operand_rows": first["in_blocks"], "output_rows": first["out_blocks"],
                      "row_bytes": first["block_bytes"], **vectors, "cores": first["cores"],
                      "engines": first["engines"], "planner": "naive" if first["planner"] else "balanced",
                      "comm_buffer_bytes": first["comm_buffer_bytes"]}
        else:
            op = _MOE_NAME[first["kind"]]
            n, dtype = first["group_size"], _DTYPE_NAME[first["dtype"]]
            routing = np.stack([np.asarray(r["routing"], np.int32) for r in members])
            bpr = first["tokens"] * first["row_bytes"]
            params = {"kind": "moe", "op": op, "n": n, "dtype": dtype, "tokens": first["tokens"],
                      "hidden": first["hidden"], "top_k": first["topk"],
                      "num_experts": first["num_experts"], "capacity": first["capacity"],
                      "cores": first["cores"], "engines": first["engines"],
                      "planner": "naive" if first["planner"] else "balanced",
                      "comm_buffer_bytes": first["comm_buffer_bytes"], "routing": routing}
        rec = OpRecord(op=op, group_size=n, bytes_per_rank=int(bpr), mode=mode, dtype=dtype,
                       host_us=max(end) - min(arrive), modeled_us={}, devices=devices,
                       arrive_us=arrive, end_us=end, last_to_arrive=int(np.argmax(arrive)),
                       site_id=first["site_id"], group_id=first["group_id"],
                       ok=all(r["ok"] for r in members), params=params, process=_process())
        for m in MODES:
            try:
                res = self._model(rec, m)
            except Exception as e:  # e.g. buffer_centric cannot hold the op: say why
                rec.modeled_us[m] = float("nan")
                rec.params.setdefault("model_errors", {})[m] = str(e)
                continue
            rec.modeled_us[m] = res.time_us
            rec.modeled_busbw_gbps[m] = res.busbw_gbps
        return rec

    def _model(self, rec: OpRecord, mode: str, keep_slices: bool = False):
        p = rec.params
        placement = self._placement(rec.devices)
        common = dict(npus=p["n"], mode=mode, spec=self.spec, dtype=p["dtype"],
                      cores_per_npu=p["cores"], sdma_engines_per_npu=p["engines"],
                      comm_buffer_bytes=p["comm_buffer_bytes"], keep_slices=keep_slices,
                      rank_npu=placement)
        if p["kind"] == "collective":
            key = (mode, keep_slices, p["op"], p["n"], p["dtype"], p["redop"], p["root"], tuple(p["perm"]),
                   p["block_bytes"], p["rows"], p["cores"], p["engines"], p["planner"],
                   p["comm_buffer_bytes"], tuple(placement or ()))
            if key not in self._model_cache:
                bpr = p["block_bytes"] * (p["n"] if p["op"] in ("reduce_scatter", "all_to_all") else 1)
                perm = list(zip(p["perm"][::2], p["perm"][1::2])) if p["op"] == "ppermute" else None
                self._model_cache[key] = model(p["op"], bpr, planner=p["planner"], redop=p["redop"],
                                               root=p["root"], perm=perm, rows=p["rows"], **common)
            return self._model_cache[key]
        if p["kind"] == "ragged":
            key = (mode, keep_slices, p["op"], p["n"], p["dtype"], p["operand_rows"], p["output_rows"],
                   p["row_bytes"], p["input_offsets"].tobytes(), p["send_sizes"].tobytes(),
                   p["output_offsets"].tobytes(), p["cores"], p["engines"], p["planner"],
                   p["comm_buffer_bytes"], tuple(placement or ()))
            if key not in self._model_cache:
                self._model_cache[key] = model(
                    p["op"], hidden=p["row_bytes"] // DTYPE_SIZE[p["dtype"]], send_sizes=p["send_sizes"],
                    input_offsets=p["input_offsets"], output_offsets=p["output_offsets"],
                    operand_rows=p["operand_rows"], output_rows=p["output_rows"], planner=p["planner"], **common)
            return self._model_cache[key]
        # The layout the runtime computed (every rank's pair_slot), not a re-derivation.
        return model(p["op"], tokens=p["tokens"], hidden=p["hidden"], top_k=p["top_k"],
                     num_experts=p["num_experts"], capacity=p["capacity"], pair_slot=p["routing"],
                     planner=p.get("planner", "balanced"), **common)

    def _placement(self, devices):
        """Where the group's ranks sit on the preset: device d is NPU d (the
        whole mesh maps onto the preset in device order)."""
        if max(devices) >= self.spec.num_ranks:
            return None
        return list(devices)

    # ------------------------------------------------------------------ trace
    def events(self) -> list[dict]:
        ev: list[dict] = []
        meta = lambda pid, tid, kind, name: ev.append(  # noqa: E731
            {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}})
        meta(HOST_PID, 0, "process_name", "host (this machine): strata ops per emulated NPU")
        devices = sorted({d for o in self.ops for d in o.devices})
        # Host view: a track per device; concurrent ops of one device go to
        # extra tracks so slices on one track never overlap.
        lanes_end: dict[int, list[float]] = defaultdict(list)
        host_tid = {}
        for o in self.ops:
            for rank, d in enumerate(o.devices):
                a, e = o.arrive_us[rank], max(o.end_us[rank], o.arrive_us[rank])
                ends = lanes_end[d]
                slot = next((i for i, t in enumerate(ends) if t <= a), None)
                if slot is None:
                    slot = len(ends)
                    ends.append(e)
                else:
                    ends[slot] = e
                tid = d * 16 + min(slot, 15)
                host_tid.setdefault(tid, npu_name(d) + (f" (concurrent {slot})" if slot else ""))
                last = o.arrive_us[o.last_to_arrive]
                ev.append({"ph": "X", "name": o.op, "pid": HOST_PID, "tid": tid, "ts": a, "dur": e - a,
                           "args": {"rank": rank, "group_size": o.group_size, "bytes_per_rank": o.bytes_per_rank,
                                    "mode": o.mode, "dtype": o.dtype, "site": o.site_id,
                                    "waited_for_last_us": max(0.0, last - a),
                                    "last_to_arrive": o.last_to_arrive, "host_us": o.host_us,
                                    "modeled_us": o.modeled_us}})
                if last > a and o.group_size > 1:  # nested: the part spent waiting for peers
                    ev.append({"ph": "X", "name": "wait for peers", "pid": HOST_PID, "tid": tid, "ts": a,
                               "dur": min(last, e) - a, "args": {"last_to_arrive": o.last_to_arrive}})
                if rank == o.last_to_arrive and o.group_size > 1:
                    ev.append({"ph": "i", "s": "t", "name": "last to arrive", "pid": HOST_PID, "tid": tid,
                               "ts": a, "args": {"op": o.op, "rank": rank}})
        for d in devices:
            host_tid.setdefault(d * 16, npu_name(d))
        for tid, name in sorted(host_tid.items()):
            meta(HOST_PID, tid, "thread_name", name)

        # Modeled view: every device is an NPU of the preset. Its ops take microseconds where
        # the host's take milliseconds, so on one time axis it would be a sliver at 0: its
        # time is scaled by a power of ten that gives it about the host view's span, and
        # every process name says so (the slices' args keep the true modeled_us).
        cores = max([o.params["cores"] for o in self.ops] or [1])
        engines = max([o.params["engines"] for o in self.ops] or [1])
        placed = []
        free = defaultdict(float)  # device -> modeled time it is next free
        for o in self.ops:
            try:
                res = self._model(o, o.mode, keep_slices=True)
            except Exception:
                continue
            start = max(free[d] for d in o.devices)
            for d in o.devices:
                free[d] = start + res.time_us
            placed.append((o, res, start))
        host_span = max([max(o.end_us) for o in self.ops] or [0.0])
        model_span = max(free.values() or [0.0])
        scale = self.modeled_time_scale
        if scale is None:
            ratio = host_span / model_span if model_span > 0 else 1.0
            scale = 10.0 ** math.floor(math.log10(ratio)) if ratio >= 10 else 1.0
        self.last_modeled_scale = scale
        shown = (f"time x{scale:g}: 1 ms on the axis is {1e3 / scale:g} us modeled" if scale != 1
                 else "time as modeled")
        for d in devices:
            pid = MODEL_PID_BASE + d
            meta(pid, 0, "process_name", f"{npu_name(d)} (modeled on {self.spec.name}; {shown})")
            meta(pid, 0, "thread_name", "ops")
            for c in range(cores):
                meta(pid, 1 + c, "thread_name", f"vector core {c}")
            for s in range(engines):
                meta(pid, 1 + cores + s, "thread_name", f"SDMA engine {s}")
        for o, res, start in placed:
            for d in o.devices:
                ev.append({"ph": "X", "name": o.op, "pid": MODEL_PID_BASE + d, "tid": 0, "ts": start * scale,
                           "dur": res.time_us * scale,
                           "args": {"mode": o.mode, "bytes_per_rank": o.bytes_per_rank, "modeled_us": res.time_us,
                                    "modeled_start_us": start, "time_scale": scale,
                                    "busbw_gbps": res.busbw_gbps, **res.breakdown}})
            ev.extend(self._lane_slices(res, o, start, cores, scale))
        for k, step in enumerate(self.steps):  # whole steps: compute and communication
            ev.extend(step.trace_events(pid_base=STEP_PID_BASE + 100 * k, label=f"step {k}: "))
        return ev

    @staticmethod
    def _lane_slices(res, o: OpRecord, start: float, cores: int, scale: float = 1.0) -> list[dict]:
        """One slice per (rank, lane, phase): its first piece to its last."""
        s = res.slices
        if s is None or not len(s):
            return []
        rank, kind, lane, phase = (s[:, i].astype(np.int64) for i in range(4))
        key = ((rank * 2 + kind) * 4096 + lane) * 4096 + phase
        order = np.argsort(key, kind="stable")
        key = key[order]
        cut = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
        t0 = np.minimum.reduceat(s[order, 4], cut)
        t1 = np.maximum.reduceat(s[order, 5], cut)
        nbytes = np.add.reduceat(s[order, 6], cut)
        count = np.diff(np.r_[cut, len(key)])
        out = []
        kinds = res.phase_kinds or []
        for j, i in enumerate(order[cut]):
            r, k, l, ph = int(rank[i]), int(kind[i]), int(lane[i]), int(phase[i])
            name = _PHASE_NAME.get(kinds[ph] if ph < len(kinds) else 0, "exchange")
            out.append({"ph": "X", "name": f"{o.op} {name}", "pid": MODEL_PID_BASE + o.devices[r],
                        "tid": 1 + l if k == 0 else 1 + cores + l, "ts": (start + float(t0[j])) * scale,
                        "dur": float(t1[j] - t0[j]) * scale,
                        "args": {"pieces": int(count[j]), "bytes": int(nbytes[j]),
                                 "modeled_us": float(t1[j] - t0[j])}})
        return out

    def to_json(self) -> dict:
        events = self.events()
        return {"traceEvents": events, "displayTimeUnit": "ns",
                "otherData": {"spec": self.spec.name, "ops": len(self.ops),
                              "modeled_time_scale": self.last_modeled_scale}}

    def save(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(), f)
        return path

    def table(self) -> list[dict]:
        """tr.ops as rows (op, group, bytes, mode, host and modeled times)."""
        return [{"op": o.op, "group_size": o.group_size, "bytes_per_rank": o.bytes_per_rank, "mode": o.mode,
                 "host_us": o.host_us, **{f"modeled_{m}_us": o.modeled_us.get(m) for m in MODES},
                 "wait_us": o.wait_us, "last_to_arrive": o.last_to_arrive} for o in self.ops]

    def summary(self) -> str:
        if not self.ops:
            return "no strata ops recorded"
        host = sum(o.host_us for o in self.ops)
        mod = {m: sum(o.modeled_us.get(m) or 0.0 for o in self.ops) for m in MODES}
        lines = [f"{len(self.ops)} strata ops: {host / 1e3:.2f} ms on this host; modeled on {self.spec.name}: "
                 + ", ".join(f"{m} {v / 1e3:.3f} ms" for m, v in mod.items())]
        if mod["strata"] > 0:
            lines.append(f"  buffer_centric / strata (modeled): {mod['buffer_centric'] / mod['strata']:.2f}x")
        return "\n".join(lines)

