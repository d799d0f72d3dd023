"""strata.emulator.simulate(): what a whole step would take on the supernode.

The step is traced (never executed), its per-device program becomes a graph
of kernels and collectives (`step_graph`), and a list scheduler runs that
graph on one rank's resources (every rank runs the same SPMD program, and the
op model already times each collective over its whole group):

- a compute stream: kernels one at a time and in program order, as a device
  stream executes them (each starts when it is next on the stream and its
  inputs are ready). Cube (matmul) kernels run on the AIC cores, the rest on
  the AIV (vector) cores;
- a communication stream on the UB ports: collectives one at a time, in
  program order, each taking its op-model time when alone. A collective
  whose plan runs on vector cores holds `cores_per_npu` of the rank's vector
  cores while it runs: a vector kernel running beside it gets only the rest,
  and slows in proportion (an SDMA collective holds no core);
- HBM, shared: when the kernels and collectives running together ask more
  than HBM gives (eta_hbm x peak), all of them slow in proportion.
Independent compute and communication therefore overlap as far as those
resources allow; a dependent pair runs back to back. Time is advanced from
event to event (a start or an end), rates held constant in between.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import jax

from . import op_model as _model
from .spec import preset
from .step_graph import FUSED_PREFIX, Graph

STEP_SETTINGS = ("planner", "cores_per_npu", "sdma_engines_per_npu", "comm_buffer_bytes")


@dataclass
class ModeledStep:
    """One step of a program as the step model times it on one rank (all ranks alike)."""

    time_us: float
    compute_us: float          # time the compute stream is busy
    comm_us: float             # time the communication stream is busy
    exposed_comm_us: float     # communication that no compute hides
    npus: int
    mode: str
    breakdown: dict
    ops: list = field(repr=False)
    critical_path: list = field(repr=False)
    spec: str = "cloudmatrix384"
    settings: dict = field(default_factory=dict, repr=False)
    notes: list = field(default_factory=list, repr=False)

    def __repr__(self) -> str:
        return (f"ModeledStep({self.time_us:.1f} us on {self.npus} ranks of {self.spec}, mode={self.mode}: "
                f"compute {self.compute_us:.1f} us, communication {self.comm_us:.1f} us "
                f"({self.exposed_comm_us:.1f} exposed), {len(self.ops)} ops)")

    def summary(self, top: int = 8) -> str:
        """One screen: totals, where the time goes, the heaviest ops, the critical path."""
        b = self.breakdown
        lines = [repr(self), "",
                 f"  compute   cube {b['cube_us']:10.1f} us   vector {b['vector_us']:10.1f} us   "
                 f"(launch {b['launch_us']:.1f} us over {b['kernels']} kernels; "
                 f"slowed by shared cores/HBM {b['compute_slowdown_us']:.1f} us)",
                 f"  comm      strata {b['strata_comm_us']:9.1f} us   xla {b['xla_comm_us']:9.1f} us   "
                 f"(overlapped with compute {self.comm_us - self.exposed_comm_us:.1f} us)",
                 f"  idle      {b['idle_us']:.1f} us (neither stream busy)",
                 f"  flops     {b['flops'] / 1e9:.3g} GFLOP   HBM {b['hbm_bytes'] / 1e9:.3g} GB   "
                 f"collective bytes {b['comm_bytes'] / 1e9:.3g} GB per rank", ""]
        heavy = sorted(self.ops, key=lambda o: o["end_us"] - o["start_us"], reverse=True)[:top]
        lines.append(f"  {'heaviest ops':<44} {'kind':<10} {'unit':<7} {'us':>10}")
        for o in heavy:
            lines.append(f"  {o['name'][-44:]:<44} {o['kind']:<10} {o['unit']:<7} {o['end_us'] - o['start_us']:10.1f}")
        cp = self.critical_path
        if cp:
            shown = cp if len(cp) <= 6 else cp[:3] + ["..."] + cp[-3:]
            lines += ["", f"  critical path: {len(cp)} ops, {b['critical_compute_us']:.1f} us of kernels and "
                          f"{b['critical_comm_us']:.1f} us of collectives",
                      "    " + " -> ".join(s[-30:] for s in shown)]
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)

    def table(self) -> list[dict]:
        """The step's ops as rows (name, kind, unit, start_us, end_us, us), in start order."""
        return sorted(({"name": o["name"], "kind": o["kind"], "unit": o["unit"], "start_us": o["start_us"],
                        "end_us": o["end_us"], "us": o["end_us"] - o["start_us"]} for o in self.ops),
                      key=lambda r: r["start_us"])

    def save_trace(self, path: str, npus: int = 1) -> str:
        """A Chrome/Perfetto trace (open it in ui.perfetto.dev): per NPU, tracks
        for the cube units, vector kernels, collectives on vector cores, SDMA
        and UB; flows for the dependencies between streams. Every rank runs the
        same program, so `npus` copies (default 1) show the same timeline."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"traceEvents": self.trace_events(npus=npus), "displayTimeUnit": "ns"}, f)
        return path

    def trace_events(self, npus: int = 1, pid_base: int = 2000, label: str = "") -> list:
        """The events of save_trace, for merging into another trace."""
        tracks = {"cube": 1, "vector": 2, "vector cores (collectives)": 3, "sdma": 4, "ub": 5}
        events = []
        for npu in range(max(1, min(npus, self.npus))):
            pid = pid_base + npu
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                           "args": {"name": f"{label}NPU {npu}: step model on {self.spec}, mode={self.mode} "
                                            f"(time from the step's start)"}})
            for tname, tid in tracks.items():
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": tname}})
            for o in self.ops:
                dur = max(o["end_us"] - o["start_us"], 0.0)
                args = {k: v for k, v in o.items() if k not in ("deps", "name") and _jsonable(v)}
                if o["kind"] == "compute":
                    tids = [tracks["cube" if o["unit"] == "cube" else "vector"]]
                else:
                    tids = [tracks["ub"], tracks["sdma" if o["unit"] == "sdma" else "vector cores (collectives)"]]
                for tid in tids:
                    events.append({"ph": "X", "name": o["name"].rsplit("/", 1)[-1] if o["kind"] == "compute"
                                   else o["name"], "ts": o["start_us"], "dur": dur, "pid": pid, "tid": tid,
                                   "args": {"full_name": o["name"], **args}})
            if npu == 0:  # flows: inputs a collective waits for, and kernels waiting on one
                flow = 0
                for o in self.ops:
                    for d in o["deps"]:
                        src = self.ops[d]
                        if (src["kind"] == "collective") == (o["kind"] == "collective"):
                            continue
                        flow += 1
                        stid = tracks["ub"] if src["kind"] == "collective" else tracks[
                            "cube" if src["unit"] == "cube" else "vector"]
                        dtid = tracks["ub"] if o["kind"] == "collective" else tracks[
                            "cube" if o["unit"] == "cube" else "vector"]
                        events.append({"ph": "s", "id": flow, "name": "dependency", "cat": "dep", "pid": pid,
                                       "tid": stid, "ts": src["end_us"] - 1e-3 if src["end_us"] > src["start_us"]
                                       else src["start_us"]})
                        events.append({"ph": "f", "bp": "e", "id": flow, "name": "dependency", "cat": "dep",
                                       "pid": pid, "tid": dtid, "ts": o["start_us"]})
        return events


def fused(fn=None, *, name: str | None = None):
    """Marks `fn` as one fused kernel for the step model: `strata.emulator.simulate`
    costs a call of it as a single kernel that reads its operands and writes its
    results once, its intermediates staying on chip (as a hand-written attention
    or MoE kernel does), its matmuls on the cube cores beside its vector work.
    Executed, it is an ordinary `jax.jit` of `fn` (inlined into the caller's
    program). Usable as `@fused` or `fused(fn, name="attention")`."""
    def wrap(f):
        def kernel(*args, **kwargs):
            return f(*args, **kwargs)
        kernel.__name__ = FUSED_PREFIX + (name or getattr(f, "__name__", "kernel"))
        kernel.__doc__ = getattr(f, "__doc__", None)
        return jax.jit(kernel)
    return wrap if fn is None else wrap(fn)


def _jsonable(v) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


def abstract_mesh(shape, axis_names, *, spec="cloudmatrix384"):
    """A mesh of emulated NPUs that needs no host devices (jax.sharding.AbstractMesh,
    Auto axes): for `jax.shard_map` in programs that are traced and simulated only,
    up to the preset's rank count."""
    sp = preset(spec)
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    axis_names = tuple(axis_names) if isinstance(axis_names, (tuple, list)) else (axis_names,)
    if len(shape) != len(axis_names):
        raise ValueError(f"abstract_mesh: shape {shape} and axis_names {axis_names} differ in length")
    if any(s < 1 for s in shape):
        raise ValueError(f"abstract_mesh: every axis needs at least one NPU, got {shape}")
    if math.prod(shape) > sp.num_ranks:
        raise ValueError(f"abstract_mesh{shape}: {math.prod(shape)} ranks exceed the {sp.num_ranks} of "
                         f"preset {sp.name!r}")
    return jax.sharding.AbstractMesh(shape, axis_names,
                                     axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _mesh_size(jaxpr) -> int:
    """Device count of the largest shard_map mesh in the program (1 without one)."""
    best = 1
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            best = max(best, int(eqn.params["mesh"].size))
        for v in eqn.params.values():
            subs = v if isinstance(v, (tuple, list)) else (v,)
            for sub in subs:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    best = max(best, _mesh_size(inner))
    return best


_OP_CACHE: dict = {}


def _cached_model(spec, settings):
    def op_model(op, size, **kw):
        key = (spec, tuple(sorted(settings.items())), op, size,
               tuple(sorted((k, tuple(map(tuple, v)) if k == "perm" else (tuple(v) if isinstance(v, list) else v))
                            for k, v in kw.items())))
        hit = _OP_CACHE.get(key)
        if hit is None:
            if len(_OP_CACHE) > 4096:
                _OP_CACHE.clear()
            hit = _OP_CACHE[key] = _model.model(op, size, spec=spec, **settings, **kw)
        return hit
    return op_model


def simulate(fn, *args, spec="cloudmatrix384", mode: str = "strata", **settings) -> ModeledStep:
    """Times one step of `fn` on the supernode `spec` without executing it.

    `fn` is what a user would jit: one or more `jax.shard_map`s (strata and/or
    lax collectives, ordinary JAX compute); `args` are arrays or
    `jax.ShapeDtypeStruct`s (a full-size step traces on
    `strata.emulator.abstract_mesh`). `mode` times strata's ops ("strata" or
    "buffer_centric"); XLA's own collectives are timed as the vendor library
    runs them (buffer_centric). `settings`: the strata.config ones the op
    model takes (planner, cores_per_npu, sdma_engines_per_npu,
    comm_buffer_bytes); default: those in force.
    """
    sp = preset(spec)
    if mode not in _model.MODES:
        raise ValueError(f"strata.emulator.simulate: mode must be one of {_model.MODES}, got {mode!r}")
    unknown = set(settings) - set(STEP_SETTINGS)
    if unknown:
        raise TypeError(f"strata.emulator.simulate: unknown setting(s) {sorted(unknown)}; known: {STEP_SETTINGS}")
    s = _model._settings(settings.get("planner"), settings.get("cores_per_npu"),
                         settings.get("sdma_engines_per_npu"), settings.get("comm_buffer_bytes"))
    if not callable(fn):
        raise TypeError(f"strata.emulator.simulate: fn must be callable, got {type(fn).__name__}")
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    closed = jitted.trace(*args).jaxpr
    npus = _mesh_size(closed.jaxpr)
    if npus > sp.num_ranks:
        raise ValueError(f"strata.emulator.simulate: the step's mesh has {npus} ranks, more than the "
                         f"{sp.num_ranks} of preset {sp.name!r}")
    graph = Graph(sp, mode, s, _cached_model(sp, s))
    graph.build(closed, npus)
    return _schedule(graph, sp, mode, npus, s)


def _schedule(graph: Graph, sp, mode: str, npus: int, settings: dict) -> ModeledStep:
    nodes = graph.nodes
    n = len(nodes)
    succ = [[] for _ in range(n)]
    waiting = [0] * n
    for node in nodes:
        node.deps.discard(node.id)
        for d in node.deps:
            succ[d].append(node.id)
        waiting[node.id] = len(node.deps)
    stream_of = ["comm" if node.kind == "collective" else "compute" for node in nodes]
    # Each stream runs its ops in program order (node ids follow the program).
    queue = {"compute": [x.id for x in nodes if stream_of[x.id] == "compute"],
             "comm": [x.id for x in nodes if stream_of[x.id] == "comm"]}
    head = {"compute": 0, "comm": 0}
    start = [0.0] * n
    end = [0.0] * n
    gate = [-1] * n                    # what it waited for last: a dependency or its stream
    last_on = {"compute": -1, "comm": -1}
    busy = {"compute": None, "comm": None}  # running node id per stream
    progress = {}                      # node id -> fraction done
    hbm_rate = sp.hbm_efficiency * sp.hbm_gbps_per_rank * 1e3  # B/us
    vcores = sp.vector_cores_per_rank
    t = 0.0
    done = 0
    slowed = 0.0
    while done < n:
        for stream in ("comm", "compute"):
            q = queue[stream]
            if busy[stream] is None and head[stream] < len(q) and waiting[q[head[stream]]] == 0:
                i = q[head[stream]]
                head[stream] += 1
                busy[stream] = i
                start[i] = t
                cands = list(nodes[i].deps) + ([last_on[stream]] if last_on[stream] >= 0 else [])
                gate[i] = max(cands, key=lambda d: (end[d], d)) if cands else -1
                progress[i] = 0.0
        running = [i for i in busy.values() if i is not None]
        if not running:
            raise RuntimeError("strata.emulator.simulate: the step's graph has a cycle (a bug in the step model)")
        # Rates: vector kernels lose the cores collectives hold; HBM is shared.
        held = sum(nodes[i].cores for i in running if nodes[i].kind == "collective")
        rate = {}
        for i in running:
            node = nodes[i]
            r = 1.0
            if node.kind == "compute" and node.unit == "vector" and held:
                r = max(vcores - held, 0) / vcores
            rate[i] = r
        demand = sum(nodes[i].hbm_bytes / nodes[i].time_us * rate[i] for i in running if nodes[i].time_us > 0)
        if demand > hbm_rate * (1 + 1e-12) and len(running) > 1:
            f = hbm_rate / demand
            for i in running:
                if nodes[i].hbm_bytes > 0:
                    rate[i] *= f
        # Next completion.
        dt = math.inf
        for i in running:
            T = nodes[i].time_us
            if T <= 0:
                dt = 0.0
                break
            if rate[i] > 0:
                dt = min(dt, (1.0 - progress[i]) * T / rate[i])
        if dt == math.inf:
            raise RuntimeError("strata.emulator.simulate: no running node can progress (a bug in the step model)")
        t += dt
        for i in running:
            T = nodes[i].time_us
            progress[i] = 1.0 if T <= 0 else progress[i] + rate[i] * dt / T
            if nodes[i].kind == "compute" and rate[i] < 1.0:
                slowed += dt * (1.0 - rate[i])
        for stream, i in list(busy.items()):
            if i is not None and progress[i] >= 1.0 - 1e-9:
                end[i] = t
                busy[stream] = None
                last_on[stream] = i
                del progress[i]
                done += 1
                for j in succ[i]:
                    waiting[j] -= 1
    total = max(end) if n else 0.0
    return _result(graph, sp, mode, npus, settings, start, end, gate, total, slowed)


def _union(intervals) -> list:
    out = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _covered(a, b) -> float:
    """Length of the union `a` that the union `b` also covers."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _result(graph, sp, mode, npus, settings, start, end, gate, total, slowed) -> ModeledStep:
    nodes = graph.nodes
    comp = _union([(start[x.id], end[x.id]) for x in nodes if x.kind == "compute"])
    comm = _union([(start[x.id], end[x.id]) for x in nodes if x.kind == "collective"])
    compute_us = sum(e - s for s, e in comp)
    comm_us = sum(e - s for s, e in comm)
    exposed = comm_us - _covered(comm, comp)
    either = _union([*map(tuple, comp), *map(tuple, comm)])
    ops = []
    index = {}  # node id -> position in ops (folded regions are no op)
    for x in nodes:
        if not x.info.get("folded"):
            index[x.id] = len(index)
    for x in nodes:
        if x.info.get("folded"):
            continue
        ops.append({"name": x.name, "kind": x.kind, "unit": x.unit, "flops": float(x.flops),
                    "bytes": float(x.bytes), "start_us": start[x.id], "end_us": end[x.id],
                    "alone_us": float(x.time_us), "deps": sorted(index[d] for d in x.deps if d in index), **x.info})
    kernels = [x for x in nodes if x.kind == "compute" and not x.info.get("folded")]
    breakdown = {
        "cube_us": sum(end[x.id] - start[x.id] for x in kernels if x.unit == "cube"),
        "vector_us": sum(end[x.id] - start[x.id] for x in kernels if x.unit == "vector"),
        "launch_us": sp.kernel_launch_us * len(kernels),
        "kernels": len(kernels),
        "compute_slowdown_us": slowed,
        "strata_comm_us": sum(end[x.id] - start[x.id] for x in nodes
                              if x.kind == "collective" and x.info.get("library") == "strata"),
        "xla_comm_us": sum(end[x.id] - start[x.id] for x in nodes
                           if x.kind == "collective" and x.info.get("library") == "xla"),
        "collectives": sum(1 for x in nodes if x.kind == "collective"),
        "idle_us": total - sum(e - s for s, e in either),
        "flops": sum(x.flops for x in kernels),
        "hbm_bytes": sum(x.bytes for x in kernels),
        "comm_bytes": sum(x.bytes for x in nodes if x.kind == "collective"),
    }
    path = []
    on_path = {"compute": 0.0, "collective": 0.0}
    if nodes:
        i = max(range(len(nodes)), key=lambda k: (end[k], -k))
        seen = set()
        while i >= 0 and i not in seen:
            seen.add(i)
            if not nodes[i].info.get("folded"):
                path.append(nodes[i].name)
                on_path[nodes[i].kind] += end[i] - start[i]
            i = gate[i]
        path.reverse()
    breakdown["critical_compute_us"] = on_path["compute"]
    breakdown["critical_comm_us"] = on_path["collective"]
    return ModeledStep(time_us=total, compute_us=compute_us, comm_us=comm_us, exposed_comm_us=max(0.0, exposed),
                       npus=npus, mode=mode, breakdown=breakdown, ops=ops, critical_path=path, spec=sp.name,
                       settings=dict(settings), notes=list(graph.notes))
