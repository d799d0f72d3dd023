"""`python -m benchmarks [collectives|moe|train] ...` — with no subcommand, a short tour.

Arguments are parsed before JAX starts so that the emulated NPU count (CPU devices) and the
PjRt thread pool can still be set.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from . import collectives, common, latency, moe, serve, train

SUBCOMMANDS = {
    "collectives": (collectives, "nccl-tests-style sweeps: strata vs lax vs memory floor"),
    "moe": (moe, "MoE dispatch/combine/layer, strata vs the lax all_to_all reference"),
    "train": (train, "one MoE training step with strata vs lax collectives"),
    "latency": (latency, "per-op cost of small ops inside one program at 8/64/384 NPUs, with floors"),
    "serve": (serve, "DeepSeek-V3/R1 decode or prefill on the supernode, modeled (--model-only)"),
}

# The tour: small enough for a few minutes on 2 cores, large enough to reach >= 1 MB per rank.
TOUR = {
    "collectives": ["-b", "4K", "-e", "4M", "-f", "4", "-n", "10", "-w", "3", "--mode", "all",
                    "--max-seconds", "3"],
    "moe": ["--tokens", "512", "--hidden", "512", "--topk", "4", "--experts", "32",
            "--ffn", "256", "-n", "5", "-w", "2", "--mode", "all"],
    "train": ["-n", "5", "-w", "2", "--mode", "all"],
    "latency": ["--npus", "8", "--sizes", "1K", "--pattern", "chained", "--chain", "8",
                "-n", "10", "--repeats", "3"],
    # The full-size DeepSeek decode step on the supernode (modeled: nothing runs on the host).
    "serve": ["--model-only", "--npus", "160", "--batch-per-npu", "96", "--context", "4096"],
}
QUICK = {  # --quick: the smallest tour that still touches every path (smoke tests)
    "collectives": ["-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1"],
    "moe": ["--tokens", "32", "--hidden", "64", "--topk", "2", "--experts", "16", "--ffn", "32",
            "-n", "2", "-w", "1"],
    "train": ["--tokens", "32", "--hidden", "32", "--ffn", "32", "--experts", "16", "--topk", "2",
              "-n", "2", "-w", "1"],
    "latency": ["--npus", "8", "--sizes", "1K", "--op", "all_reduce,moe", "--pattern", "chained",
                "--chain", "2", "-n", "2", "-w", "1", "--repeats", "1"],
    "serve": ["--model-only", "--model", "tiny", "--npus", "4", "--batch-per-npu", "4", "--context", "64"],
}


def build_parser(name: str) -> argparse.ArgumentParser:
    mod, help_ = SUBCOMMANDS[name]
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=help_)
    mod.add_args(p)
    return p


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    args = build_parser(name).parse_args(argv)
    args._argv = list(argv)  # child processes of an isolated run repeat it with overrides
    return args


def tour_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Short tour on emulated NPUs: collectives sweep, MoE ops, training step, small-op "
                    "latency, and the DeepSeek decode step modeled on the supernode. "
                    "Subcommands: " + "; ".join(f"{k}: {v[1]}" for k, v in SUBCOMMANDS.items())
                    + ". Run `python -m benchmarks SUBCOMMAND -h` for their flags.")
    p.add_argument("--out", default="bench_out", help="output folder (bench_out)")
    p.add_argument("--npus", type=int, default=8, help="emulated NPUs (8)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes: a smoke run of every path (seconds)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def npus_for(name: str, args) -> int:
    if name == "collectives":
        return collectives.npus_and_mesh(args)[0]
    return args.npus if args.npus is not None else 8  # train: --npus counts packages with --model-only


def run_one(name: str, args) -> common.Report:
    mod = SUBCOMMANDS[name][0]
    report = mod.run(args)
    for path in common.write_outputs(report, args, getattr(mod, "plot", None)):
        print(f"# wrote {path}")
    return report


def tour(targs) -> int:
    common.setup_devices(targs.npus)
    t0 = time.perf_counter()
    print(f"# StrataCL benchmark tour: {targs.npus} emulated NPUs, results in {targs.out}/",
          flush=True)
    strata, reason = common.load_strata()
    if strata is None:
        print(f"# note: {reason}; strata rows will be skipped", flush=True)
    plan = QUICK if targs.quick else TOUR
    md = [f"# Benchmark tour ({targs.npus} emulated NPUs)", ""]
    reports: dict[str, common.Report] = {}
    for name in ("collectives", "moe", "train", "latency", "serve"):
        # (latency runs each NPU count of its own in a child process; serve models the supernode)
        argv = plan[name] + ([] if name in ("latency", "serve") else ["--npus", str(targs.npus)])
        argv += ["--out", targs.out]
        if name == "train":
            argv += ["--trace", os.path.join(targs.out, "train_step_trace.json")]
        if targs.no_progress:
            argv.append("--no-progress")
        args = parse(name, argv)
        print(f"\n## {name}: python -m benchmarks {name} {' '.join(argv)}\n", flush=True)
        report = run_one(name, args)
        reports[name] = report
        md += [f"## {name}", "", "```", f"python -m benchmarks {name} {' '.join(argv)}", "```",
               "", "```", *report.tables, "```", "", f"![{name}]({name}.png)", ""]
    summary = tour_summary(reports, targs.npus)
    print("\n" + summary, flush=True)
    md[2:2] = ["## Summary", "", "```", summary, "```", ""]
    path = os.path.join(targs.out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    print(f"# wrote {path}\n# tour finished in {time.perf_counter() - t0:.0f} s")
    return 0


def _geomean(vals):
    vals = [v for v in vals if v and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def tour_summary(reports: dict, npus: int) -> str:
    """What the tour found, in a few lines: host speedups over lax, and the same ops
    modeled on the supernode (strata vs buffer_centric)."""
    lines = ["# What the tour found"]
    coll = reports.get("collectives")
    if coll is not None:
        rows = [r for r in coll.rows if r.get("impl") == "strata" and r.get("status") == "ok"]
        mine = [r for r in rows if r.get("mode") == "strata"]
        for op in dict.fromkeys(r["op"] for r in mine):
            rs = [r for r in mine if r["op"] == op]
            sp = _geomean([r.get("speedup") for r in rs])
            big = max(rs, key=lambda r: r["size"])
            model = (f"modeled on the supernode at {big['size']} B: {big['modeled_busbw']:.3g} GB/s busbw, "
                     f"buffer_centric {big['modeled_bc_ratio']:.2f}x slower"
                     if big.get("modeled_busbw") else "no model")
            host = f"{sp:.2f}x lax (geomean over sizes)" if sp else "no lax peer"
            lines.append(f"  {op:<15} host: {host}; {model}")
    moe_r = reports.get("moe")
    if moe_r is not None:
        for r in moe_r.rows:
            if r.get("impl") == "strata" and r.get("mode") == "strata" and r.get("status") == "ok" \
                    and r["op"] in ("dispatch", "combine"):
                sp = f"{r['speedup']:.2f}x lax" if r.get("speedup") else "no lax peer"
                mod = (f"modeled {r['modeled_us']:.1f} us, buffer_centric {r['modeled_bc_ratio']:.2f}x slower"
                       if r.get("modeled_us") else "no model")
                lines.append(f"  moe {r['op']:<11} host: {sp}; {mod}")
    tr = reports.get("train")
    if tr is not None:
        for r in tr.rows:
            if r.get("impl") == "strata" and r.get("mode") == "strata" and r.get("status") == "ok":
                if r.get("speedup"):
                    lines.append(f"  training step   host: {r['step_ms']:.2f} ms, {r['speedup']:.2f}x lax")
                if r.get("traced_ops"):
                    lines.append(f"                  {r['traced_ops']} strata ops: "
                                 f"{r['traced_host_comm_ms']:.2f} ms on this host; modeled "
                                 f"{r['modeled_comm_strata_ms'] * 1e3:.1f} us on the supernode "
                                 f"(buffer_centric {r['modeled_comm_buffer_centric_ms'] * 1e3:.1f} us)")
                if r.get("modeled_step_ms"):
                    lines.append(f"                  the whole step modeled (compute + communication): "
                                 f"{r['modeled_step_ms'] * 1e3:.1f} us, "
                                 f"{r['modeled_exposed_comm_ms'] * 1e3:.1f} us of it exposed communication")
        if tr.params.get("trace_path"):
            lines.append(f"  trace of one training step: {tr.params['trace_path']} (open in ui.perfetto.dev)")
    srv = reports.get("serve")
    if srv is not None and srv.rows:
        p = srv.params
        by = {r["mode"]: r for r in srv.rows}
        st, bc = by.get("strata"), by.get("buffer_centric")
        if st and bc:
            lines.append(f"  {p['model']} decode, modeled on {p['npus']} NPUs ({p['dtype']}, batch "
                         f"{st['batch_per_npu']}/NPU, context {p['context']}): TPOT {st['tpot_ms']:.1f} ms, "
                         f"{st['tokens_per_s_per_npu']:.0f} tokens/s per NPU; buffer_centric "
                         f"{bc['tpot_ms'] / st['tpot_ms']:.2f}x the TPOT (published: 1943 tokens/s per NPU "
                         f"at TPOT < 50 ms)")
    lat = reports.get("latency")
    if lat is not None:
        for r in lat.rows:
            if r.get("impl") == "strata" and r.get("status") == "ok" and r.get("per_op_us") is not None:
                peer = next((p for p in lat.rows if p.get("impl") == "lax" and p.get("status") == "ok"
                             and (p["op"], p["npus"], p["size"], p["pattern"])
                             == (r["op"], r["npus"], r["size"], r["pattern"])), None)
                vs = f", lax {peer['per_op_us']:.1f} us" if peer and peer.get("per_op_us") else ""
                floors = [("copy call", r["copy_floor_us"]), ("barrier", r["barrier_floor_us"]),
                          ("async meet", r["meet_floor_us"]), ("out fill", r.get("fill_floor_us"))]
                floors_text = ", ".join(f"{name} {v:.1f} us" for name, v in floors if v is not None)
                lines.append(f"  small {r['op']:<13} {r['npus']} NPUs {r['size']} B {r['pattern']}: "
                             f"{r['per_op_us']:.1f} us per op{vs} (floors: {floors_text})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        name = argv[0]
        args = parse(name, argv[1:])
        if getattr(args, "impl", "all") == "lax":
            common.disable_strata("--impl lax")
        # Isolated collectives and latency start child processes that set their own devices;
        # model-only sweeps execute nothing on the host.
        if name != "latency" and not (name == "collectives" and collectives.isolated(args)) \
                and not getattr(args, "model_only", False):
            common.setup_devices(npus_for(name, args))
        run_one(name, args)
        return 0
    return tour(tour_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
