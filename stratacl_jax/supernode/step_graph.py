"""The step model's first half: a traced JAX step as a dependency graph of
kernels and collectives, each with its cost on one rank of the supernode.

The per-device program is the body of the step's `jax.shard_map`s (a jaxpr).
Every equation becomes part of a *node*:

- matmul-like equations (dot_general, conv, ragged_dot) are one cube-unit
  kernel each: flops from the shapes, bytes = operands read + result written;
- other arithmetic runs on the vector cores, grouped the way a fusing compiler
  groups it (XLA's loop fusion): an elementwise / broadcast / reduction /
  layout equation joins the region of its most recent producer (or, reading
  only step inputs, the region that reads the same input), which reads its
  inputs from HBM once and writes only the values used outside it. Scalars
  pull no equation into their region; a region never takes an equation that
  depends on a node issued after the region began, so regions cannot form
  cycles. A region that only casts, transposes, slices or broadcasts what
  matmuls read is folded into them. Sort, top_k, gather, scatter, cumulative
  ops and in-place updates are kernels of their own;
- a function marked with `strata.emulator.fused` is one kernel: its
  intermediates stay on chip;
- collectives (strata's primitives, the MoE custom calls, and XLA's own psum,
  all_gather, psum_scatter, all_to_all, ppermute, pbroadcast, psum_invariant,
  ragged_all_to_all — including those autodiff inserts) are one node each,
  timed by the op model (`strata.emulator.model`): strata's ops in the step's
  mode, XLA's as the vendor library runs them (buffer_centric);
- shape-only equations (reshape, squeeze, pvary, axis_index, ...) cost
  nothing and are not nodes.

Control flow: calls (jit, custom_jvp/vjp, checkpoint, nested shard_map) are
inlined; `scan` is unrolled (each iteration its own nodes, so layers overlap
as the schedule allows); a `while` of unknown trip count is counted once and
noted; a `cond` costs its heaviest branch (noted). Work outside every
shard_map is what jit would partition over the mesh: its cost is divided by
the device count. Time of a kernel: max(flops / (eta * peak), bytes /
(eta_hbm * bandwidth)) + the launch cost (SupernodeSpec, cited figures).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
from jax.extend import core as jcore

from . import op_model as _model

# Equations that only relabel data: no kernel, no bytes.
FREE = frozenset({
    "pvary", "pcast", "reshape", "squeeze", "expand_dims", "stop_gradient", "axis_index",
    "optimization_barrier", "name", "sharding_constraint", "mesh_cast", "reshard", "device_put",
    "custom_lin", "pjit_with_cpp_fast_path", "copy", "with_sharding_constraint", "core_call_stub",
    "tie_in", "random_wrap", "random_unwrap", "random_seed", "random_fold_in",
})
# Vector-unit equations a fusing compiler puts in one loop with their neighbours.
FUSIBLE = frozenset({
    "add", "sub", "mul", "div", "rem", "max", "min", "neg", "sign", "abs", "floor", "ceil", "round",
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "pow",
    "integer_pow", "square", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh",
    "asinh", "acosh", "atanh", "erf", "erfc", "erf_inv", "lgamma", "digamma", "is_finite", "and", "or",
    "not", "xor", "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp", "convert_element_type",
    "nextafter", "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
    "imag", "real", "conj", "complex", "reduce_precision", "copy_p", "broadcast_in_dim", "iota",
    "transpose", "slice", "dynamic_slice", "concatenate", "pad", "rev", "reduce_sum", "reduce_max",
    "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin",
    "squeeze", "select_and_scatter_add", "bitcast_convert_type", "clz", "stack", "split",
})
# Work on a few scalars (ranks, offsets, loop counters) runs on the cores' scalar units
# inside the kernels that use it, not as kernels of its own.
SCALAR_BYTES = 64
# Regions made only of these feed a matmul the way its operand loads can (a cast, a
# transpose, a slice or a broadcast of the operand as the cube unit reads it): folded into it.
LAYOUT = frozenset({"convert_element_type", "transpose", "slice", "dynamic_slice", "broadcast_in_dim",
                    "squeeze", "rev", "reduce_precision", "bitcast_convert_type"})
# A jitted function of this name prefix is one fused kernel (strata.emulator.fused).
FUSED_PREFIX = "strata_fused__"
MATMUL = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})
# Reads of these are the slice they take, not the whole operand.
SLICING = frozenset({"slice", "dynamic_slice"})

# XLA's collectives: (op of the op model, reduction).
LAX_COLLECTIVES = {
    "psum": ("all_reduce", "sum"), "psum_invariant": ("all_reduce", "sum"),
    "pmax": ("all_reduce", "max"), "pmin": ("all_reduce", "min"),
    "all_gather": ("all_gather", None), "all_gather_invariant": ("all_gather", None),
    "reduce_scatter": ("reduce_scatter", "sum"), "psum_scatter": ("reduce_scatter", "sum"),
    "all_to_all": ("all_to_all", None), "ppermute": ("ppermute", None),
    "pbroadcast": ("broadcast", None), "ragged_all_to_all": ("all_to_all", None),
}
STRATA_COLLECTIVES = {
    "strata_all_reduce": "all_reduce", "strata_all_gather": "all_gather",
    "strata_reduce_scatter": "reduce_scatter", "strata_all_to_all": "all_to_all",
    "strata_broadcast": "broadcast", "strata_ppermute": "ppermute",
    "strata_ragged_all_to_all": "all_to_all",
}
# strata.moe's primitives: the MoE ops of the op model each runs (combine's
# tangent in both arguments runs two combines).
MOE_PRIMITIVES = {
    "strata_moe_dispatch": ("moe_dispatch",), "strata_moe_dispatch_rows": ("moe_dispatch",),
    "strata_moe_combine": ("moe_combine",), "strata_moe_combine_tangent": ("moe_combine", "moe_combine"),
    "strata_moe_combine_backward": ("moe_combine_backward",),
}


def nbytes(aval) -> int:
    shape = getattr(aval, "shape", ())
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    try:
        item = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        item = 8
    return int(math.prod(shape)) * item


def nelems(aval) -> int:
    return int(math.prod(getattr(aval, "shape", ())))


def dtype_name(aval) -> str:
    try:
        return np.dtype(aval.dtype).name
    except TypeError:
        return "uint32"


@dataclass
class Node:
    """One kernel or collective of one rank."""

    id: int
    name: str
    kind: str                 # "compute" | "collective"
    unit: str                 # compute: "cube" | "vector"; collective: "vector" (core lanes) | "sdma"
    flops: float = 0.0
    bytes: float = 0.0        # compute: HBM bytes read + written; collective: bytes per rank
    time_us: float = 0.0      # alone on the rank
    hbm_bytes: float = 0.0    # HBM traffic (for sharing HBM with concurrent nodes)
    cores: int = 0            # vector cores a collective holds while it runs
    deps: set = field(default_factory=set)
    info: dict = field(default_factory=dict)
    # Building state of a compute node (bytes are settled at the end).
    reads: dict = field(default_factory=dict)        # value id -> bytes read
    vector_us: float = 0.0    # flops time at the dtypes' vector rates (before efficiency)


class Value:
    """A value of the program: who produces it, and its size."""

    __slots__ = ("id", "nodes", "nbytes", "escapes", "consumers", "returned")
    _ids = itertools.count(1)

    def __init__(self, nodes: tuple, nbytes: int):
        self.id = next(Value._ids)
        self.nodes = nodes        # producing node ids (several: a scan's stacked ys); () = a step input
        self.nbytes = nbytes
        self.escapes = False      # read by another node or returned: its producer writes it
        self.consumers = set()    # nodes that read it
        self.returned = False     # an output of the step


class Graph:
    """Builds the node list of a traced step (see the module docstring)."""

    def __init__(self, spec, mode: str, settings: dict, op_model):
        self.spec, self.mode, self.settings = spec, mode, settings
        self.op_model = op_model        # (op, **kwargs) -> ModeledOp, cached by the caller
        self.nodes: list[Node] = []
        self.notes: list[str] = []
        self.mesh = None                # (shape, axis names) of the innermost shard_map
        self.scale = 1.0                # 1 / devices outside shard_map
        self.region: Node | None = None  # the fusion region that grew last
        self.values: list[Value] = []
        self._noted: set = set()

    def value(self, nodes: tuple, size: int) -> "Value":
        val = Value(nodes, size)
        if nodes:
            self.values.append(val)
        return val

    # -- entry --------------------------------------------------------------------------------
    def build(self, closed_jaxpr, npus: int) -> None:
        jaxpr = closed_jaxpr.jaxpr
        self.scale = 1.0 / max(1, npus)
        env = {}
        for v in list(jaxpr.constvars) + list(jaxpr.invars):
            env[v] = self.value((), nbytes(v.aval))
        outs = self.run(jaxpr, env)
        for val in outs:
            if val is not None:
                val.escapes = val.returned = True
        self.finish()

    def note(self, text: str) -> None:
        if text not in self._noted:
            self._noted.add(text)
            self.notes.append(text)

    # -- walking ------------------------------------------------------------------------------
    def read(self, env, atom):
        if isinstance(atom, jcore.Literal):
            return None
        return env.get(atom)

    def run(self, jaxpr, env) -> list:
        for eqn in jaxpr.eqns:
            self.eqn(eqn, env)
        return [self.read(env, v) for v in jaxpr.outvars]

    def inline(self, jaxpr, consts, args) -> list:
        """Runs a sub-jaxpr (Jaxpr or ClosedJaxpr) on argument values."""
        closed = hasattr(jaxpr, "jaxpr")
        inner = jaxpr.jaxpr if closed else jaxpr
        env = {}
        constvals = [self.value((), nbytes(v.aval)) for v in inner.constvars]
        for v, val in zip(inner.constvars, constvals):
            env[v] = val
        for v, val in zip(inner.invars, args):
            if val is not None:
                # A shard_map body sees its shard: the value as the body types it.
                size = nbytes(v.aval)
                env[v] = val if val.nbytes == size else self.value(val.nodes, size)
        return self.run(inner, env)

    def eqn(self, eqn, env) -> None:
        name = eqn.primitive.name
        ins = [self.read(env, v) for v in eqn.invars]
        p = eqn.params
        if name == "shard_map":
            outer = (self.mesh, self.scale)
            mesh = p["mesh"]
            self.mesh = (tuple(mesh.axis_sizes), tuple(mesh.axis_names))
            self.scale = 1.0
            outs = self.inline(p["jaxpr"], (), ins)
            self.mesh, self.scale = outer
        elif name == "scan":
            outs = self.scan(eqn, ins)
        elif name == "while":
            outs = self.while_loop(eqn, ins)
        elif name == "cond":
            outs = self.cond(eqn, ins)
        elif name in STRATA_COLLECTIVES or name in LAX_COLLECTIVES:
            outs = self.collective(eqn, ins)
        elif name in MOE_PRIMITIVES:
            outs = self.moe(eqn, ins)
        elif name in FREE or self.scalar_work(eqn):
            outs = self.free(eqn, ins)
        elif str(p.get("name", "")).startswith(FUSED_PREFIX) and self.subjaxpr(eqn) is not None:
            outs = self.fused_kernel(eqn, ins)
        else:
            sub = self.subjaxpr(eqn)
            if sub is not None:
                outs = self.inline(sub, (), ins)
            elif name in MATMUL:
                outs = self.kernel(eqn, ins, "cube")
            elif name in FUSIBLE:
                outs = self.fused(eqn, ins)
            else:
                outs = self.kernel(eqn, ins, "vector")
        for v, val in zip(eqn.outvars, outs):
            if val is not None and not isinstance(v, jcore.DropVar):
                env[v] = val

    @staticmethod
    def subjaxpr(eqn):
        """The one sub-jaxpr a call-like primitive runs on its operands
        (jit, custom_jvp_call, custom_vjp_call, checkpoint, closed_call...)."""
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            sub = eqn.params.get(key)
            if sub is None:
                continue
            inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
            if hasattr(inner, "invars") and len(inner.invars) == len(eqn.invars):
                return sub
        return None

    # -- control flow -------------------------------------------------------------------------
    def scan(self, eqn, ins):
        p = eqn.params
        body, length = p["jaxpr"], int(p["length"])
        nc, ncarry = int(p["num_consts"]), int(p["num_carry"])
        consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        body_out = [v.aval for v in body.jaxpr.outvars]
        y_avals = body_out[ncarry:]
        ys_nodes = [[] for _ in y_avals]
        for _ in range(length):
            x_slices = [None if x is None else self.value(x.nodes, x.nbytes // max(1, length)) for x in xs]
            outs = self.inline(body, (), list(consts) + list(carry) + x_slices)
            carry = outs[:ncarry]
            for j, y in enumerate(outs[ncarry:]):
                if y is not None:
                    y.escapes = True  # stacked into the ys buffer
                    ys_nodes[j].extend(y.nodes)
        # Written by its producers iteration by iteration (their ys escaped): the stacked
        # value is not a write of its own, so it is not tracked.
        ys = [Value(tuple(dict.fromkeys(nodes)), nbytes(a) * length) for nodes, a in zip(ys_nodes, y_avals)]
        return list(carry) + ys

    def while_loop(self, eqn, ins):
        p = eqn.params
        nc, nb = int(p["cond_nconsts"]), int(p["body_nconsts"])
        body_consts, carry = ins[nc:nc + nb], ins[nc + nb:]
        self.note("a while_loop of unknown trip count is counted as one iteration")
        return self.inline(p["body_jaxpr"], (), list(body_consts) + list(carry))

    def cond(self, eqn, ins):
        branches = eqn.params["branches"]
        if len(branches) > 1:
            self.note("a cond is costed as its heaviest branch")
        best = max(branches, key=lambda b: weight(b.jaxpr))
        return self.inline(best, (), ins[1:])

    # -- nodes --------------------------------------------------------------------------------
    def new_node(self, **kw) -> Node:
        node = Node(id=len(self.nodes), **kw)
        if self.scale != 1.0:
            node.info["scale"] = self.scale  # outside shard_map: jit splits it over the mesh
        self.nodes.append(node)
        return node

    def depend(self, node: Node, ins, read_bytes=None) -> None:
        for i, val in enumerate(ins):
            if val is None or node.id in val.nodes:
                continue
            node.deps.update(val.nodes)
            val.escapes = True
            val.consumers.add(node.id)
            b = val.nbytes if read_bytes is None else read_bytes[i]
            node.reads[val.id] = max(node.reads.get(val.id, 0), b)

    @staticmethod
    def scalar_work(eqn) -> bool:
        if eqn.primitive.name in MATMUL or Graph.subjaxpr(eqn) is not None or any(
                k in eqn.params for k in ("branches", "body_jaxpr", "jaxpr")):
            return False
        return sum(nbytes(v.aval) for v in eqn.outvars) <= SCALAR_BYTES and \
            sum(nbytes(v.aval) for v in eqn.invars) <= SCALAR_BYTES

    def free(self, eqn, ins):
        """Shape-only (and scalar) equations: the result is the operands' data, relabelled;
        it depends on whatever they depend on."""
        srcs = [v for v in ins if v is not None]
        producers = tuple(dict.fromkeys(n for v in srcs for n in v.nodes))
        outs = []
        for v in eqn.outvars:
            size = nbytes(v.aval)
            if len(srcs) == 1 and size == srcs[0].nbytes:
                outs.append(srcs[0])
            else:
                outs.append(self.value(producers, size))
        return outs

    def _name(self, eqn) -> str:
        stack = str(getattr(eqn.source_info, "name_stack", "") or "")
        return f"{stack}/{eqn.primitive.name}" if stack else eqn.primitive.name

    def _vector_us(self, eqn) -> tuple[float, float]:
        """(flops, their time at the dtype's vector peak in us, before eta) of a vector
        equation: one operation per element of its largest operand or result."""
        out = eqn.outvars[0].aval if eqn.outvars else None
        if out is None:
            return 0.0, 0.0
        work = max([nelems(v.aval) for v in eqn.invars if hasattr(v, "aval")] + [nelems(out)])
        flops = float(work) * self.scale
        return flops, flops / (self.spec.vector_tflops_per_rank(dtype_name(out or eqn.invars[0].aval)) * 1e6)

    def fused(self, eqn, ins):
        """Joins the region of its most recent fusible producer, or opens one (see the
        module docstring). An equation that reads nothing (iota, a broadcast constant) is
        generated in registers by whoever uses it: no node, no bytes."""
        if all(v is None for v in ins):
            return [self.value((), 0) for _ in eqn.outvars]
        # Scalars (a layer index, an offset) go into any kernel: they pull it into no region.
        cands = [n for v in ins if v is not None and v.nbytes > SCALAR_BYTES for n in v.nodes
                 if self.nodes[n].unit == "vector" and self.nodes[n].kind == "compute"
                 and self.nodes[n].info.get("region") and self.nodes[n].info.get("scale", 1.0) == self.scale]
        r = self.nodes[max(cands)] if cands else None
        if r is None and self.region is not None and self.region.info.get("region") and \
                self.region.info.get("scale", 1.0) == self.scale and any(v is not None and v.id in self.region.reads for v in ins):
            r = self.region  # a sibling: it reads what the open region reads
        # Values issued before the region began cannot depend on it: taking them keeps
        # the graph acyclic.
        if r is None or not all(val is None or all(n <= r.id for n in val.nodes) for val in ins):
            r = self.new_node(name=self._name(eqn), kind="compute", unit="vector")
            r.info["region"] = True
        self.region = r
        flops, us = self._vector_us(eqn)
        r.flops += flops
        r.vector_us += us
        if eqn.primitive.name not in LAYOUT:
            r.info["computes"] = True
        reads = None
        if eqn.primitive.name in SLICING:
            reads = [min(v.nbytes, nbytes(eqn.outvars[0].aval)) if v is not None else 0 for v in ins]
        self.depend(r, ins, reads)
        return [self.value((r.id,), nbytes(v.aval)) for v in eqn.outvars]

    def kernel(self, eqn, ins, unit: str):
        name = eqn.primitive.name
        node = self.new_node(name=self._name(eqn), kind="compute", unit=unit)
        outs_b = [nbytes(v.aval) for v in eqn.outvars]
        reads = None
        writes = sum(outs_b)
        if unit == "cube":
            node.flops = matmul_flops(eqn) * self.scale
            node.info["dtype"] = dtype_name(eqn.invars[0].aval)
        else:
            flops, us = self._vector_us(eqn)
            if name in ("sort", "top_k", "argsort"):
                n = max(2, eqn.invars[0].aval.shape[-1] if eqn.invars[0].aval.shape else 2)
                flops *= math.log2(n)
                us *= math.log2(n)
            node.flops, node.vector_us = flops, us
            if name == "gather":  # reads the gathered rows (and the indices), not the table
                reads = [nbytes(eqn.outvars[0].aval) if i == 0 else (v.nbytes if v else 0)
                         for i, v in enumerate(ins)]
            elif name in ("dynamic_update_slice", "scatter", "scatter-add", "scatter_add", "scatter_mul"):
                upd = ins[-1].nbytes if ins[-1] is not None else 0
                # In place: the operand is not read or rewritten, only the updated part.
                reads = [upd if i == 0 else (v.nbytes if v else 0) for i, v in enumerate(ins)]
                writes = upd
            if name not in ("gather", "dynamic_update_slice", "scatter", "scatter-add", "scatter_add",
                            "sort", "top_k", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp",
                            "argsort", "rng_bit_generator", "threefry2x32", "random_bits", "ffi_call"):
                self.note(f"{name}: costed as a vector kernel of its own")
        self.depend(node, ins, reads)
        node.info["writes"] = writes * self.scale
        return [self.value((node.id,), b) for b in outs_b]

    def fused_kernel(self, eqn, ins):
        """A function marked with strata.emulator.fused: one kernel whose
        intermediates stay on chip. It reads its operands and writes its results
        once; its matmuls run on the cube cores while its vector work runs on the
        vector cores beside them (a mixed AIC/AIV kernel)."""
        inner = Graph(self.spec, self.mode, self.settings, self.op_model)
        inner.mesh, inner.scale = self.mesh, self.scale
        sub = self.subjaxpr(eqn)
        jaxpr = sub.jaxpr if hasattr(sub, "jaxpr") else sub
        env = {v: inner.value((), nbytes(v.aval)) for v in jaxpr.invars}
        inner.run(jaxpr, env)
        if any(x.kind == "collective" for x in inner.nodes):
            self.note(f"{eqn.params['name']}: a fused kernel holding collectives is costed op by op")
            return self.inline(sub, (), ins)
        node = self.new_node(name=str(eqn.params["name"])[len(FUSED_PREFIX):], kind="compute", unit="vector")
        cube = [x for x in inner.nodes if x.unit == "cube"]
        node.flops = sum(x.flops for x in inner.nodes)
        node.vector_us = sum(x.vector_us for x in inner.nodes)
        node.info["cube_us"] = sum(x.flops / (self.spec.cube_tflops_per_rank(x.info.get("dtype", "bfloat16")) * 1e6)
                                   for x in cube)
        node.info["computes"] = True
        if cube:
            node.unit = "cube"
            node.info["dtype"] = cube[0].info.get("dtype", "bfloat16")
        self.depend(node, ins)
        self.region = None
        outs_b = [nbytes(v.aval) for v in eqn.outvars]
        node.info["writes"] = sum(outs_b) * self.scale
        return [self.value((node.id,), b) for b in outs_b]

    def _group(self, axes) -> tuple[int, list]:
        """Group size over mesh axes `axes`, and the NPUs of the group holding rank 0."""
        axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        if self.mesh is None:
            return 1, [0]
        sizes, names = self.mesh
        pos = {a: i for i, a in enumerate(names)}
        axes = tuple(a for a in axes if a in pos)
        n = math.prod(sizes[pos[a]] for a in axes)
        grid = np.arange(math.prod(sizes)).reshape(sizes)
        idx = tuple(slice(None) if nm in axes else 0 for nm in names)
        sub = grid[idx]
        order = [pos[a] for a in axes]
        kept = [i for i, nm in enumerate(names) if nm in axes]
        sub = np.transpose(sub, [kept.index(o) for o in order]) if len(kept) > 1 else sub
        return n, [int(v) for v in np.ravel(sub)]

    def collective(self, eqn, ins):
        name, p = eqn.primitive.name, eqn.params
        if name in STRATA_COLLECTIVES:
            op = STRATA_COLLECTIVES[name]
            mode = self.mode
            group = p["group"]
            n, ranks = self._group(group.axes)
            redop = p.get("op", "sum") if op in ("all_reduce", "reduce_scatter") else None
            library = "strata"
        else:
            op, redop = LAX_COLLECTIVES[name]
            mode = "buffer_centric"
            axes = p.get("axes", p.get("axis_name"))
            n, ranks = self._group(axes)
            library = "xla"
            if p.get("axis_index_groups") is not None:
                self.note(f"{name} with axis_index_groups: timed over its whole axis")
        size = sum(v.nbytes for v in ins if v is not None)
        aval = eqn.invars[0].aval
        dtype = dtype_name(aval)
        kwargs = {}
        if redop is not None:
            kwargs["redop"] = "sum" if redop == "mean" else redop
        if op == "broadcast":
            root = p.get("root", p.get("source", 0))
            kwargs["root"] = int(root) if isinstance(root, (int, np.integer)) else 0
        if op == "ppermute":
            perm = p.get("perm")
            if perm:
                kwargs["perm"] = [tuple(int(a) for a in pair) for pair in perm]
        label = f"{library} {op}"
        return self.comm_node(eqn, ins, label, op, n, ranks, mode, dtype, size, library, **kwargs)

    def moe(self, eqn, ins):
        name, p = eqn.primitive.name, eqn.params
        n, ranks = self._group(p["group"].axes)
        avals = [v.aval for v in eqn.invars]
        if name.startswith("strata_moe_dispatch"):
            (t, h), k = avals[0].shape, avals[1].shape[1]
            dtype, cap, e = dtype_name(avals[0]), int(p["capacity"]), int(p["num_experts"])
        else:
            # Where expert_y and the weights are among the operands.
            at = {"strata_moe_combine": 0, "strata_moe_combine_tangent": 2, "strata_moe_combine_backward": 1}[name]
            ey, w = avals[at], avals[at + 1]
            el, cap, h = ey.shape
            t, k = w.shape
            dtype, e = dtype_name(ey), el * n
        kw = dict(tokens=int(t), hidden=int(h), top_k=int(k), num_experts=int(e), capacity=int(cap))
        outs = None
        for op in MOE_PRIMITIVES[name]:  # each an exchange of its own on the operands
            done = self.comm_node(eqn, ins, f"strata {op}", op, n, ranks, self.mode, dtype, None, "strata", **kw)
            outs = done if outs is None else [self.value(a.nodes + b.nodes, a.nbytes) for a, b in zip(outs, done)]
        return outs

    def comm_node(self, eqn, ins, label, op, n, ranks, mode, dtype, size, library, **kwargs):
        node = self.new_node(name=label, kind="collective", unit="vector")
        self.region = None
        if dtype not in _model.DTYPE_CODE:
            dtype = {"complex64": "float32", "complex128": "float64", "int16": "int32",
                     "uint16": "uint32", "uint64": "int64"}.get(dtype, "float32")
        if dtype == "bool" and op in ("all_reduce", "reduce_scatter"):
            dtype = "uint8"
        outs = [self.value((node.id,), nbytes(v.aval)) for v in eqn.outvars]
        self.depend(node, ins)
        node.reads.clear()
        if n <= 1:
            node.unit, node.info = "vector", {"op": op, "group": n, "library": library, "mode": mode}
            return outs
        rank_npu = ranks if ranks != list(range(n)) else None
        if rank_npu is not None and max(rank_npu) >= self.spec.num_ranks:
            rank_npu = None
        if op.startswith("moe"):
            r = self.moe_model(op, n, mode, dtype, rank_npu, kwargs)
        else:
            r = self.op_model(op, int(size), npus=n, mode=mode, dtype=dtype, rank_npu=rank_npu, **kwargs)
        node.time_us = r.time_us
        node.bytes = float(r.bytes_per_rank)
        sdma = any(v > 0 for v in r.lane_busy_us["sdma"])
        cores = any(v > 0 for v in r.lane_busy_us["core"])
        node.unit = "sdma" if sdma and not cores else "vector"
        node.cores = min(int(self.settings["cores_per_npu"]), self.spec.vector_cores_per_rank) if cores else 0
        node.hbm_bytes = r.breakdown.get("busiest_hbm_us", 0.0) * self.spec.hbm_gbps_per_rank * 1e3
        node.info = {"op": op, "group": n, "library": library, "mode": mode, "dtype": dtype,
                     "bytes_per_rank": r.bytes_per_rank, "busbw_gbps": r.busbw_gbps,
                     "sdma_us": max(r.lane_busy_us["sdma"], default=0.0),
                     "core_us": max(r.lane_busy_us["core"], default=0.0), **{k: v for k, v in kwargs.items()
                                                                              if k != "perm"}}
        return outs

    def moe_model(self, op, n, mode, dtype, rank_npu, kwargs):
        """The op model of an MoE op. The buffer_centric runtime refuses an MoE op whose rows
        do not fit the communication buffer; a vendor library stages it in rounds, as it
        does collectives: so many rounds of fewer tokens (capacity shrinking alike), back to
        back. The rows each round stages are the op model's (xla_ffi/model/model.cc)."""
        rounds = 1
        if mode == "buffer_centric":
            t, cap, k = kwargs["tokens"], kwargs["capacity"], kwargs["top_k"]
            row = kwargs["hidden"] * _model.DTYPE_SIZE[dtype]
            w = 8 if dtype == "float64" else 4
            x, slots, pairs = t * row, kwargs["num_experts"] // n * cap * row, t * k * w
            need = {"moe_dispatch": max(x, slots), "moe_combine": max(x, slots),
                    "moe_combine_backward": x + slots + pairs}[op]
            rounds = max(1, -(-need // int(self.settings["comm_buffer_bytes"])))
        while True:
            kw = dict(kwargs)
            if rounds > 1:
                kw["tokens"] = -(-kwargs["tokens"] // rounds)
                kw["capacity"] = max(1, -(-kwargs["capacity"] // rounds))
            try:
                r = self.op_model(op, None, npus=n, mode=mode, dtype=dtype, rank_npu=rank_npu, **kw)
            except ValueError as e:
                if "communication buffer" not in str(e) or rounds >= kwargs["tokens"]:
                    raise
                rounds += 1
                continue
            if rounds == 1:
                return r
            self.note(f"buffer_centric {op}: staged in {rounds} rounds of {kw['tokens']} tokens (its rows "
                      f"exceed comm_buffer_bytes)")
            return _Rounds(r, rounds)

    # -- costs --------------------------------------------------------------------------------
    def fold_layout_regions(self) -> None:
        """A region that only casts, transposes, slices or broadcasts what a
        matmul then reads is done by the matmul's operand loads: the matmul reads
        the region's inputs instead, and the region is no kernel."""
        by_node: dict[int, list] = {}
        for val in self.values:
            for nid in val.nodes:
                by_node.setdefault(nid, []).append(val)
        for r in self.nodes:
            if r.kind != "compute" or r.unit != "vector" or r.info.get("computes") or r.info.get("folded"):
                continue
            vals = [v for v in by_node.get(r.id, []) if v.consumers - {r.id} or v.returned]
            consumers = set().union(*(v.consumers for v in vals)) - {r.id} if vals else set()
            if not consumers or any(v.returned for v in vals) or any(
                    self.nodes[c].unit != "cube" or self.nodes[c].kind != "compute" for c in consumers):
                continue
            mine = {v.id for v in vals}
            for c in consumers:
                node = self.nodes[c]
                for vid in mine:
                    node.reads.pop(vid, None)
                for vid, b in r.reads.items():
                    node.reads[vid] = max(node.reads.get(vid, 0), b)
                node.deps.discard(r.id)
                node.deps |= r.deps
            for v in vals:
                v.escapes = False
            r.info["folded"] = True
            r.flops = r.vector_us = 0.0
            r.reads = {}

    def finish(self) -> None:
        """Settles every compute node's bytes (reads, and the values it writes
        that leave it) and its time on the rank."""
        self.fold_layout_regions()
        writes = [0.0] * len(self.nodes)
        for val in self.values:
            if not val.escapes:
                continue
            for nid in val.nodes:
                writes[nid] += val.nbytes / len(val.nodes)
        sp = self.spec
        eta, eta_m = sp.compute_efficiency, sp.hbm_efficiency
        hbm = sp.hbm_gbps_per_rank * 1e3                              # B/us
        # A vector kernel streams through its cores: each moves reads + writes at
        # twice its copy rate (the op model's lane), and all of them at most HBM's rate.
        vec_bw = min(hbm, sp.vector_cores_per_rank * 2 * sp.core_copy_gbps * 1e3)
        for node in self.nodes:
            if node.kind != "compute":
                continue
            w = node.info.pop("writes", None)
            if node.info.get("folded"):
                node.bytes = node.time_us = node.hbm_bytes = 0.0
                continue
            written = (w if w is not None else writes[node.id] * self.scale_of(node))
            node.bytes = sum(node.reads.values()) * self.scale_of(node) + written
            node.reads = {}
            if "cube_us" in node.info:      # a fused kernel: cube and vector cores side by side
                t_flops = max(node.info.pop("cube_us"), node.vector_us) / eta
                t_mem = node.bytes / (eta_m * hbm)
            elif node.unit == "cube":
                peak = sp.cube_tflops_per_rank(node.info.get("dtype", "bfloat16")) * 1e6  # flops/us
                t_flops = node.flops / (eta * peak)
                t_mem = node.bytes / (eta_m * hbm)
            else:
                t_flops = node.vector_us / eta
                t_mem = node.bytes / (eta_m * vec_bw)
            node.info.pop("computes", None)
            node.info.pop("region", None)
            node.info["bound"] = "compute" if t_flops >= t_mem else "memory"
            node.time_us = max(t_flops, t_mem) + sp.kernel_launch_us
            node.hbm_bytes = node.bytes

    def scale_of(self, node) -> float:
        return node.info.get("scale", 1.0)


def matmul_flops(eqn) -> float:
    name = eqn.primitive.name
    a, b = eqn.invars[0].aval, eqn.invars[1].aval
    out = eqn.outvars[0].aval
    if name == "dot_general":
        (lc, _rc), _ = eqn.params["dimension_numbers"]
        k = math.prod(a.shape[d] for d in lc)
        return 2.0 * nelems(out) * k
    if name == "conv_general_dilated":
        # out elements x (kernel elements / output features) multiply-adds
        rhs = b.shape
        dn = eqn.params.get("dimension_numbers")
        out_feat = rhs[dn.rhs_spec[0]] if dn is not None else rhs[0]
        return 2.0 * nelems(out) * nelems(b) / max(1, out_feat)
    # ragged_dot: lhs [M, K] x rhs [G, K, N]: each row meets one group
    k = a.shape[-1]
    return 2.0 * nelems(out) * k


def weight(jaxpr) -> float:
    """A rough cost of a jaxpr (matmul flops + elements touched), to pick a cond's branch."""
    inner = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr
    total = 0.0
    for eqn in inner.eqns:
        if eqn.primitive.name in MATMUL:
            total += matmul_flops(eqn)
        else:
            total += sum(nelems(v.aval) for v in eqn.outvars)
        for key in ("jaxpr", "call_jaxpr", "body_jaxpr"):
            sub = eqn.params.get(key)
            if sub is not None and hasattr(sub.jaxpr if hasattr(sub, "jaxpr") else sub, "eqns"):
                total += weight(sub) * int(eqn.params.get("length", 1))
        for b in eqn.params.get("branches", ()):
            total += weight(b) / max(1, len(eqn.params["branches"]))
    return total


class _Rounds:
    """An op model result repeated back to back `rounds` times."""

    def __init__(self, r, rounds: int):
        self.time_us = r.time_us * rounds
        self.bytes_per_rank = r.bytes_per_rank * rounds
        self.busbw_gbps = r.busbw_gbps
        self.lane_busy_us = {k: [v * rounds for v in vs] for k, vs in r.lane_busy_us.items()}
        self.breakdown = {k: v * rounds for k, v in r.breakdown.items()}
