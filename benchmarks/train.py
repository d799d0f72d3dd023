"""`python -m benchmarks train`: one training step of a small MoE block, strata vs lax collectives.

The block (attention-free): out = (x + MoE(LayerNorm(x))) @ proj, loss = mean((out - y)^2).
The MoE FFN is expert parallel over a 1-D "expert" mesh: the router, layernorm and proj are
replicated (data parallel: their gradients are averaged with one bucketed all_reduce), the
experts are sharded (tokens reach them with all_to_all). The step (forward, backward, SGD) is
written once and takes a collectives backend: jax.lax's or strata's. The strata backend also uses
strata.moe.dispatch/combine (--no-strata-moe: the reference dispatch built from strata collectives).

Timing: every variant is compiled first; then --repeats rounds, each timing every variant in
turn (-w warm-up steps, then -n chained steps with params donated and fed back); the step time
is the median over rounds of the mean per step. Interleaving keeps load drift on a shared
machine from favouring whichever variant ran last.
#wrong: elements of the updated parameters after one step from the same start that differ
from the lax step by more than 1e-5 + 1e-4 |lax|.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time

import numpy as np

from . import common, style
from .common import Col, Report
from .moe import reference_combine, reference_dispatch, route
from .serve import add_model_args, model_config, ranks_for, simulate_modes, spec_for

AX = "expert"


class MoEBackend:
    """A collectives backend plus the dispatch/combine the MoE layer uses with it."""

    def __init__(self, coll, strata_moe=None):
        self.coll = coll
        self.strata_moe = strata_moe
        self.name = coll.name

    def dispatch(self, x, idx, *, num_experts, capacity):
        if self.strata_moe is not None:
            return self.strata_moe.dispatch(x, idx, axis_name=AX, num_experts=num_experts,
                                            capacity=capacity)
        return reference_dispatch(x, idx, axis_name=AX, num_experts=num_experts,
                                  capacity=capacity, coll=self.coll)

    def combine(self, ey, handle, w):
        if self.strata_moe is not None:
            return self.strata_moe.combine(ey, handle, w)
        return reference_combine(ey, handle, w, axis_name=AX, coll=self.coll)


def init_params(rng: np.random.Generator, h: int, f: int, e: int) -> dict:
    s = 1 / math.sqrt(h)
    return {
        "dense": {"ln_g": np.ones(h, np.float32), "ln_b": np.zeros(h, np.float32),
                  "router": (rng.standard_normal((h, e)) * s).astype(np.float32),
                  "proj": (rng.standard_normal((h, h)) * s).astype(np.float32)},
        "experts": {"w_in": (rng.standard_normal((e, h, f)) * s).astype(np.float32),
                    "w_out": (rng.standard_normal((e, f, h)) / math.sqrt(f)).astype(np.float32)},
    }


def make_step(backend: MoEBackend, *, n: int, top_k: int, capacity: int, lr: float):
    """The per-rank body of one SGD step, for any backend."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.flatten_util import ravel_pytree

    def loss_fn(dense, experts, x, y):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        hn = (x - mu) * lax.rsqrt(var + 1e-5) * dense["ln_g"] + dense["ln_b"]
        w, idx = route(hn, dense["router"], top_k)
        recv, handle = backend.dispatch(hn, idx, num_experts=dense["router"].shape[1],
                                        capacity=capacity)
        hid = jax.nn.gelu(jnp.einsum("ech,ehf->ecf", recv, experts["w_in"]))
        ey = jnp.einsum("ecf,efh->ech", hid, experts["w_out"])
        out = (x + backend.combine(ey, handle, w)) @ dense["proj"]
        return jnp.mean((out - y) ** 2)

    def step(params, x, y):
        # Differentiate w.r.t. a per-rank (varying) copy of the replicated weights so that JAX
        # does not insert its own psum: the data-parallel all_reduce is the backend's.
        dense_v = jax.tree.map(lambda p: lax.pcast(p, AX, to="varying"), params["dense"])
        loss, (g_dense, g_exp) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            dense_v, params["experts"], x, y)
        flat, unravel = ravel_pytree(g_dense)  # one bucket, as data-parallel trainers do
        g_dense = unravel(backend.coll.all_reduce(flat, AX) / n)
        loss = backend.coll.all_reduce(loss, AX) / n
        # Expert grads already hold every rank's tokens (the all_to_all transposes bring them).
        new = {"dense": jax.tree.map(lambda p, g: p - lr * g, params["dense"], g_dense),
               "experts": jax.tree.map(lambda p, g: p - lr * g / n, params["experts"], g_exp)}
        return new, loss

    return step


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-only", action="store_true",
                   help="no host run: model a DeepSeek-V3-shaped training step (forward + backward, data "
                        "and expert parallel) at full size on the supernode, both modes -> train_model.json")
    p.add_argument("--batch-per-npu", type=int, default=2,
                   help="--model-only: sequences per NPU (910C package) in one step (2)")
    p.add_argument("--seq", type=int, default=4096, help="--model-only: sequence length (4096)")
    add_model_args(p, capacity=False)
    p.add_argument("--tokens", type=common.int_at_least(1), default=512, help="tokens per rank (512)")
    p.add_argument("--hidden", type=common.int_at_least(1), default=256, help="hidden size (256)")
    p.add_argument("--ffn", type=common.int_at_least(1), default=512, help="expert FFN width (512)")
    p.add_argument("--experts", type=common.int_at_least(1), default=16, help="experts in all (16)")
    p.add_argument("--topk", type=common.int_at_least(1), default=2, help="experts per token (2)")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--npus", type=common.int_at_least(1), default=None,
                   help="emulated NPUs on the expert axis (8); with --model-only, 910C packages (64)")
    p.add_argument("-n", "--iters", type=common.int_at_least(1), default=10, help="timed steps (10)")
    p.add_argument("-w", "--warmup_iters", type=common.int_at_least(0), default=2,
                   help="warm-up steps (2)")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1),
                   help="compare one strata step with the lax step")
    common.add_mode_impl_args(p)
    p.add_argument("--strata-moe", action=argparse.BooleanOptionalAction, default=True,
                   help="the strata backend uses strata.moe.dispatch/combine, as a strata user "
                        "would (default); --no-strata-moe builds them from strata collectives")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--isolate", default="auto", choices=("auto", "on", "off"),
                   help="run the lax step in a child process (auto: when N > 64, where XLA's "
                        "own all_to_all rendezvous can abort the process)")
    p.add_argument("--child-timeout", type=float, default=1800, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)  # child -> parent (.npz)
    common.add_timing_args(p, 3, "interleaved timing rounds over the variants; the median "
                                 "round is reported (3)")
    common.add_output_args(p)
    common.one_line_errors(p, validate)


def validate(args, p) -> None:
    """Checks across arguments: one line and exit status 2, before any device starts."""
    if args.model_only:
        return
    n = args.npus if args.npus is not None else 8
    if args.experts % n:
        p.error(f"--experts {args.experts} must be a multiple of --npus {n}")
    if args.topk > args.experts:
        p.error(f"--topk {args.topk} must be in 1..--experts ({args.experts})")


def run(args) -> Report:
    if args.model_only:
        return run_model(args)
    if args.npus is None:
        args.npus = 8
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    n, t, h, f, e, k = args.npus, args.tokens, args.hidden, args.ffn, args.experts, args.topk
    if e % n:
        raise SystemExit(f"--experts {e} must be a multiple of --npus {n}")
    cap = math.ceil(args.capacity_factor * n * t * k / e)
    impls = common.impls_from_arg(args.impl)
    modes = common.modes_from_arg(args.mode)
    strata, _ = common.load_strata()
    mesh = common.make_mesh((n,), (AX,))
    specs = {"dense": P(), "experts": P(AX)}

    rng = np.random.default_rng(args.seed)
    params_np = init_params(rng, h, f, e)
    x_np = rng.standard_normal((n * t, h)).astype(np.float32)
    y_np = rng.standard_normal((n * t, h)).astype(np.float32)
    shard = NamedSharding(mesh, P(AX))
    x, y = jax.device_put(x_np, shard), jax.device_put(y_np, shard)

    def put_params():
        return {"dense": jax.device_put(params_np["dense"], NamedSharding(mesh, P())),
                "experts": jax.device_put(params_np["experts"], shard)}

    n_params = sum(a.size for d in params_np.values() for a in d.values())
    prm = {"npus": n, "tokens": t, "hidden": h, "ffn": f, "experts": e, "topk": k,
           "capacity": cap, "lr": args.lr, "params": int(n_params), "iters": args.iters,
           "warmup": args.warmup_iters, "repeats": args.repeats, "sync_every": args.sync_every,
           "strata_moe": args.strata_moe, "impls": impls, "modes": modes}
    report = Report("train", prm, env=common.environment())
    lax_in_child = "lax" in impls and _isolated(args)
    variants = ([("lax", None)] if "lax" in impls and not lax_in_child else []) + \
               ([("strata", m) for m in modes] if "strata" in impls else [])
    ref_params = None
    if lax_in_child:
        lax_row, ref_params = _lax_in_child(args, prm)
        report.rows.append(lax_row)
    # Compile every variant and take one step from the shared start (the comparison), then
    # time them in interleaved rounds so that load drift on a shared machine hits all alike.
    prepared = []  # [row, jitted step, mode context factory, current (params, x, y)]
    for impl, mode in variants:
        row = {"impl": impl, "mode": mode, "status": "ok", "reason": None, **{
            kk: prm[kk] for kk in ("npus", "tokens", "hidden", "ffn", "experts", "topk")}}
        report.rows.append(row)
        try:
            if impl == "lax":
                backend, ctx = MoEBackend(common.LaxCollectives()), contextlib.nullcontext
            else:
                ctx = lambda m=mode: common.strata_mode_context(strata, m)  # noqa: E731
                ctx()  # a mode the library refuses is a skip, found here
                moe_mod = None
                if args.strata_moe:
                    moe_mod = getattr(strata, "moe", None)
                    if moe_mod is None:
                        raise common.Skip("strata.moe not available")
                backend = MoEBackend(common.StrataCollectives(strata), moe_mod)
            body = make_step(backend, n=n, top_k=k, capacity=cap, lr=args.lr)
            step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(AX), P(AX)),
                                         out_specs=(specs, P())), donate_argnums=0)
            with ctx():
                t0 = time.perf_counter()
                new, loss = jax.block_until_ready(step(put_params(), x, y))
                row["first_call_s"] = time.perf_counter() - t0
            new_np = jax.tree.map(np.asarray, new)
            row["loss"] = float(loss)
        except Exception as ex:
            row.update(common.failure(ex))
            continue
        if impl == "lax":
            ref_params = _flat(new_np)
        elif args.check and ref_params is not None:
            a = np.concatenate([v.ravel() for v in _flat(new_np)])
            b = np.concatenate([v.ravel() for v in ref_params])
            row["wrong"] = int(np.count_nonzero(np.abs(a - b) > 1e-5 + 1e-4 * np.abs(b)))
            row["max_abs_diff"] = float(np.max(np.abs(a - b)))
        prepared.append([row, step, ctx, (put_params(), x, y)])

    bar = common.progress(range(args.repeats * len(prepared)), desc="train",
                          disable=args.no_progress)
    tick = iter(bar)
    for _ in range(args.repeats):
        for item in prepared:
            next(tick, None)
            row, step, ctx, state = item
            if row["status"] != "ok":
                continue
            try:
                with ctx():
                    halves = 2 if args.iters >= 2 else 1  # two blocks: a spread per round
                    timing, (_, state) = common.time_calls(
                        step, state, iters=-(-args.iters // halves), warmup=args.warmup_iters,
                        repeats=halves,
                        max_seconds=args.max_seconds, first_call=False,
                        sync_every=args.sync_every,
                        chain=lambda a, out: (out[0], a[1], a[2]))
            except Exception as ex:
                row.update(common.failure(ex))
                continue
            item[3] = state
            row.setdefault("rounds_ms", []).append(float(np.mean(timing.blocks_us)) / 1e3)
            row.setdefault("blocks_ms", []).extend(b / 1e3 for b in timing.blocks_us)
            row["iters"] = timing.iters * len(timing.blocks_us)
    if hasattr(bar, "close"):
        bar.close()
    if args.trace:
        _trace_steps(prepared, strata, args.trace, prm)
    for row in report.rows:
        if row["status"] == "ok" and row.get("rounds_ms"):
            row["step_ms"] = float(np.median(row["rounds_ms"]))
            row["spread_ms"] = style.spread(row.get("blocks_ms") or row["rounds_ms"])
            row["tokens_per_s"] = n * t / (row["step_ms"] * 1e-3)
    if args.child_out:  # a child of an isolated run: hand the lax row and parameters back
        np.savez(args.child_out, row=json.dumps(common.jsonable(report.rows[0])),
                 **({f"p{i}": a for i, a in enumerate(_flat(ref_params))} if ref_params else {}))
    lax_row = next((r for r in report.rows if r["impl"] == "lax" and r["status"] == "ok"), None)
    for r in report.rows:
        if r["impl"] == "strata" and r["status"] == "ok" and lax_row:
            _, sp, within = common.fmt_speedup(lax_row["step_ms"], r["step_ms"],
                                               lax_row.get("spread_ms", 0.0), r.get("spread_ms", 0.0))
            r.update(lax_step_ms=lax_row["step_ms"], lax_spread_ms=lax_row.get("spread_ms"),
                     speedup=sp, speedup_within_noise=within)
    report.emit(common.fit_width(_table(report, prm)))
    return report


def run_model(args) -> Report:
    """The DeepSeek-shaped training step (benchmarks/deepseek.py, the code tests/test_deepseek.py
    runs for real at a tiny size) traced at full size and timed by the step model."""
    import os

    import stratacl_jax as strata

    from . import deepseek

    if args.npus is None:
        args.npus = 64
    spec = spec_for(args)
    ranks = ranks_for(args, spec)
    if args.batch_per_npu < 1 or args.batch_per_npu % spec.ranks_per_npu:
        raise SystemExit(f"train: --batch-per-npu {args.batch_per_npu} must be a positive multiple of the "
                         f"{spec.ranks_per_npu} ranks of an NPU")
    if args.seq < 1:
        raise SystemExit(f"train: --seq must be positive, got {args.seq}")
    b_rank = args.batch_per_npu // spec.ranks_per_npu
    cfg = model_config(args, param_dtype="bfloat16") if args.model == "deepseek-v3" else model_config(args)
    mesh = strata.emulator.abstract_mesh((ranks,), ("ep",), spec=spec)
    fn, specs = deepseek.train_step(cfg, mesh, batch_per_rank=b_rank, seq_len=args.seq)
    prm = {"npus": args.npus, "ranks": ranks, "rank": args.rank, "model": args.model, "seq": args.seq,
           "batch_per_npu": args.batch_per_npu, "spec": spec.name, "compute_efficiency": spec.compute_efficiency,
           "hbm_efficiency": spec.hbm_efficiency, "kernel_launch_us": spec.kernel_launch_us,
           "capacity_factor": cfg.capacity_factor,
           "published": "StrataCL (arXiv 2607.26444): LLM training iterations 1.4x faster than with the vendor "
                        "library in production (a ratio; no step time published)"}
    report = Report("train_model", prm, env=common.environment())
    trace = args.trace or (os.path.join(args.out, "train_model_trace.json") if args.out else None)
    simulate_modes(fn, specs, spec, {"batch_per_npu": args.batch_per_npu, "seq": args.seq}, report.rows, trace)
    for r in report.rows:
        r["iteration_ms"] = r["step_ms"]
        r["tokens_per_s_per_npu"] = args.batch_per_npu * args.seq / (r["step_ms"] / 1e3)
        report.top[r["mode"]] = {"iteration_ms": r["iteration_ms"], "tokens_per_s_per_npu": r["tokens_per_s_per_npu"],
                                 "exposed_comm_ms": r["exposed_comm_ms"]}
    cols = [Col("mode", "mode", "", "", 14), Col("iteration_ms", "iteration", "(ms)", ".1f", 9),
            Col("tokens_per_s_per_npu", "tok/s", "/NPU", ".0f", 7), Col("compute_ms", "compute", "(ms)", ".1f", 8),
            Col("comm_ms", "comm", "(ms)", ".1f", 7), Col("exposed_comm_ms", "exposed", "(ms)", ".1f", 7),
            Col("cube_ms", "cube", "(ms)", ".1f", 7), Col("vector_ms", "vector", "(ms)", ".1f", 7),
            Col("simulate_s", "sim", "(s)", ".1f", 5)]
    bc, st = report.top["buffer_centric"]["iteration_ms"], report.top["strata"]["iteration_ms"]
    foot = [f"buffer_centric / strata: {bc / st:.3f}x (the paper reports 1.4x for LLM training in production)",
            f"compute efficiency {spec.compute_efficiency}, HBM efficiency {spec.hbm_efficiency}, kernel launch "
            f"{spec.kernel_launch_us} us (assumed: docs/step_model.md)"]
    if trace:
        foot.append(f"trace of the strata step: {trace} (open in ui.perfetto.dev)")
    title = (f"{args.model} training step (forward + backward) modeled on {spec.name}: {args.npus} NPUs = {ranks} "
             f"ranks (a rank is a {args.rank}), {args.batch_per_npu} x {args.seq} tokens per NPU")
    report.emit(common.fit_width(common.render_table(cols, report.rows, title=title, footer=foot)))
    return report


def _flat(params) -> list:
    import jax

    return list(jax.tree.leaves(params))


def _isolated(args) -> bool:
    return args.npus > 64 if args.isolate == "auto" else args.isolate == "on"


def _lax_in_child(args, prm) -> tuple[dict, list | None]:
    """The lax step in a child process: at 384 devices XLA aborts the process in its own
    all_to_all rendezvous (SIGABRT), which must cost the lax cells, not the run."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "lax.npz")
        rc, err = common.run_child("train", [*args._argv, "--impl", "lax", "--isolate", "off",
                                             "--child-out", out], args.child_timeout)
        if rc == 0 and os.path.exists(out):
            with np.load(out) as z:
                row = json.loads(str(z["row"]))
                params = [z[f"p{i}"] for i in range(len(z.files) - 1)] or None
            return row, params
    why = common.child_failure(rc, err)
    status = "aborted" if common.child_aborted(rc, why) else "error"
    row = {"impl": "lax", "mode": None, "status": status, "reason": why,
           **{k: prm[k] for k in ("npus", "tokens", "hidden", "ffn", "experts", "topk")}}
    return row, None


COLS = [Col("name", "collectives", "", "", 27), Col("step_cell", "step", "(ms)", "", 13),
        Col("tokens_per_s", "tokens/s", "", ".0f", 9), Col("loss", "loss", "", ".5f", 9),
        Col("wrong", "#wrong", "", "d", 6), Col("max_abs_diff", "max |d|", "", ".1e", 8),
        Col("lax_cell", "lax step", "(ms)", "", 13),
        Col("sp_cell", "speedup", "(x lax)", "", 7)]


def _ms(v, noise) -> str:
    """A step time in ms with its spread ('12.34 ±0.56')."""
    if v is None:
        return "N/A"
    return f"{v:.2f} ±{noise:.2f}" if noise else f"{v:.2f}"


def _label(r) -> str:
    return style.series("lax" if r["impl"] == "lax" else
                        ("strata" if r["mode"] == "strata" else r["mode"]))["label"]


def _trace_steps(prepared, strata, path: str, prm: dict) -> None:
    """One traced step per strata variant: its ops on this host and modeled on the
    supernode; the strata-mode trace goes to `path`."""
    import jax

    em = getattr(strata, "emulator", None) if strata is not None else None
    if em is None or not hasattr(em, "trace"):
        return
    for item in prepared:
        row, step, ctx, state = item
        if row["impl"] != "strata" or row["status"] != "ok":
            continue
        try:
            with ctx(), em.trace(path if row["mode"] == "strata" else None) as tr:
                if hasattr(tr, "simulate"):  # the whole step on the modeled timeline too
                    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                          state)
                    modeled = tr.simulate(step, *shapes, mode=row["mode"])
                    row["modeled_step_ms"] = modeled.time_us / 1e3
                    row["modeled_exposed_comm_ms"] = modeled.exposed_comm_us / 1e3
                out = jax.block_until_ready(step(*state))
        except Exception as ex:
            row["trace_error"] = common.one_line(ex)
            continue
        item[3] = (out[0], state[1], state[2])
        row["traced_ops"] = len(tr.ops)
        row["traced_host_comm_ms"] = sum(o.host_us for o in tr.ops) / 1e3
        for m in ("strata", "buffer_centric"):
            row[f"modeled_comm_{m}_ms"] = sum(o.modeled_us.get(m) or 0.0 for o in tr.ops) / 1e3
        if row["mode"] == "strata":
            prm["trace_path"] = path
            prm["trace_summary"] = tr.summary()


def _table(report: Report, p: dict) -> str:
    rows = []
    for r in report.rows:
        t = dict(r, name=_label(r), step_cell=_ms(r.get("step_ms"), r.get("spread_ms")))
        if r.get("lax_step_ms") is not None:
            t["lax_cell"] = _ms(r["lax_step_ms"], r.get("lax_spread_ms"))
            t["sp_cell"] = "≈1" if r.get("speedup_within_noise") else f"{r['speedup']:.2f}"
        if r["status"] != "ok":
            t["_note"] = f"{r['status']}: {r['reason']}"
        rows.append(t)
    title = (f"MoE block training step (fwd+bwd+SGD): N={p['npus']} tokens/rank={p['tokens']} "
             f"hidden={p['hidden']} ffn={p['ffn']} experts={p['experts']} top-k={p['topk']} "
             f"capacity={p['capacity']} params={p['params']}")
    foot = ["step: median of the rounds, ± half the range of every timed block; speedup = lax step "
            "/ strata step, ≈1 when the difference is within the two spreads",
            "#wrong: updated parameters differing from the lax step by > 1e-5 + 1e-4|lax|",
            "strata rows dispatch/combine tokens with " + (
                "strata.moe (--no-strata-moe: built from strata collectives)" if p["strata_moe"]
                else "the reference dispatch built from strata collectives (--no-strata-moe)")]
    for r in report.rows:
        if r.get("traced_ops"):
            foot.append(f"strata {r['mode']}: one traced step, {r['traced_ops']} strata ops, "
                        f"{r['traced_host_comm_ms']:.2f} ms of them on this host; modeled on "
                        f"cloudmatrix384: {r['modeled_comm_strata_ms']:.3f} ms (strata), "
                        f"{r['modeled_comm_buffer_centric_ms']:.3f} ms (buffer_centric)")
        if r.get("modeled_step_ms"):
            foot.append(f"strata {r['mode']}: the whole step (compute + communication) modeled on "
                        f"cloudmatrix384: {r['modeled_step_ms']:.3f} ms, "
                        f"{r['modeled_exposed_comm_ms']:.3f} ms of it communication no compute hides")
    if p.get("trace_path"):
        foot.append(f"trace of the strata step: {p['trace_path']} (open in ui.perfetto.dev)")
    return common.render_table(COLS, rows, title=title, footer=foot)


def plot(report: Report, path: str) -> None:
    """Step time per variant, ± spread, colours and labels from style; a variant with no value
    (failed, skipped) is a hatched n/a stub, not left out."""
    if report.name == "train_model":
        return _plot_model(report, path)
    plt = common.pyplot()
    rows = report.rows
    ok = [r for r in rows if r["status"] == "ok" and r.get("step_ms")]
    if not ok:
        return
    fig, a = plt.subplots(figsize=(6.4, 3.6))
    top = max(r["step_ms"] for r in ok)
    names = [_label(r) for r in rows]
    for i, r in enumerate(rows):
        st = style.series("lax" if r["impl"] == "lax" else
                          ("strata" if r["mode"] == "strata" else r["mode"]))
        if r in ok:
            a.bar([i], [r["step_ms"]], yerr=[r.get("spread_ms") or 0.0], capsize=4,
                  color=st["color"])
            if r.get("speedup"):
                text = "≈ lax (within noise)" if r.get("speedup_within_noise") else \
                    f"{r['speedup']:.2f}x vs lax"
                a.annotate(text, (i, r["step_ms"] + (r.get("spread_ms") or 0.0)), ha="center",
                           va="bottom", fontsize=8)
        else:
            a.bar([i], [0.05 * top], color="none", edgecolor=st["color"], hatch="//")
            a.annotate(f"n/a ({r['status']})", (i, 0.06 * top), ha="center", va="bottom",
                       fontsize=8)
    a.set_xticks(range(len(rows)), names, fontsize=8)
    a.set_ylim(0, 1.2 * max(r["step_ms"] + (r.get("spread_ms") or 0.0) for r in ok))
    p = report.params
    a.set_ylabel("step time (ms), ± spread")
    a.set_title(f"MoE training step, N={p['npus']}, {p['tokens']} tok/rank, H={p['hidden']}",
                fontsize=10)
    a.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_model(report: Report, path: str) -> None:
    """The modeled iteration per mode: compute, and the communication no compute hides."""
    plt = common.pyplot()
    p = report.params
    fig, a = plt.subplots(figsize=(6, 3.5))
    names = [r["mode"] for r in report.rows]
    comp = [r["step_ms"] - r["exposed_comm_ms"] for r in report.rows]
    exposed = [r["exposed_comm_ms"] for r in report.rows]
    names = [style.series(m)["label"] for m in names]
    a.bar(names, comp, color="tab:green", label="compute (and hidden communication)")
    a.bar(names, exposed, bottom=comp, color="tab:red", label="exposed communication")
    for i, r in enumerate(report.rows):
        a.annotate(f"{r['step_ms']:.0f} ms", (i, r["step_ms"]), ha="center", va="bottom")
    a.set_ylim(0, 1.2 * max(r["step_ms"] for r in report.rows))
    a.set_ylabel("iteration (ms)")
    a.set_title(f"{p['model']} training step, {p['npus']} NPUs (modeled on {p['spec']})", fontsize=9)
    a.legend(fontsize=8)
    a.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
