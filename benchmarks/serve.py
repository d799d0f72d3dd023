"""`python -m benchmarks serve --model-only`: DeepSeek-V3/R1 serving on the supernode, modeled.

The model is benchmarks/deepseek.py, the JAX code that tests/test_deepseek.py runs for real at a
tiny size on emulated NPUs; here the same functions are traced at full size on an abstract mesh
and timed by the step model (strata.emulator.simulate), once per mode: strata (user-buffer
direct communication) and buffer_centric (the staged vendor-library baseline). Nothing runs on
the host but the tracing.

--npus and "per NPU" count Ascend 910C packages, as published serving figures do. Inside the
model a rank is one die by default (--rank die: the published deployment puts one expert per
die, EP320 on 160 NPUs) or one package (--rank npu); per-rank compute, HBM, cores and UB ports
follow that choice (strata.emulator.SupernodeSpec).

decode: one step generates one token for each of the batch's sequences at --context tokens of
KV cache: TPOT = the step's time, throughput = batch / TPOT. prefill: one step runs --prompt
tokens of each sequence: TTFT = the step's time, throughput = batch x prompt / TTFT.
"""

from __future__ import annotations

import argparse
import os
import time

from . import common, style
from .common import Col, Report

# Published figures to compare with (reported beside the model, never fitted to).
PUBLISHED = {
    "source": "CloudMatrix-Infer on CloudMatrix384, DeepSeek-R1 (INT8), arXiv 2506.12708, abstract",
    "decode": [{"tokens_per_s_per_npu": 1943.0, "tpot_ms_under": 50.0},
               {"tokens_per_s_per_npu": 538.0, "tpot_ms_under": 15.0}],
    "prefill": [{"tokens_per_s_per_npu": 6688.0}],
}
MODES = ("strata", "buffer_centric")


def _positive_ints(text: str) -> list[int]:
    try:
        vals = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive whole numbers, got {text!r}")
    return vals


def _positive_int(text: str) -> int:
    (v,) = _positive_ints(text)
    return v


def _number_in(what: str, ok):
    """An argparse type: a float that `ok` accepts, else a one-line error saying `what`."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


_fraction = _number_in("a number in (0, 1]", lambda v: 0 < v <= 1)
_non_negative = _number_in("a number >= 0", lambda v: v >= 0)


def add_model_args(p: argparse.ArgumentParser, capacity: bool = True) -> None:
    """Flags the modeled serving and training runs share."""
    p.add_argument("--model", default="deepseek-v3", choices=("deepseek-v3", "tiny"),
                   help="deepseek-v3 (full size, default) or tiny (the tests' toy config)")
    p.add_argument("--rank", default="die", choices=("die", "npu"),
                   help="what one rank of the model is: a 910C die (default) or a whole package")
    p.add_argument("--efficiency", type=_fraction, default=None,
                   help="share of peak compute a kernel sustains (preset: 0.7, assumed)")
    p.add_argument("--hbm-efficiency", type=_fraction, default=None,
                   help="share of peak HBM bandwidth a kernel sustains (preset: 0.8, assumed)")
    p.add_argument("--launch-us", type=_non_negative, default=None,
                   help="cost of one kernel launch in us (preset: 2, assumed)")
    if capacity:
        p.add_argument("--capacity-factor", type=float, default=None,
                       help="MoE capacity factor (the model's default: 1.25)")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="write a Chrome/Perfetto trace of one strata step to PATH (modeled runs: the "
                        "first batch's; default DIR/<name>_trace.json with --out)")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-only", action="store_true",
                   help="model the full-size step on the supernode (required: the tiny model's real "
                        "run against its reference is tests/test_deepseek.py)")
    p.add_argument("--phase", default="decode", choices=("decode", "prefill"))
    p.add_argument("--npus", type=_positive_int, default=160,
                   help="910C packages serving the phase (160: EP320 over dies, as published)")
    p.add_argument("--batch-per-npu", type=_positive_ints, default=[96], metavar="B[,B...]",
                   help="sequences per NPU in one step; a list sweeps (96)")
    p.add_argument("--context", type=_positive_int, default=4096, help="decode: KV cache length (4096)")
    p.add_argument("--prompt", type=_positive_int, default=4096, help="prefill: prompt length (4096)")
    p.add_argument("--dtype", default="int8", choices=("int8", "bfloat16"),
                   help="weights: int8 (W8A8, as CloudMatrix-Infer serves R1; default) or bfloat16")
    p.add_argument("--microbatches", type=int, default=1, choices=(1, 2),
                   help="decode: 1 (default) or 2 micro-batches interleaved per layer, as CloudMatrix-Infer "
                        "runs them (the model reads each weight once per micro-batch and runs one compute "
                        "stream, so 2 is slower in it: docs/step_model.md)")
    add_model_args(p)
    common.add_output_args(p)
    common.one_line_errors(p)


def spec_for(args):
    """The preset with what one rank is and the efficiency/launch overrides."""
    import stratacl_jax as strata

    spec = strata.emulator.preset("cloudmatrix384" if args.rank == "npu" else "cloudmatrix384_dies")
    changes = {k: v for k, v in (("compute_efficiency", args.efficiency), ("hbm_efficiency", args.hbm_efficiency),
                                 ("kernel_launch_us", args.launch_us)) if v is not None}
    return spec.replace(**changes) if changes else spec


def model_config(args, **overrides):
    from . import deepseek

    if args.capacity_factor is not None:
        overrides["capacity_factor"] = args.capacity_factor
    return (deepseek.tiny if args.model == "tiny" else deepseek.deepseek_v3)(**overrides)


def ranks_for(args, spec, what: str = "--npus") -> int:
    ranks = args.npus * spec.ranks_per_npu
    if args.npus > spec.num_npus:
        raise SystemExit(f"serve: {what} {args.npus} is more than the supernode's {spec.num_npus} NPUs")
    return ranks


def simulate_modes(fn, specs, spec, row_base: dict, rows: list, trace_path: str | None) -> dict:
    """Simulates the step in both modes; appends a row per mode; returns mode -> ModeledStep."""
    import stratacl_jax as strata

    out = {}
    for mode in MODES:
        t0 = time.perf_counter()
        step = strata.emulator.simulate(fn, *specs, spec=spec, mode=mode)
        took = time.perf_counter() - t0
        b = step.breakdown
        rows.append({**row_base, "mode": mode, "step_ms": step.time_us / 1e3, "compute_ms": step.compute_us / 1e3,
                     "comm_ms": step.comm_us / 1e3, "exposed_comm_ms": step.exposed_comm_us / 1e3,
                     "cube_ms": b["cube_us"] / 1e3, "vector_ms": b["vector_us"] / 1e3,
                     "launch_ms": b["launch_us"] / 1e3, "kernels": b["kernels"], "collectives": b["collectives"],
                     "gflop_per_rank": b["flops"] / 1e9, "hbm_gb_per_rank": b["hbm_bytes"] / 1e9,
                     "comm_gb_per_rank": b["comm_bytes"] / 1e9, "simulate_s": took, "notes": step.notes})
        out[mode] = step
        if trace_path and mode == "strata":
            step.save_trace(trace_path)
            trace_path = None
    return out


def run(args) -> Report:
    if not args.model_only:
        raise SystemExit("serve: only --model-only is available (the full-size model cannot run on this "
                         "host); the tiny model's real run is checked in tests/test_deepseek.py")
    import stratacl_jax as strata

    from . import deepseek

    spec = spec_for(args)
    ranks = ranks_for(args, spec)
    per_rank = spec.ranks_per_npu
    cfg = model_config(args, param_dtype=args.dtype) if args.model == "deepseek-v3" else model_config(args)
    mesh = strata.emulator.abstract_mesh((ranks,), ("ep",), spec=spec)
    prm = {"phase": args.phase, "npus": args.npus, "ranks": ranks, "rank": args.rank, "model": args.model,
           "dtype": cfg.param_dtype, "context": args.context, "prompt": args.prompt,
           "microbatches": args.microbatches, "spec": spec.name, "compute_efficiency": spec.compute_efficiency,
           "hbm_efficiency": spec.hbm_efficiency, "kernel_launch_us": spec.kernel_launch_us,
           "capacity_factor": cfg.capacity_factor, "published": PUBLISHED}
    report = Report("serve", prm, env=common.environment())
    trace_path = args.trace or (os.path.join(args.out, "serve_trace.json") if args.out else None)
    for batch in args.batch_per_npu:
        if batch % per_rank:
            raise SystemExit(f"serve: --batch-per-npu {batch} must be a multiple of the {per_rank} ranks of an NPU")
        b_rank = batch // per_rank
        if args.phase == "decode":
            mb = args.microbatches if b_rank % args.microbatches == 0 else 1
            fn, specs = deepseek.decode_step(cfg, mesh, batch_per_rank=b_rank, context=args.context, microbatches=mb)
        else:
            fn, specs = deepseek.prefill_step(cfg, mesh, batch_per_rank=b_rank, prompt_len=args.prompt)
        rows: list = []
        simulate_modes(fn, specs, spec, {"batch_per_npu": batch, "batch_per_rank": b_rank}, rows, trace_path)
        trace_path = None
        for r in rows:
            if args.phase == "decode":
                r["tpot_ms"] = r["step_ms"]
                r["tokens_per_s_per_npu"] = batch / (r["step_ms"] / 1e3)
            else:
                r["ttft_ms"] = r["step_ms"]
                r["tokens_per_s_per_npu"] = batch * args.prompt / (r["step_ms"] / 1e3)
        report.rows.extend(rows)
    key = "tpot_ms" if args.phase == "decode" else "ttft_ms"
    first = args.batch_per_npu[0]
    for mode in MODES:
        r = next(r for r in report.rows if r["mode"] == mode and r["batch_per_npu"] == first)
        report.top[mode] = {key: r[key], "tokens_per_s_per_npu": r["tokens_per_s_per_npu"],
                            "batch_per_npu": first, "exposed_comm_ms": r["exposed_comm_ms"]}
    if len(args.batch_per_npu) > 1:
        report.top["sweep"] = [{k: r[k] for k in ("mode", "batch_per_npu", key, "tokens_per_s_per_npu")}
                               for r in report.rows]
    if trace_path is None and (args.trace or args.out):
        prm["trace_path"] = args.trace or os.path.join(args.out, "serve_trace.json")
    report.emit(common.fit_width(_table(report, prm)))
    return report


COLS_DECODE = [Col("batch_per_npu", "batch", "/NPU", "d", 5), Col("mode", "mode", "", "", 14),
               Col("tpot_ms", "TPOT", "(ms)", ".2f", 8), Col("tokens_per_s_per_npu", "tok/s", "/NPU", ".0f", 7),
               Col("compute_ms", "compute", "(ms)", ".2f", 8), Col("comm_ms", "comm", "(ms)", ".2f", 7),
               Col("exposed_comm_ms", "exposed", "(ms)", ".2f", 7), Col("cube_ms", "cube", "(ms)", ".2f", 7),
               Col("vector_ms", "vector", "(ms)", ".2f", 7), Col("simulate_s", "sim", "(s)", ".1f", 5)]


def _table(report: Report, p: dict) -> str:
    cols = list(COLS_DECODE)
    if p["phase"] == "prefill":
        cols[2] = Col("ttft_ms", "TTFT", "(ms)", ".1f", 8)
    what = (f"context {p['context']}, {p['microbatches']} micro-batches" if p["phase"] == "decode"
            else f"prompt {p['prompt']}")
    title = (f"{p['model']} {p['phase']} modeled on {p['spec']}: {p['npus']} NPUs = {p['ranks']} ranks "
             f"(a rank is a {p['rank']}), {p['dtype']} weights, {what}")
    foot = [f"compute efficiency {p['compute_efficiency']}, HBM efficiency {p['hbm_efficiency']}, "
            f"kernel launch {p['kernel_launch_us']} us (assumed: docs/step_model.md)"]
    for pub in PUBLISHED[p["phase"]]:
        bound = f" at TPOT < {pub['tpot_ms_under']:g} ms" if "tpot_ms_under" in pub else ""
        foot.append(f"published: {pub['tokens_per_s_per_npu']:g} tokens/s per NPU{bound} ({PUBLISHED['source']})")
    ratio = {}
    for r in report.rows:
        ratio.setdefault(r["batch_per_npu"], {})[r["mode"]] = r["step_ms"]
    gains = [v["buffer_centric"] / v["strata"] for v in ratio.values() if v.get("strata")]
    if gains:
        foot.append(f"buffer_centric / strata step time: {min(gains):.3f}x .. {max(gains):.3f}x")
    if p.get("trace_path"):
        foot.append(f"trace of one strata step: {p['trace_path']} (open in ui.perfetto.dev)")
    return common.render_table(cols, report.rows, title=title, footer=foot)


def plot(report: Report, path: str) -> None:
    plt = common.pyplot()
    p = report.params
    key = "tpot_ms" if p["phase"] == "decode" else "ttft_ms"
    fig, a = plt.subplots(figsize=(6.4, 4))
    for mode in MODES:
        st = style.series(mode)
        rs = sorted((r for r in report.rows if r["mode"] == mode), key=lambda r: r["batch_per_npu"])
        a.plot([r[key] for r in rs], [r["tokens_per_s_per_npu"] for r in rs], "o-", color=st["color"],
               label=f"{st['label']} (modeled)")
        if mode == "strata":
            for r in rs:
                a.annotate(f"B={r['batch_per_npu']}", (r[key], r["tokens_per_s_per_npu"]),
                           textcoords="offset points", xytext=(4, -10), fontsize=7)
    for pub in PUBLISHED[p["phase"]]:
        if "tpot_ms_under" in pub:
            a.plot([pub["tpot_ms_under"]], [pub["tokens_per_s_per_npu"]], "k*", ms=10)
            a.annotate(f"published (TPOT < {pub['tpot_ms_under']:g} ms)",
                       (pub["tpot_ms_under"], pub["tokens_per_s_per_npu"]), textcoords="offset points",
                       xytext=(-60, 8), fontsize=7)
        else:
            a.axhline(pub["tokens_per_s_per_npu"], color="k", ls="--", lw=1, label="published")
    a.set_xlabel("TPOT (ms)" if p["phase"] == "decode" else "TTFT (ms)")
    a.set_ylabel("tokens/s per NPU (910C package)")
    a.set_ylim(bottom=0)
    a.set_xlim(left=0)
    a.set_title(f"{p['model']} {p['phase']}, {p['npus']} NPUs, {p['dtype']} (modeled on {p['spec']})", fontsize=9)
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
