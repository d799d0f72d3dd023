"""`python -m benchmarks [collectives|moe|train|latency|serve] ...` — with no subcommand, a
short tour.

Arguments are parsed before JAX starts so that the emulated NPU count (CPU devices) and the
PjRt thread pool can still be set.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import textwrap
import time

from . import collectives, common, latency, moe, serve, style, train

SUBCOMMANDS = {
    "collectives": (collectives, "nccl-tests-style sweeps: strata vs lax, with a lower bound (floor)"),
    "moe": (moe, "MoE dispatch/combine/layer, strata vs the lax all_to_all reference"),
    "train": (train, "one MoE training step with strata vs lax collectives"),
    "latency": (latency, "per-op cost of small ops inside one program at 8/64/384 NPUs, with references"),
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


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (no usage block) and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser(name: str) -> argparse.ArgumentParser:
    mod, help_ = SUBCOMMANDS[name]
    p = Parser(prog=f"python -m benchmarks {name}", description=help_)
    mod.add_args(p)
    return p


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    """The subcommand's arguments; any bad value is one line from its parser and exit 2.

    Type functions raise argparse.ArgumentTypeError (argparse reports it); checks across
    arguments run in the module's `validate(args, parser)`, which its add_args installs with
    common.one_line_errors, so they run on every parse (here and under the top-level parser)."""
    p = build_parser(name)
    args = p.parse_args(argv)
    args._argv = list(argv)  # child processes of an isolated run repeat it with overrides
    return args


def _tour_npus(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= common.MAX_NPUS:
        raise argparse.ArgumentTypeError(f"{text!r} is not an NPU count in 1..{common.MAX_NPUS}")
    return n


def main_parser() -> argparse.ArgumentParser:
    """`python -m benchmarks [SUBCOMMAND ...]`: the subcommands, and the tour's own flags."""
    p = Parser(
        prog="python -m benchmarks",
        description="StrataCL benchmarks on emulated NPUs (CPU devices). With no subcommand: a "
                    "short tour of all of them (collectives sweep, MoE ops, training step, "
                    "small-op latency, the DeepSeek decode step modeled on the supernode) and "
                    "a summary of what it found.",
        epilog="Run `python -m benchmarks SUBCOMMAND -h` for a subcommand's flags.")
    p.add_argument("--out", default="bench_out", help="tour: output folder (bench_out)")
    p.add_argument("--npus", type=_tour_npus, default=8, help="tour: emulated NPUs (8)")
    p.add_argument("--quick", action="store_true",
                   help="tour: tiny sizes, a smoke run of every path (seconds)")
    p.add_argument("--no-progress", action="store_true", help="tour: no progress bar on stderr")
    sub = p.add_subparsers(dest="command", title="subcommands", metavar="SUBCOMMAND")
    for name, (mod, help_) in SUBCOMMANDS.items():
        mod.add_args(sub.add_parser(name, help=help_, description=help_))
    return p


tour_parser = main_parser  # the tour's flags live on the top-level parser


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
    machine = {"start": machine_state()}
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
        command = _wrap(f"#   python -m benchmarks {name} {' '.join(argv)}", 6)
        print(f"\n## {name}\n" + "\n".join(command) + "\n", flush=True)
        report = run_one(name, args)
        reports[name] = report
        md += [f"## {name}", "", "```", f"python -m benchmarks {name} {' '.join(argv)}", "```",
               "", "```", *report.tables, "```", "", f"![{name}]({name}.png)", ""]
    machine["end"] = machine_state()
    summary = tour_summary(reports, targs.npus, machine)
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


WIDTH = 120  # every summary line fits


_GLUE = "\x07"  # a space the wrapping must not break at


def _keep(text: str) -> str:
    """`text` kept on one line by _wrap ('21.1 ±5.9 us', '< noise (±8.0 us)')."""
    return text.replace(" ", _GLUE)


def _wrap(line: str, indent: int = 6) -> list[str]:
    """One summary line, wrapped at WIDTH with its continuation indented."""
    out = textwrap.wrap(line, WIDTH, subsequent_indent=" " * indent, break_on_hyphens=False)
    return [ln.replace(_GLUE, " ") for ln in out] or [""]


def _num(v, fmt: str, default: str = "?") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else default


def machine_state() -> dict:
    """The host's CPU count and 1-minute load average, for the summary."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "load": load}


def _machine_lines(machine: dict | None, lat) -> list[str]:
    """The load the tour ran under, and the launch noise latency measured."""
    lines = []
    if machine:
        start, end = machine.get("start") or {}, machine.get("end") or {}
        lines += _wrap(f"  machine: {start.get('cpus') or end.get('cpus') or '?'} CPUs, 1-minute load "
                       f"average {_num(start.get('load'), '.2f')} at the start, "
                       f"{_num(end.get('load'), '.2f')} at the end (near the CPU count: noisy timings)")
    rows = [r for r in lat.rows if r.get("launch_us") is not None] if lat is not None else []
    if rows:
        r = rows[0]
        lines += _wrap(f"  launch noise: an empty program took {_num(r['launch_us'], '.0f')} us, "
                       f"{_keep('±' + _num(r.get('launch_jitter_us'), '.1f') + ' us')} block to "
                       f"block, {_keep('±' + _num(r.get('launch_spread_us'), '.1f') + ' us')} over "
                       f"the run")
    return lines


def _latency_lines(lat) -> list[str]:
    """Per op: strata's and lax's cost with noise, and the speedup only where both stand above
    their noise; the references of the group (measured programs, not floors)."""
    from .latency import REFS, cost_text, speedup_text

    lines = []
    rows = [r for r in lat.rows if r.get("impl") in ("strata", "lax")]
    groups = dict.fromkeys((r.get("npus"), r.get("size"), r.get("pattern")) for r in rows)
    for (n, size, pattern) in groups:
        rs = [r for r in rows if (r.get("npus"), r.get("size"), r.get("pattern")) == (n, size, pattern)]
        k = next((r.get("chain") for r in rs if r.get("chain")), None)
        size_text = style.size_label(size) if isinstance(size, (int, float)) else str(size)
        lines += _wrap(f"  small ops, {n} NPUs, {size_text} per rank, {pattern}"
                       + (f", K={k}" if k else "") + ": cost per op inside one program, ± noise")
        for op in dict.fromkeys(r.get("op") for r in rs):
            st = next((r for r in rs if r.get("op") == op and r["impl"] == "strata"), None)
            lx = next((r for r in rs if r.get("op") == op and r["impl"] == "lax"), None)
            sp = speedup_text(st, lx)
            lines += _wrap(f"    {op:<14} strata {cost_text(st):<18} lax (XLA) {cost_text(lx):<18}"
                           + (f" speedup {sp}" if sp != "-" else ""))
        ref_row = next((r for r in rs if r.get("status") == "ok"), None)
        if ref_row:
            refs = [f"{name} {_keep(cost_text(ref_row, key))}" for key, name in REFS
                    if ref_row.get(f"{key}_us") is not None]
            fill = next((r for r in rs if r.get("fill_floor_us") is not None), None)
            if fill and ref_row.get("fill_floor_us") is None:
                refs.append(f"out fill {_keep(cost_text(fill, 'fill_floor'))}")
            if refs:
                lines += _wrap("    references (measured, not lower bounds): " + ", ".join(refs))
    return lines


def tour_summary(reports: dict, npus: int, machine: dict | None = None) -> str:
    """What the tour found, in a few lines of at most WIDTH columns: host speedups over lax,
    the same ops modeled on the supernode (strata vs buffer_centric), small-op costs with their
    noise, and the machine's load. `machine`: {"start": machine_state(), "end": ...}.
    Rows are read with .get: a missing key costs its number, not the summary."""
    lines = ["# What the tour found"]
    lines += _machine_lines(machine, reports.get("latency"))
    coll = reports.get("collectives")
    if coll is not None:
        rows = [r for r in coll.rows if r.get("impl") == "strata" and r.get("status") == "ok"]
        mine = [r for r in rows if r.get("mode") == "strata"]
        for op in dict.fromkeys(r.get("op") for r in mine):
            rs = [r for r in mine if r.get("op") == op]
            clear = [r for r in rs if r.get("speedup") and not r.get("speedup_within_noise")]
            sp = _geomean([r.get("speedup") for r in clear])
            big = max(rs, key=lambda r: r.get("size") or 0)
            model = (f"modeled at {style.size_label(big.get('size') or 0)}: "
                     f"{big['modeled_busbw']:.3g} GB/s busbw, buffer_centric "
                     f"{_num(big.get('modeled_bc_ratio'), '.2f')}x slower"
                     if big.get("modeled_busbw") else "no model")
            noisy = sum(1 for r in rs if r.get("speedup_within_noise"))
            if sp:
                host = (f"{sp:.2f}x lax (geomean over {len(clear)} sizes"
                        + (f"; {noisy} within noise, ≈1)" if noisy else ")"))
            elif noisy:
                host = "≈1x lax (every size within noise)"
            else:
                host = "no lax peer"
            lines += _wrap(f"  {op:<15} host: {host}; {model}", 18)
    moe_r = reports.get("moe")
    if moe_r is not None:
        for r in moe_r.rows:
            if r.get("impl") == "strata" and r.get("mode") == "strata" and r.get("status") == "ok" \
                    and r.get("op") in ("dispatch", "combine"):
                sp = ("≈1x lax (within noise)" if r.get("speedup_within_noise")
                      else f"{r['speedup']:.2f}x lax" if r.get("speedup") else "no lax peer")
                mod = (f"modeled {r['modeled_us']:.1f} us, buffer_centric "
                       f"{_num(r.get('modeled_bc_ratio'), '.2f')}x slower"
                       if r.get("modeled_us") else "no model")
                lines += _wrap(f"  moe {r['op']:<11} host: {sp}; {mod}", 18)
    tr = reports.get("train")
    if tr is not None:
        for r in tr.rows:
            if r.get("impl") == "strata" and r.get("mode") == "strata" and r.get("status") == "ok":
                if r.get("speedup") and r.get("step_ms"):
                    vs = ("≈1x lax (within noise)" if r.get("speedup_within_noise")
                          else f"{r['speedup']:.2f}x lax")
                    lines += _wrap(f"  training step   host: {r['step_ms']:.2f} ms, {vs}", 18)
                if r.get("traced_ops"):
                    st_us = (r.get("modeled_comm_strata_ms") or math.nan) * 1e3
                    bc_us = (r.get("modeled_comm_buffer_centric_ms") or math.nan) * 1e3
                    lines += _wrap(f"                  {r['traced_ops']} strata ops: "
                                   f"{_num(r.get('traced_host_comm_ms'), '.2f')} ms on this host; "
                                   f"modeled {_num(st_us, '.1f')} us on the supernode "
                                   f"(buffer_centric {_num(bc_us, '.1f')} us)", 18)
                if r.get("modeled_step_ms"):
                    lines += _wrap(f"                  the whole step modeled (compute + communication): "
                                   f"{r['modeled_step_ms'] * 1e3:.1f} us, "
                                   f"{_num((r.get('modeled_exposed_comm_ms') or math.nan) * 1e3, '.1f')}"
                                   f" us of it exposed communication", 18)
        if tr.params.get("trace_path"):
            lines += _wrap(f"  trace of one training step: {tr.params['trace_path']} "
                           f"(open in ui.perfetto.dev)")
    srv = reports.get("serve")
    if srv is not None and srv.rows:
        p = srv.params
        by = {r.get("mode"): r for r in srv.rows}
        st, bc = by.get("strata"), by.get("buffer_centric")
        if st and bc and st.get("tpot_ms") and bc.get("tpot_ms"):
            lines += _wrap(f"  {p.get('model', '?')} decode, modeled on {p.get('npus', '?')} NPUs "
                           f"({p.get('dtype', '?')}, batch {st.get('batch_per_npu', '?')}/NPU, context "
                           f"{p.get('context', '?')}): TPOT {st['tpot_ms']:.1f} ms, "
                           f"{_num(st.get('tokens_per_s_per_npu'), '.0f')} tokens/s per NPU; "
                           f"buffer_centric {bc['tpot_ms'] / st['tpot_ms']:.2f}x the TPOT "
                           f"(published: 1943 tokens/s per NPU at TPOT < 50 ms)")
    lat = reports.get("latency")
    if lat is not None:
        lines += _latency_lines(lat)
    return "\n".join(lines)


# How common's argument helpers (split_list, parse_size, parse_mesh) word a bad value: a
# ValueError worded so that a module's run raises is the user's flag, not a bug.
ARGUMENT_ERRORS = ("bad --", "bad size ")


def _only_lax(args) -> bool:
    impl = getattr(args, "impl", "all")
    return impl == "lax" or (isinstance(impl, (list, tuple)) and list(impl) == ["lax"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SUBCOMMANDS:
        name = argv[0]
        args = parse(name, argv[1:])
        if _only_lax(args):
            common.disable_strata("--impl lax")
        # Isolated collectives and latency start child processes that set their own devices;
        # model-only sweeps execute nothing on the host.
        if name != "latency" and not (name == "collectives" and collectives.isolated(args)) \
                and not getattr(args, "model_only", False):
            common.setup_devices(npus_for(name, args))
        try:
            run_one(name, args)
        except ValueError as e:  # a flag checked only when the run reads it (no validate yet)
            if not str(e).startswith(ARGUMENT_ERRORS):
                raise
            build_parser(name).error(str(e))
        return 0
    p = main_parser()
    targs = p.parse_args(argv)  # --help, a bad flag, or an unknown subcommand end here
    if targs.command:  # tour flags before a subcommand: its own flags must follow it
        p.error(f"put the subcommand first: python -m benchmarks {targs.command} [flags]")
    return tour(targs)


if __name__ == "__main__":
    sys.exit(main())
