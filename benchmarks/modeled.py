"""Modeled columns and model-only sweeps: what the ops would take on the supernode
(`strata.emulator.model`, preset cloudmatrix384 unless --spec says otherwise).

- Host tables gain, per strata row: the modeled time and busbw of the same op on the preset
  (same N, size, dtype and the strata.config settings of the row) in strata mode, and the
  modeled buffer_centric / strata ratio.
- `--model-only` sweeps without host execution: collectives 1 KB .. 1 GB per rank on 8, 32
  and 384 NPUs in both modes; MoE dispatch/combine at DeepEP's shape (4096 tokens, hidden
  7168, top-8, 256 experts, bf16) on 8 .. 128 ranks. buffer_centric MoE needs a comm buffer
  that holds the op's rows (the runtime refuses otherwise); the sweep sizes it so, rounded up
  to a MiB, as a vendor-library user sets HCCL_BUFFSIZE, and says so in the table.
"""

from __future__ import annotations

import math

from . import common, style
from .common import Col, Report

SWEEP_NPUS = (8, 32, 384)
SWEEP_SIZES = "1K..1G"
MOE_RANKS = (8, 16, 32, 64, 128)
DEEPEP = {"tokens": 4096, "hidden": 7168, "top_k": 8, "num_experts": 256, "dtype": "bfloat16"}


def _emulator():
    strata, reason = common.load_strata()
    em = getattr(strata, "emulator", None) if strata is not None else None
    if em is None or not hasattr(em, "model"):
        return None, reason or "strata.emulator.model is not available"
    return em, None


def collective_columns(rows: list[dict], spec: str = "cloudmatrix384") -> None:
    """Adds modeled_us / modeled_busbw / modeled_bc_ratio to strata rows (in place)."""
    em, _ = _emulator()
    if em is None:
        return
    cache: dict = {}
    for r in rows:
        if r.get("impl") != "strata" or r.get("npus", 0) > em.preset(spec).num_ranks:
            continue
        key = (r["op"], r["npus"], r["size"], r["dtype"], r.get("redop"), r.get("root"))
        if key not in cache:
            kw = dict(npus=r["npus"], spec=spec, dtype=r["dtype"])
            if r["op"] in ("all_reduce", "reduce_scatter") and r.get("redop") not in (None, "none"):
                kw["redop"] = "mean" if r["redop"] == "avg" else r["redop"]
            if r["op"] == "broadcast":
                kw["root"] = max(0, r.get("root", 0))
            try:
                s = em.model(r["op"], r["size"], mode="strata", **kw)
                b = em.model(r["op"], r["size"], mode="buffer_centric", **kw)
                cache[key] = (s.time_us, s.busbw_gbps, b.time_us, b.busbw_gbps)
            except Exception as e:  # keep the host row; say why the model has none
                cache[key] = (None, None, None, common.one_line(e))
        s_us, s_bw, b_us, b_bw = cache[key]
        if s_us is None:
            r["modeled_reason"] = b_bw
            continue
        mine = s_us if r.get("mode") != "buffer_centric" else b_us
        r["modeled_us"] = mine
        r["modeled_busbw"] = s_bw if r.get("mode") != "buffer_centric" else b_bw
        r["modeled_bc_ratio"] = b_us / s_us if s_us else None


MODEL_COLS = [Col("modeled_us", "time", "(us)", ".1f", 9),
              Col("modeled_busbw", "busbw", "(GB/s)", ".3g", 7),
              Col("modeled_bc_ratio", "bc/strata", "(x)", ".2f", 9)]


# ----------------------------------------------------------------------------- sweeps
def _sizes(text: str) -> list[int]:
    lo, hi = text.split("..")
    return common.size_sweep(common.parse_size(lo), common.parse_size(hi), 2.0)


def collectives_sweep(args, all_ops) -> Report:
    """`all_ops`: what --op all means (the caller's op list)."""
    em, reason = _emulator()
    if em is None:
        raise SystemExit(f"--model-only: {reason}")
    ops = common.split_list(args.ops, all_ops, "--op")
    npus_list = [int(v) for v in str(args.model_npus).split(",")]
    sizes = _sizes(args.model_sizes)
    spec = em.preset(args.spec)
    params = {"ops": ops, "npus": npus_list, "sizes": sizes, "spec": spec.name, "dtype": args.datatype,
              "modes": ["strata", "buffer_centric"], "model_only": True}
    report = Report("collectives_model", params, env=common.environment())
    bar = common.progress(range(len(ops) * len(npus_list) * len(sizes)), desc="model",
                          disable=args.no_progress)
    it = iter(bar)
    for op in ops:
        for n in npus_list:
            for size in sizes:
                next(it, None)
                row = {"op": op, "npus": n, "size": size, "dtype": args.datatype, "status": "ok"}
                # as nccl-tests: whole elements (per rank, for the ops that split the input)
                exact = em.round_bytes(op, size, n, args.datatype)
                if not exact:
                    row.update(status="skipped", reason=f"{size} B is less than one {args.datatype} per rank")
                    report.rows.append(row)
                    continue
                try:
                    kw = dict(npus=n, spec=spec, dtype=args.datatype)
                    size = exact
                    s = em.model(op, size, mode="strata", **kw)
                    b = em.model(op, size, mode="buffer_centric", **kw)
                except Exception as e:
                    row.update(common.failure(e))
                    report.rows.append(row)
                    continue
                row.update(size=s.bytes_per_rank, strata_us=s.time_us, strata_busbw=s.busbw_gbps,
                           bc_us=b.time_us, bc_busbw=b.busbw_gbps, ratio=b.time_us / s.time_us,
                           fits_hbm=s.fits_hbm, lower_bound_us=s.lower_bound_us,
                           breakdown=s.breakdown, bc_breakdown=b.breakdown)
                report.rows.append(row)
    if hasattr(bar, "close"):
        bar.close()
    for op in ops:
        for n in npus_list:
            rs = [r for r in report.rows if r["op"] == op and r["npus"] == n]
            report.emit(common.fit_width(_sweep_table(rs, op, n, spec.name, args.datatype)))
    report.emit(_ratio_summary(report.rows, "collective busbw, strata / buffer_centric"))
    return report


SWEEP_COLS = [Col("size_label", "size", "/rank", "", 6), Col("strata_us", "time", "(us)", ".1f", 10),
              Col("strata_busbw", "busbw", "(GB/s)", ".4g", 7),
              Col("bc_us", "time", "(us)", ".1f", 10), Col("bc_busbw", "busbw", "(GB/s)", ".4g", 7),
              Col("ratio", "bc/strata", "(x)", ".2f", 9), Col("fits", "fits", "HBM", "", 4)]


def _sweep_table(rows, op, n, spec, dtype) -> str:
    out = []
    for r in rows:
        t = dict(r, fits="yes" if r.get("fits_hbm") else "no", size_label=style.size_label(r["size"]))
        if r["status"] != "ok":
            t["_note"] = f"{r['status']}: {r['reason']}"
        out.append(t)
    ok = [r for r in rows if r["status"] == "ok"]
    footer = []
    if ok:
        best = max(ok, key=lambda r: r["ratio"])
        footer = [f"Max strata busbw     : {max(r['strata_busbw'] for r in ok):.4g} GB/s",
                  f"Max bc/strata        : {best['ratio']:.2f}x at {style.size_label(best['size'])} B",
                  "fits HBM = input + output of one rank within its HBM "
                  "(sizes past it are modeled anyway)"]
    return common.render_table(SWEEP_COLS, out, title=f"{op}  modeled on {spec}  N={n} dtype={dtype}",
                               groups=[("", 1), ("strata", 2), ("buffer_centric", 2), ("", 2)],
                               footer=footer)


def _ratio_summary(rows, what) -> str:
    ok = [r for r in rows if r["status"] == "ok" and r.get("ratio")]
    if not ok:
        return f"# {what}: no rows"
    lines = [f"# {what} (modeled time ratio = busbw ratio):"]
    for op in dict.fromkeys(r["op"] for r in ok):
        rs = [r["ratio"] for r in ok if r["op"] == op]
        lines.append(f"#   {op:<15} geomean {math.exp(sum(map(math.log, rs)) / len(rs)):.2f}x "
                     f"min {min(rs):.2f}x max {max(rs):.2f}x")
    return "\n".join(lines)


def moe_sweep(args) -> Report:
    em, reason = _emulator()
    if em is None:
        raise SystemExit(f"--model-only: {reason}")
    ranks = [int(v) for v in str(args.model_npus).split(",")]
    spec = em.preset(args.spec)
    shape = dict(DEEPEP, tokens=args.tokens, hidden=args.hidden, top_k=args.topk,
                 num_experts=args.experts, dtype=args.datatype)
    row_bytes = shape["hidden"] * (2 if shape["dtype"] in ("bfloat16", "float16") else 4)
    params = {"ranks": ranks, "spec": spec.name, **shape, "model_only": True, "seed": args.seed}
    report = Report("moe_model", params, env=common.environment())
    for n in ranks:
        for op in ("moe_dispatch", "moe_combine"):
            row = {"op": op, "npus": n, "status": "ok"}
            try:
                s = em.model(op, npus=n, mode="strata", spec=spec, seed=args.seed, **shape)
                cap = s.settings["capacity"]
                el = shape["num_experts"] // n
                need = max(shape["tokens"], el * cap) * row_bytes
                buf = max(200 << 20, -(-need // (1 << 20)) << 20)
                b = em.model(op, npus=n, mode="buffer_centric", spec=spec, seed=args.seed, comm_buffer_bytes=buf,
                             **shape)
            except Exception as e:
                row.update(common.failure(e))
                report.rows.append(row)
                continue
            row.update(strata_us=s.time_us, strata_bw=s.busbw_gbps, bc_us=b.time_us, bc_bw=b.busbw_gbps,
                       ratio=b.time_us / s.time_us, comm_buffer_mib=buf >> 20,
                       deepep_bytes_per_rank=s.bytes_per_rank, breakdown=s.breakdown,
                       bc_breakdown=b.breakdown)
            report.rows.append(row)
    report.emit(common.fit_width(_moe_table(report.rows, params)))
    report.emit(_ratio_summary(report.rows, "MoE DeepEP bandwidth, strata / buffer_centric"))
    return report


MOE_COLS = [Col("op", "op", "", "", 12), Col("npus", "ranks", "", "d", 5),
            Col("strata_us", "time", "(us)", ".1f", 9), Col("strata_bw", "bw", "(GB/s)", ".4g", 7),
            Col("bc_us", "time", "(us)", ".1f", 9), Col("bc_bw", "bw", "(GB/s)", ".4g", 7),
            Col("ratio", "bc/strata", "(x)", ".2f", 9), Col("comm_buffer_mib", "bc buffer", "(MiB)", "d", 9)]


def _moe_table(rows, p) -> str:
    out = [dict(r, _note=f"{r['status']}: {r['reason']}") if r["status"] != "ok" else r for r in rows]
    title = (f"MoE modeled on {p['spec']}: tokens/rank={p['tokens']} hidden={p['hidden']} "
             f"top-{p['top_k']} experts={p['num_experts']} {p['dtype']}, routing uniform at random")
    footer = ["bw = DeepEP's: bytes of tokens received per rank, a token counted once per "
              "destination rank, over the time",
              "bc buffer = the comm buffer buffer_centric needs for the op's rows (HCCL_BUFFSIZE)"]
    return common.render_table(MOE_COLS, out, title=title,
                               groups=[("", 2), ("strata", 2), ("buffer_centric", 2), ("", 2)],
                               footer=footer)


_N_MARKERS = ("o", "s", "^", "D", "v", "P")


def plot_collectives(report: Report, path: str) -> None:
    """Modeled busbw vs size: strata (style colour, solid) and buffer_centric (its colour,
    dashed), one marker per N; values <= 0 or missing are marked at the axis bottom."""
    plt = common.pyplot()
    rows = report.rows
    ops = [o for o in report.params["ops"] if any(r["op"] == o and r["status"] == "ok" for r in rows)]
    if not ops:
        return
    cols = min(3, len(ops))
    nrow = -(-len(ops) // cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(5 * cols, 3.8 * nrow), squeeze=False)
    missing = 0
    for a, op in zip(axes.flat, ops):
        sizes_all = []
        for j, n in enumerate(report.params["npus"]):
            rs = sorted((r for r in rows if r["op"] == op and r["npus"] == n), key=lambda r: r["size"])
            if not rs:
                continue
            xs = [r["size"] for r in rs]
            sizes_all += xs
            mk = _N_MARKERS[j % len(_N_MARKERS)]
            for key, field, ls in (("strata", "strata_busbw", "-"), ("buffer_centric", "bc_busbw", "--")):
                ys = [r.get(field) if r["status"] == "ok" else None for r in rs]
                missing += common.log_plot(a, xs, ys, key=key, marker=mk, ls=ls, ms=3,
                                           label=f"{style.series(key)['label']}, N={n}")
        a.set_yscale("log")
        style.size_axis(a, sizes_all)
        a.set_title(op)
        a.set_ylabel("modeled busbw (GB/s)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=6)
    for a in list(axes.flat)[len(ops):]:
        a.axis("off")
    fig.suptitle(f"modeled on {report.params['spec']}: busbw vs size, strata and buffer_centric"
                 + ("; v at the bottom = no value" if missing else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_moe(report: Report, path: str) -> None:
    """Modeled DeepEP bandwidth vs ranks: strata solid, buffer_centric dashed (style colours);
    dispatch circles, combine squares; missing values marked at the axis bottom."""
    plt = common.pyplot()
    rows = report.rows
    if not any(r["status"] == "ok" for r in rows):
        return
    fig, a = plt.subplots(figsize=(7, 4))
    missing = 0
    for op, mk in (("moe_dispatch", "o"), ("moe_combine", "s")):
        rs = sorted((r for r in rows if r["op"] == op), key=lambda r: r["npus"])
        xs = [r["npus"] for r in rs]
        for key, field, ls in (("strata", "strata_bw", "-"), ("buffer_centric", "bc_bw", "--")):
            ys = [r.get(field) if r["status"] == "ok" else None for r in rs]
            missing += common.log_plot(a, xs, ys, key=key, marker=mk, ls=ls,
                                       label=f"{op}, {style.series(key)['label']}")
    a.set_xscale("log", base=2)
    ranks = sorted({r["npus"] for r in rows})
    a.set_xticks(ranks, [str(v) for v in ranks])
    a.minorticks_off()
    a.set_yscale("log")
    a.set_xlabel("ranks")
    a.set_ylabel("modeled DeepEP bandwidth (GB/s)")
    a.set_title(f"MoE at DeepEP's shape, modeled on {report.params['spec']}"
                + ("; v at the bottom = no value" if missing else ""))
    a.grid(True, alpha=0.3)
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_model_args(p, *, npus_default: str, sizes: bool) -> None:
    p.add_argument("--model-only", action="store_true",
                   help="no host execution: sweep the supernode model (strata.emulator.model)")
    p.add_argument("--model-npus", default=npus_default,
                   help=f"NPU counts of the --model-only sweep ({npus_default})")
    if sizes:
        p.add_argument("--model-sizes", default=SWEEP_SIZES,
                       help=f"bytes per rank of the --model-only sweep, doubling ({SWEEP_SIZES})")
    p.add_argument("--spec", default="cloudmatrix384", help="supernode preset of the model (cloudmatrix384)")
