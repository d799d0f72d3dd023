"""`python -m benchmarks moe`: expert-parallel dispatch, combine and the whole MoE layer.

strata.moe.dispatch/combine/expert_parallel_ffn against a reference written with jax.lax
collectives (all_gather of per-expert counts + all_to_all of tokens), same semantics as the API:
recv_x [E_local, capacity, H], rows ordered by (source rank, source token, k), drops counted.

Bandwidth (DeepEP's definition, made exact here): bytes of tokens received, a token counted once
per destination rank (the accepted (token, k) pairs' distinct (token, rank) pairs x H x itemsize),
averaged over ranks, divided by the time; combine sends the same rows back. These are the bytes
the runtime moves between ranks (DeepEP's rule: a token crosses to a rank once and is copied to
that rank's experts there; combine sums them there first). The JSON also has the slot rows
(`recv_bytes_per_rank`: accepted pairs x H x itemsize).

#wrong for dispatch and combine is exact: tokens are small integers, expert outputs small
integers and top-k weights powers of two, so every weighted sum is exact in any order. The
whole layer (softmax, matmuls) is compared with a tolerance (|d| <= 1e-3 + 1e-3 |ref|).
"""

from __future__ import annotations

import argparse
import contextlib
import math

import numpy as np

from . import common, modeled, style
from .common import Col, Report

MOE_OPS = ("dispatch", "combine", "layer")


# ----------------------------------------------------------------------------------------------
# The lax reference (also used, with either collectives backend, by the training benchmark)


def reference_dispatch(x, topk_idx, *, axis_name, num_experts, capacity, coll=None):
    """dispatch() of the API written with plain collectives. Returns (recv_x, handle)."""
    import jax.numpy as jnp
    from jax import lax

    coll = coll or common.LaxCollectives()
    t, h = x.shape
    k = topk_idx.shape[1]
    n = lax.axis_size(axis_name)
    rank = lax.axis_index(axis_name)
    el = num_experts // n
    c = capacity

    # Routing bookkeeping is integer-only: keep it out of differentiation.
    e = lax.stop_gradient(topk_idx).reshape(-1).astype(jnp.int32)  # pairs in (t, k) order
    onehot = (e[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None]).astype(jnp.int32)
    counts = onehot.sum(0)  # [E] pairs of this rank per expert
    all_counts = coll.all_gather(counts, axis_name, axis=0, tiled=False)  # [N, E]
    before = jnp.take(jnp.cumsum(all_counts, 0) - all_counts, rank, axis=0)  # lower ranks' pairs
    earlier = ((jnp.cumsum(onehot, 0) - onehot) * onehot).sum(1)  # this rank's earlier pairs
    slot = before[e] + earlier
    accepted = slot < c
    dest = jnp.where(accepted, e // el, -1).reshape(t, k)
    local_slot = ((e % el) * c + slot).reshape(t, k)

    to_rank = dest[None] == jnp.arange(n, dtype=jnp.int32)[:, None, None]  # [N, T, K]
    send_meta = jnp.where(to_rank, local_slot[None], -1)
    send_x = jnp.where(to_rank.any(-1)[..., None], x[None], jnp.zeros((), x.dtype))  # [N, T, H]
    recv_tok = coll.all_to_all(send_x, axis_name, 0, 0)  # [N_src, T, H]
    recv_meta = coll.all_to_all(send_meta, axis_name, 0, 0)  # [N_src, T, K]

    # Each expert slot records the (source, token, k) pair it holds; it takes its row from
    # (source, token) with one gather of E_local*capacity rows, not a K-fold scatter.
    invalid = el * c
    pair_id = jnp.arange(n * t * k, dtype=jnp.int32)
    slot_pair = jnp.full((el * c,), n * t * k, jnp.int32).at[
        jnp.where(recv_meta >= 0, recv_meta, invalid).reshape(-1)].set(pair_id, mode="drop")
    slot_src = jnp.where(slot_pair < n * t * k, slot_pair // k, n * t)
    recv_x = jnp.take(recv_tok.reshape(n * t, h), slot_src, axis=0, mode="fill", fill_value=0)

    total = all_counts.sum(0)
    recv_counts = jnp.minimum(lax.dynamic_slice_in_dim(total, rank * el, el), c)
    handle = {"dest": dest, "slot_pair": slot_pair, "recv_counts": recv_counts.astype(jnp.int32),
              "dropped": jnp.sum(~accepted).astype(jnp.int32)}
    return recv_x.reshape(el, c, h), handle


def reference_combine(expert_y, handle, topk_weights, *, axis_name, coll=None):
    """combine() of the API: y[t] = sum_k w[t,k] * expert_y[slot of (t,k)]; drops give 0.
    The expert side weights its rows and scatter-adds them into per-source token rows, which
    one all_to_all sends home, where the N partial sums are added."""
    import jax.numpy as jnp
    from jax import lax

    coll = coll or common.LaxCollectives()
    el, c, h = expert_y.shape
    n = lax.axis_size(axis_name)
    dest, slot_pair = handle["dest"], handle["slot_pair"]
    t, k = dest.shape
    w = topk_weights.astype(expert_y.dtype)
    to_rank = dest[None] == jnp.arange(n, dtype=jnp.int32)[:, None, None]
    recv_w = coll.all_to_all(jnp.where(to_rank, w[None], 0), axis_name, 0, 0)  # [N_src, T, K]
    w_slot = jnp.take(recv_w.reshape(-1), slot_pair, mode="fill", fill_value=0)  # [E_l*C]
    slot_src = jnp.where(slot_pair < n * t * k, slot_pair // k, n * t)
    partial = jnp.zeros((n * t, h), expert_y.dtype).at[slot_src].add(
        w_slot[:, None] * expert_y.reshape(el * c, h), mode="drop")
    back = coll.all_to_all(partial.reshape(n, t, h), axis_name, 0, 0)  # [N_dest, T, H]
    return back.sum(0)


def route(x, router_w, top_k):
    """Router used by the reference layer: softmax over experts, top-k, renormalised."""
    import jax
    from jax import lax

    probs = jax.nn.softmax((x @ router_w).astype("float32"), axis=-1)
    w, idx = lax.top_k(probs, top_k)
    return (w / w.sum(-1, keepdims=True)).astype(x.dtype), idx.astype("int32")


def reference_layer(x, router_w, w_in, w_out, *, axis_name, top_k, capacity, coll=None):
    """A complete expert-parallel FFN from the reference dispatch/combine (gelu experts).
    Used as the lax layer when strata.moe.reference_expert_parallel_ffn is not there."""
    import jax
    import jax.numpy as jnp

    w, idx = route(x, router_w, top_k)
    num_experts = router_w.shape[1]
    recv, handle = reference_dispatch(x, idx, axis_name=axis_name, num_experts=num_experts,
                                      capacity=capacity, coll=coll)
    hid = jax.nn.gelu(jnp.einsum("ech,ehf->ecf", recv, w_in))
    ey = jnp.einsum("ecf,efh->ech", hid, w_out)
    return reference_combine(ey, handle, w, axis_name=axis_name, coll=coll)


# ----------------------------------------------------------------------------------------------
# Exact expectations in numpy


def np_route_slots(idx_all: np.ndarray, num_experts: int, capacity: int):
    """Slot of every (src, t, k) pair in global order, and whether it was accepted."""
    e = idx_all.reshape(-1).astype(np.int64)
    order = np.argsort(e, kind="stable")
    se = e[order]
    first = np.searchsorted(se, se, side="left")
    slot = np.empty_like(e)
    slot[order] = np.arange(e.size) - first
    return e, slot, slot < capacity


def np_dispatch(x_all, e, slot, acc, k, num_experts, capacity):
    n, t, h = x_all.shape
    recv = np.zeros((num_experts, capacity, h), x_all.dtype)
    src_tok = np.arange(e.size) // k
    recv[e[acc], slot[acc]] = x_all.reshape(n * t, h)[src_tok[acc]]
    counts = np.minimum(np.bincount(e, minlength=num_experts), capacity).astype(np.int32)
    dropped = (~acc).reshape(n, -1).sum(1).astype(np.int32)
    return recv, counts, dropped


def np_combine(ey_all, w_all, e, slot, acc, dtype):
    n, t, k = w_all.shape
    h = ey_all.shape[-1]
    y = np.zeros((n * t, h), np.float64)
    e2, s2, a2 = e.reshape(n * t, k), slot.reshape(n * t, k), acc.reshape(n * t, k)
    w2 = w_all.reshape(n * t, k).astype(np.float64)
    for j in range(k):
        ok = a2[:, j]
        y[ok] += w2[ok, j, None] * ey_all[e2[ok, j], s2[ok, j]].astype(np.float64)
    return y.astype(dtype).reshape(n, t, h)


# ----------------------------------------------------------------------------------------------
# Running


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=common.int_at_least(1), default=1024, help="tokens per rank (1024)")
    p.add_argument("--hidden", type=common.int_at_least(1), default=1024, help="hidden size H (1024)")
    p.add_argument("--topk", type=common.int_at_least(1), default=8, help="experts per token (8)")
    p.add_argument("--experts", type=common.int_at_least(1), default=64, help="experts in all (64)")
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="capacity = ceil(cf * N * tokens * topk / experts) rows per expert")
    p.add_argument("--ffn", type=common.int_at_least(1), default=256, help="expert FFN width for the layer (256)")
    p.add_argument("--npus", type=common.int_at_least(1), default=8, help="emulated NPUs (8)")
    p.add_argument("-d", "--datatype", default="float32",
                   choices=("float32", "float16", "bfloat16", "float64", "float", "half", "bf16",
                            "double", "fp32", "fp16"),
                   help="token dtype (float32)")
    p.add_argument("-n", "--iters", type=common.int_at_least(1), default=5, help="timed calls (5)")
    p.add_argument("-w", "--warmup_iters", type=common.int_at_least(0), default=2,
                   help="warm-up calls (2)")
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1), help="check results")
    p.add_argument("--ops", default="all", type=common.list_arg(MOE_OPS, "--ops"),
                   help="comma list of dispatch, combine, layer; or all")
    common.add_mode_impl_args(p)
    p.add_argument("--seed", type=int, default=0)
    common.add_timing_args(p)
    modeled.add_model_args(p, npus_default="8,16,32,64,128", sizes=False)
    common.add_output_args(p)
    common.one_line_errors(p, validate)


def validate(args, p) -> None:
    """Checks across arguments: one line and exit status 2, before any device starts."""
    if getattr(args, "model_only", False):
        return
    if args.experts % args.npus:
        p.error(f"--experts {args.experts} must be a multiple of --npus {args.npus}")
    if args.topk > args.experts:
        p.error(f"--topk {args.topk} must be in 1..--experts ({args.experts})")


def _blocks(args) -> tuple[int, int]:
    """(calls per block, blocks): at least two blocks when -n >= 2, so a time has a spread."""
    blocks = max(args.repeats, 2 if args.iters >= 2 else 1)
    return (-(-args.iters // blocks) if args.repeats < 2 else args.iters), blocks


def _expand(tree):
    """Per-rank pytree -> leaves with a leading rank axis, so shard_map can return scalars."""
    import jax

    return jax.tree.map(lambda a: a[None], tree)


def _squeeze(tree):
    import jax

    return jax.tree.map(lambda a: a[0], tree)


def _strata_moe(strata, name):
    moe = getattr(strata, "moe", None) if strata is not None else None
    if strata is None:
        raise common.Skip(common.load_strata()[1])
    if moe is None or not hasattr(moe, name):
        raise common.Skip(f"strata.moe.{name} not available")
    return getattr(moe, name)


def run(args) -> Report:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from .collectives import DTYPE_ALIASES, np_dtype

    if getattr(args, "model_only", False):
        # DeepEP's test shape unless the command line asks for another one.
        given = set(getattr(args, "_argv", []))
        for flag, key in (("--tokens", "tokens"), ("--hidden", "hidden"), ("--topk", "top_k"),
                          ("--experts", "num_experts")):
            if flag not in given:
                setattr(args, flag[2:], modeled.DEEPEP[key])
        if not ({"-d", "--datatype"} & given):
            args.datatype = modeled.DEEPEP["dtype"]
        return modeled.moe_sweep(args)
    n = args.npus
    tkn, h, k, ne = args.tokens, args.hidden, args.topk, args.experts
    if ne % n:
        raise SystemExit(f"--experts {ne} must be a multiple of --npus {n}")
    if not 1 <= k <= ne:
        raise SystemExit("--topk must be in 1..experts")
    dtype = DTYPE_ALIASES.get(args.datatype, args.datatype)
    if dtype not in ("float32", "float16", "bfloat16", "float64"):
        raise SystemExit("--datatype: a float dtype")
    if dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    dt = np_dtype(dtype)
    el = ne // n
    cap = math.ceil(args.capacity_factor * n * tkn * k / ne)
    ops = common.split_list(args.ops, MOE_OPS, "--ops")
    impls = common.impls_from_arg(args.impl)
    modes = common.modes_from_arg(args.mode)
    strata, strata_reason = common.load_strata()
    ax = "expert"
    mesh = common.make_mesh((n,), (ax,))
    shard = NamedSharding(mesh, P(ax))
    repl = NamedSharding(mesh, P())

    # Inputs: exact-valued tokens, routing with distinct experts per token, power-of-2 weights.
    rng = np.random.default_rng(args.seed)
    x_all = rng.integers(-8, 9, (n, tkn, h)).astype(dt)
    idx_all = np.argsort(rng.random((n * tkn, ne)), axis=1)[:, :k].astype(np.int32)
    idx_all = idx_all.reshape(n, tkn, k)
    w_all = (2.0 ** -rng.integers(0, 4, (n, tkn, k))).astype(dt)
    ey_all = rng.integers(-4, 5, (ne, cap, h)).astype(dt)
    e, slot, acc = np_route_slots(idx_all, ne, cap)
    accepted = int(acc.sum())
    recv_bytes = accepted * h * dt.itemsize / n  # per rank, averaged
    dest_rank = (e // el).reshape(n * tkn, k)
    deepep = sum(len(set(dest_rank[i][acc.reshape(n * tkn, k)[i]])) for i in range(n * tkn))
    deepep_bytes = deepep * h * dt.itemsize / n  # per rank, averaged
    exp_recv = exp_counts = exp_drop = exp_y = None
    if args.check:
        exp_recv, exp_counts, exp_drop = np_dispatch(x_all, e, slot, acc, k, ne, cap)
        exp_y = np_combine(ey_all, w_all, e, slot, acc, dt)

    x = jax.device_put(x_all.reshape(n * tkn, h), shard)
    idx = jax.device_put(idx_all.reshape(n * tkn, k), shard)
    w = jax.device_put(w_all.reshape(n * tkn, k), shard)
    ey = jax.device_put(ey_all, shard)
    # Layer parameters: random floats (the layer is checked with a tolerance).
    lrng = np.random.default_rng(args.seed + 1)
    xf = jax.device_put((lrng.standard_normal((n * tkn, h))).astype(dt), shard)
    router = jax.device_put((lrng.standard_normal((h, ne)) / math.sqrt(h)).astype(dt), repl)
    w_in = jax.device_put((lrng.standard_normal((ne, h, args.ffn)) / math.sqrt(h)).astype(dt),
                          shard)
    w_out = jax.device_put(
        (lrng.standard_normal((ne, args.ffn, h)) / math.sqrt(args.ffn)).astype(dt), shard)

    params = {"npus": n, "tokens": tkn, "hidden": h, "topk": k, "experts": ne,
              "experts_per_rank": el, "capacity": cap, "capacity_factor": args.capacity_factor,
              "ffn": args.ffn, "dtype": dtype, "accepted_pairs": accepted,
              "dropped_pairs": int((~acc).sum()), "recv_bytes_per_rank": recv_bytes,
              "deepep_bytes_per_rank": deepep_bytes, "iters": args.iters,
              "warmup": args.warmup_iters, "repeats": args.repeats,
              "sync_every": args.sync_every, "ops": ops, "impls": impls, "modes": modes}
    report = Report("moe", params, env=common.environment())

    def smap(body, in_specs, out_specs):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))

    def fns(impl):
        """(dispatch, combine, layer, layer_name) bodies for one implementation."""
        if impl == "lax":
            disp = lambda a, b: reference_dispatch(a, b, axis_name=ax, num_experts=ne,
                                                   capacity=cap)
            comb = lambda y, hd, ww: reference_combine(y, hd, ww, axis_name=ax)
            lay = getattr(getattr(strata, "moe", None), "reference_expert_parallel_ffn", None)
            name = "strata.moe.reference_expert_parallel_ffn"
            if lay is None:
                lay, name = reference_layer, "benchmarks.moe.reference_layer"
            return disp, comb, lay, name

        def disp(a, b):
            return _strata_moe(strata, "dispatch")(a, b, axis_name=ax, num_experts=ne,
                                                   capacity=cap)

        def comb(y, hd, ww):
            return _strata_moe(strata, "combine")(y, hd, ww)

        return disp, comb, _strata_moe(strata, "expert_parallel_ffn"), "strata.moe"

    variants = ([("lax", None)] if "lax" in impls else []) + \
               ([("strata", m) for m in modes] if "strata" in impls else [])
    results: dict[tuple, dict] = {}
    layer_ref_out = None
    bar = common.progress(range(len(ops) * len(variants)), desc="moe", disable=args.no_progress)
    bar_it = iter(bar)
    for impl, mode in variants:
        handle = None
        for op in ops:
            next(bar_it, None)
            row = {"op": op, "impl": impl, "mode": mode, "status": "ok", "reason": None,
                   "npus": n, "tokens": tkn, "hidden": h, "topk": k, "experts": ne,
                   "capacity": cap, "dtype": dtype}
            results[(op, impl, mode)] = row
            report.rows.append(row)
            try:
                if impl == "strata":
                    ctx = common.strata_mode_context(strata, mode)
                else:
                    ctx = contextlib.nullcontext()
                disp, comb, lay, lay_name = (None,) * 4
                with ctx:
                    if op in ("dispatch", "combine") and handle is None:
                        disp = fns(impl)[0]
                        dfn = smap(lambda a, b: (lambda r, hd: (r, _expand(hd)))(*disp(a, b)),
                                   (P(ax), P(ax)), (P(ax), P(ax)))
                        if op == "dispatch":
                            timing, out = common.time_calls(dfn, (x, idx), iters=_blocks(args)[0],
                                                            warmup=args.warmup_iters,
                                                            max_seconds=args.max_seconds,
                                            repeats=_blocks(args)[1],
                                            sync_every=args.sync_every)
                        else:
                            out = jax.block_until_ready(dfn(x, idx))
                        handle = out[1]
                        if op == "dispatch" and args.check:
                            row["wrong"] = _check_dispatch(out, exp_recv, exp_counts, exp_drop,
                                                           n, el)
                    if op == "combine":
                        comb = fns(impl)[1]
                        cfn = smap(lambda y, hd, ww: comb(y, _squeeze(hd), ww),
                                   (P(ax), P(ax), P(ax)), P(ax))
                        timing, out = common.time_calls(cfn, (ey, handle, w), iters=_blocks(args)[0],
                                                        warmup=args.warmup_iters,
                                                        max_seconds=args.max_seconds,
                                            repeats=_blocks(args)[1],
                                            sync_every=args.sync_every)
                        if args.check:
                            got = np.asarray(out).reshape(n, tkn, h)
                            row["wrong"] = int(np.count_nonzero(got != exp_y))
                    if op == "layer":
                        _, _, lay, lay_name = fns(impl)
                        row["layer_impl"] = lay_name
                        if impl == "lax":
                            params["layer_reference"] = lay_name
                        lfn = smap(lambda a, r, wi, wo: lay(a, r, wi, wo, axis_name=ax,
                                                           top_k=k, capacity=cap),
                                   (P(ax), P(), P(ax), P(ax)), P(ax))
                        timing, out = common.time_calls(lfn, (xf, router, w_in, w_out),
                                                        iters=_blocks(args)[0],
                                                        warmup=args.warmup_iters,
                                                        max_seconds=args.max_seconds,
                                            repeats=_blocks(args)[1],
                                            sync_every=args.sync_every)
                        got = np.asarray(out).astype(np.float64)
                        if impl == "lax":
                            layer_ref_out = (lay_name, got)
                        elif args.check and layer_ref_out and \
                                layer_ref_out[0].startswith("strata."):
                            ref = layer_ref_out[1]
                            row["wrong"] = int(np.count_nonzero(
                                np.abs(got - ref) > 1e-3 + 1e-3 * np.abs(ref)))
                            row["max_abs_diff"] = float(np.max(np.abs(got - ref)))
            except Exception as ex:
                row.update(common.failure(ex))
                if op == "dispatch":
                    handle = None
                continue
            t = timing.mean_us
            row.update(time_us=t, iters=timing.iters, first_call_s=timing.first_call_s,
                       blocks_us=list(timing.blocks_us), spread_us=style.spread(timing.blocks_us))
            if op in ("dispatch", "combine"):
                row["bytes_per_rank"] = deepep_bytes
                row["bw"] = deepep_bytes / (t * 1e-6) / 1e9
            else:
                row["tokens_per_s"] = n * tkn / (t * 1e-6)
    if hasattr(bar, "close"):
        bar.close()

    for r in report.rows:
        peer = results.get((r["op"], "lax", None))
        if r["impl"] == "strata" and r["status"] == "ok" and peer and peer["status"] == "ok":
            _, sp, within = common.fmt_speedup(peer["time_us"], r["time_us"],
                                               peer.get("spread_us", 0.0), r.get("spread_us", 0.0))
            r.update(lax_time_us=peer["time_us"], lax_spread_us=peer.get("spread_us"),
                     speedup=sp, speedup_within_noise=within)
    _modeled_columns(report, strata, n, tkn, h, k, ne, cap, dtype, idx_all)
    report.emit(common.fit_width(_table(report, params)))
    return report


def _modeled_columns(report, strata, n, tkn, h, k, ne, cap, dtype, idx_all) -> None:
    """The same dispatch/combine, with this run's routing, timed by the supernode model."""
    em = getattr(strata, "emulator", None) if strata is not None else None
    if em is None or not hasattr(em, "model"):
        return
    shape = dict(npus=n, tokens=tkn, hidden=h, top_k=k, num_experts=ne, capacity=cap,
                 topk_idx=idx_all, dtype=dtype)
    got = {}
    for op in ("dispatch", "combine"):
        try:
            s = em.model(f"moe_{op}", mode="strata", **shape)
            b = em.model(f"moe_{op}", mode="buffer_centric", **shape)
            got[op] = (s.time_us, b.time_us)
        except Exception as e:
            got[op] = common.one_line(e)
    for r in report.rows:
        v = got.get(r["op"])
        if r["impl"] != "strata" or v is None:
            continue
        if isinstance(v, str):
            r["modeled_reason"] = v
            continue
        r["modeled_us"] = v[1] if r["mode"] == "buffer_centric" else v[0]
        r["modeled_bc_ratio"] = v[1] / v[0]


def _check_dispatch(out, exp_recv, exp_counts, exp_drop, n, el) -> int:
    recv, hd = out
    wrong = int(np.count_nonzero(np.asarray(recv) != exp_recv))
    counts = getattr(hd, "recv_counts", None)
    if counts is None and isinstance(hd, dict):
        counts = hd.get("recv_counts")
    dropped = getattr(hd, "dropped", None)
    if dropped is None and isinstance(hd, dict):
        dropped = hd.get("dropped")
    if counts is not None:
        wrong += int(np.count_nonzero(np.asarray(counts).reshape(n, el) !=
                                      exp_counts.reshape(n, el)))
    if dropped is not None:
        wrong += int(np.count_nonzero(np.asarray(dropped).reshape(n) != exp_drop))
    return wrong


COLS = [Col("op", "op", "", "", 8), Col("impl_name", "implementation", "", "", 27),
        Col("t_cell", "time", "(us)", "", 14), Col("bw", "bw", "(GB/s)", ".3g", 7),
        Col("wrong", "#wrong", "", "d", 6), Col("lax_cell", "lax time", "(us)", "", 14),
        Col("sp_cell", "speedup", "(x lax)", "", 7),
        Col("modeled_us", "modeled", "(us)", ".1f", 8),
        Col("modeled_bc_ratio", "bc/strata", "(x)", ".2f", 9)]


def _impl_label(r) -> str:
    key = "lax" if r["impl"] == "lax" else ("strata" if r["mode"] == "strata" else r["mode"])
    return style.series(key)["label"]


def _table(report: Report, p: dict) -> str:
    rows = []
    for r in report.rows:
        t = dict(r, impl_name=_impl_label(r))
        t["t_cell"] = common.fmt_time(r.get("time_us"), r.get("spread_us"))
        if r.get("lax_time_us") is not None:
            t["lax_cell"] = common.fmt_time(r["lax_time_us"], r.get("lax_spread_us"))
            t["sp_cell"] = "≈1" if r.get("speedup_within_noise") else f"{r['speedup']:.2f}"
        if r["status"] != "ok":
            t["_note"] = f"{r['status']}: {r['reason']}"
        rows.append(t)
    title = (f"MoE expert parallel: N={p['npus']} tokens/rank={p['tokens']} hidden={p['hidden']} "
             f"top-k={p['topk']} experts={p['experts']} ({p['experts_per_rank']}/rank) "
             f"capacity={p['capacity']} ffn={p['ffn']} {p['dtype']}")
    footer = ["time: per call, median of the timed blocks, ± half their range; speedup = lax "
              "time / strata time, ≈1 when the difference is within the two spreads",
              f"bw = DeepEP's: bytes of tokens received per rank, a token once per destination rank "
              f"(what crosses between ranks) / time = {p['deepep_bytes_per_rank'] / 1e6:.2f} MB per rank "
              f"({p['accepted_pairs']} (token,k) pairs accepted = {p['recv_bytes_per_rank'] / 1e6:.2f} MB "
              f"of slot rows, {p['dropped_pairs']} dropped)",
              f"layer: lax = {p.get('layer_reference', 'reference')}; strata #wrong = "
              "elements with |strata - lax| > 1e-3 + 1e-3|lax| (N/A when the lax layer is not "
              "the library's reference)",
              "modeled = the same op with this run's routing timed by strata.emulator.model on "
              "cloudmatrix384 (the row's mode); bc/strata = modeled buffer_centric / strata"]
    return common.render_table(COLS, rows, title=title, footer=footer)


def plot(report: Report, path: str) -> None:
    """Time per call of each op and implementation, ± spread; a bar that has no value
    (failed or skipped) is drawn as a hatched stub labelled n/a, never left out."""
    if report.params.get("model_only"):
        return modeled.plot_moe(report, path)
    plt = common.pyplot()
    rows = report.rows
    ok = [r for r in rows if r["status"] == "ok" and r.get("time_us")]
    if not ok:
        return
    ops = [o for o in MOE_OPS if any(r["op"] == o for r in rows)]
    order = ["lax"] + list(report.params["modes"])
    keys = sorted({(r["impl"], r["mode"]) for r in rows},
                  key=lambda kk: order.index(kk[1] if kk[0] == "strata" else "lax"))
    fig, a = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(keys)
    lo = min(r["time_us"] for r in ok) / 1e3 / 4
    any_missing = False
    for j, (impl, mode) in enumerate(keys):
        key = "lax" if impl == "lax" else ("strata" if mode == "strata" else mode)
        st = style.series(key)
        xs, vals, errs, missing = [], [], [], []
        for i, o in enumerate(ops):
            r = next((r for r in rows if r["op"] == o and r["impl"] == impl and r["mode"] == mode),
                     None)
            x = i + j * width
            if r is None or r["status"] != "ok" or not r.get("time_us"):
                missing.append(x)
                continue
            xs.append(x)
            vals.append(r["time_us"] / 1e3)
            errs.append((r.get("spread_us") or 0.0) / 1e3)
        if xs:
            a.bar(xs, vals, width, yerr=errs, capsize=3, **st)
        for x in missing:  # no value: a hatched stub at the bottom, labelled
            any_missing = True
            a.bar([x], [lo], width, bottom=lo, color="none", edgecolor=st["color"], hatch="//",
                  label=None if xs else st["label"])
            a.annotate("n/a", (x, 2 * lo), ha="center", va="bottom", fontsize=7)
    a.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(ops))], ops)
    a.set_ylabel("time per call (ms), ± spread")
    a.set_yscale("log")
    p = report.params
    a.set_title(f"MoE, N={p['npus']}, {p['tokens']} tok/rank, H={p['hidden']}, "
                f"top-{p['topk']}, E={p['experts']}"
                + ("; hatched n/a = no value (failed or skipped)" if any_missing else ""),
                fontsize=9)
    a.legend(fontsize=8)
    a.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
