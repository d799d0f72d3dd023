"""The benchmark CLI's top level, the tour's summary and the latency benchmark's output, as a
newcomer reads them: every subcommand in --help, one-line errors, no number that noise made
(no negative cost or speedup, '< noise' instead), lines that fit 120 columns, and a plot that
marks rather than drops the costs within the noise.

Fast: one small latency run (8 NPUs, two ops) in a subprocess; the rest is pure Python."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a top-level folder of the repo, not installed

from benchmarks import __main__ as cli  # noqa: E402
from benchmarks import common, latency, style  # noqa: E402

NEGATIVE = re.compile(r"(?<![\w.])[-\u2212]\s?\d")  # "-5.4", "- 5", "−20.5"; not "1-minute"
from test_benchmarks_smoke import run_cli_raw as run_cli  # noqa: E402 - the finished process


# ----------------------------------------------------------------------------------------------
# The CLI's top level


def test_help_lists_every_subcommand_with_its_help():
    proc = run_cli("--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "SUBCOMMAND" in proc.stdout.split("\n\n")[0], proc.stdout  # in the usage
    out = " ".join(proc.stdout.split())  # argparse wraps the help text
    for name, (_, help_) in cli.SUBCOMMANDS.items():
        # its own line in the subcommands section, then its help
        assert re.search(rf"^\s+{name}\s+\S", proc.stdout, re.M), (name, proc.stdout)
        assert " ".join(help_.split()[:4]) in out, (name, help_)
    for flag in ("--out", "--npus", "--quick", "--no-progress"):  # the tour's own flags
        assert flag in out


@pytest.mark.parametrize("argv, names", [
    (["latency", "--op", "allreduce"], ["all_reduce", "ppermute"]),
    (["latency", "--pattern", "sequential"], ["chained", "independent"]),
    (["latency", "--impl", "nccl"], ["strata", "lax"]),
    (["latency", "--sizes", "4X"], ["K/M/G"]),
    (["latency", "--npus", "0"], ["1..384"]),
    (["latency", "--npus", "8,x"], ["1..384"]),
    (["latency", "--chain", "2,3"], ["--chain"]),
    (["nosuch"], ["latency", "collectives"]),
    (["--npus", "many"], ["1..384"]),
    # a flag another module checks only when its run reads it
    (["collectives", "--mode", "x", "--npus", "8"], ["strata", "buffer_centric"]),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, names):
    proc = run_cli(*argv, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])


def test_parse_keeps_argv_and_parses_lists():
    """Isolated runs re-launch children from args._argv; the list flags arrive parsed."""
    argv = ["--npus", "8,64", "--sizes", "1K,4K", "--op", "all_reduce,moe", "--chain", "4,2"]
    args = cli.parse("latency", argv)
    assert args._argv == argv
    assert args.npus == [8, 64] and args.sizes == [1024, 4096]
    assert args.ops == ["all_reduce", "moe"] and args.impl == list(latency.IMPLS)
    assert latency.chains(args) == {8: 4, 64: 2}


def test_a_validate_error_is_a_parser_error(monkeypatch, capsys):
    """A module's validate(args, parser) runs after parsing; its ValueError is parser.error."""
    def validate(args, parser):
        raise ValueError("--tokens must be positive")

    monkeypatch.setattr(cli.moe, "validate", validate, raising=False)
    with pytest.raises(SystemExit) as e:
        cli.parse("moe", [])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokens must be positive" in err[0], err


# ----------------------------------------------------------------------------------------------
# Numbers with their noise


def test_noisy_value():
    assert style.noisy_value(12.34, 0.8) == "12.3 ±0.8 us"
    assert style.noisy_value(12.34, 0.0) == "12.3 us"
    assert style.noisy_value(-5.4, 8.0) == "< noise (±8.0 us)"
    assert style.noisy_value(-5.4, 0.0) == "< noise (±0.0 us)"
    assert style.noisy_value(3.0, 8.0) == "< noise (±8.0 us)"
    assert style.noisy_value(8.0, 8.0) == "< noise (±8.0 us)"  # at the noise is not above it
    assert style.noisy_value(None, 1.0) == "n/a"
    assert style.noisy_value(float("nan"), 1.0) == "n/a"
    assert style.noisy_value(2.5, -1.0) == "2.5 us"  # a negative noise is no noise
    assert style.noisy_value(1234.5, 10.0, unit="ms", digits=0) == "1234 ±10 ms"
    assert style.within_noise(-1.0, 0.0) and style.within_noise(None, 1.0)
    assert not style.within_noise(2.0, 1.0)


def _lat_row(op, impl, per_op, spread, **kw):
    row = {"npus": 8, "size": 1024, "op": op, "impl": impl, "pattern": "chained", "status": "ok",
           "reason": None, "chain": 8, "launch_us": 170.3, "launch_spread_us": 12.0,
           "launch_jitter_us": 6.0, "per_op_us": per_op, "per_op_spread_us": spread,
           "copy_floor_us": -1.6, "copy_floor_spread_us": 2.0,
           "barrier_floor_us": 14.6, "barrier_floor_spread_us": 3.0,
           "meet_floor_us": -0.3, "meet_floor_spread_us": 2.0,
           "fill_floor_us": -2.0 if op == "all_gather" else None,
           "fill_floor_spread_us": 2.0 if op == "all_gather" else None, "matches_peer": True}
    row.update(kw)
    return row


def synthetic_latency_rows():
    """What the newcomer saw: per-op costs below zero, within the noise, and above it."""
    return [
        _lat_row("all_reduce", "strata", 3.8, 1.0), _lat_row("all_reduce", "lax", 143.0, 5.0),
        _lat_row("all_gather", "strata", -5.4, 2.5), _lat_row("all_gather", "lax", 147.2, 4.0),
        _lat_row("all_to_all", "strata", -20.5, 6.0), _lat_row("all_to_all", "lax", 141.4, 9.0),
        _lat_row("broadcast", "strata", 4.0, 9.0), _lat_row("broadcast", "lax", -21.1, 30.0),
        # an older row with no spread keys at all, and a cell that failed
        {"npus": 8, "size": 1024, "op": "ppermute", "impl": "strata", "pattern": "chained",
         "status": "ok", "per_op_us": -4.8, "launch_us": 170.3},
        {"npus": 8, "size": 1024, "op": "ppermute", "impl": "lax", "pattern": "chained",
         "status": "aborted", "reason": "aborted: XLA"},
    ]


def test_tour_summary_prints_no_number_noise_made():
    reports = {
        "latency": common.Report("latency", {}, rows=synthetic_latency_rows()),
        # the other tables are being reworked: rows with keys missing must not break the summary
        "collectives": common.Report("collectives", {}, rows=[
            {"impl": "strata", "mode": "strata", "status": "ok", "op": "all_reduce", "size": 4096},
            {"impl": "strata", "mode": "strata", "status": "ok", "op": "all_gather"}]),
        "moe": common.Report("moe", {}, rows=[
            {"impl": "strata", "mode": "strata", "status": "ok", "op": "dispatch"}]),
        "train": common.Report("train", {}, rows=[
            {"impl": "strata", "mode": "strata", "status": "ok", "traced_ops": 3}]),
        "serve": common.Report("serve", {}, rows=[
            {"mode": "strata", "tpot_ms": 20.0}, {"mode": "buffer_centric", "tpot_ms": 22.0}]),
    }
    machine = {"start": {"cpus": 2, "load": 0.15}, "end": {"cpus": 2, "load": 1.9}}
    text = cli.tour_summary(reports, 8, machine)
    assert not NEGATIVE.search(text), text
    assert "< noise" in text and "n/a (noise)" in text, text
    assert "floor" not in text.lower(), text  # measured programs are references, not floors
    assert "load average 0.15 at the start, 1.90 at the end" in text, text
    assert "launch noise" in text and "±6.0 us" in text, text
    assert "aborted" in text, text
    assert all(len(line) <= 120 for line in text.splitlines()), text
    # a speedup is printed where both costs stand above their noise, and only there
    speedups = re.findall(r"speedup ([\d.]+x|n/a \(noise\))", text)
    assert speedups.count("37.6x") == 1 and "n/a (noise)" in speedups, text


def test_latency_table_prints_no_number_noise_made():
    rows = synthetic_latency_rows()
    latency._add_speedups(rows)
    assert [r["speedup"] for r in rows if r["impl"] == "strata"][1:] == [None] * 4
    for verbose in (False, True):
        table = latency._table(rows, 8, 8, verbose=verbose)
        assert not NEGATIVE.search(table), table
        assert "< noise" in table and "n/a (noise)" in table and "aborted" in table
        assert all(len(line) <= 120 for line in table.splitlines()), table
        # the table of every reference and the launch: --verbose only
        assert ("references (same pattern" in table) == verbose


# ----------------------------------------------------------------------------------------------
# The plot


def test_latency_plot_marks_costs_within_noise_instead_of_dropping_them(tmp_path):
    rows = [r for r in synthetic_latency_rows() if r["op"] != "ppermute"]
    report = common.Report("latency", {}, rows=rows)
    fig, ax = latency.figure(report)
    try:
        bars = [p for p in ax.patches if p.get_height() > 0]
        assert len(bars) == len(rows)  # one bar per cost, none lost to the log axis
        hatched = [p for p in bars if p.get_hatch()]
        within = [r for r in rows if not latency.above_noise(r)]
        assert len(hatched) == len(within) == 4
        assert sum(t.get_text() == "< noise" for t in ax.texts) == len(within)
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert style.series("strata")["label"] in labels and style.series("lax")["label"] in labels
    finally:
        common.pyplot().close(fig)
    path = tmp_path / "latency.png"
    latency.plot(report, str(path))
    assert path.stat().st_size > 0


# ----------------------------------------------------------------------------------------------
# A real run


def test_latency_default_output_is_narrow_and_never_negative(tmp_path):
    proc = run_cli("latency", "--npus", "8", "--sizes", "1K", "--op", "all_reduce,all_gather",
                   "--pattern", "chained", "--chain", "2", "-n", "3", "-w", "1", "--repeats", "2",
                   "--no-progress", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [ln for ln in proc.stdout.splitlines() if ln.strip() and not ln.startswith("# wrote")]
    assert table and all(len(ln) <= 120 for ln in table), proc.stdout
    body = [ln for ln in table if not ln.startswith("#")]
    assert len(body) == 2, proc.stdout
    for ln in body:
        assert not NEGATIVE.search(ln), ln
        assert " us" in ln  # costs carry their unit and noise
    data = json.loads((tmp_path / "latency.json").read_text())
    for r in data["rows"]:
        assert r["status"] == "ok", r
        assert r["per_op_spread_us"] is not None and r["per_op_spread_us"] >= 0, r
        assert r["launch_jitter_us"] is not None and r["meet_floor_spread_us"] is not None, r
        assert len(r["program_rounds_us"]) == len(r["launch_rounds_us"]) == 2, r
    strata_rows = [r for r in data["rows"] if r["impl"] == "strata"]
    assert all("speedup" in r for r in strata_rows)


def test_the_quick_tour_reads_well_end_to_end(tmp_path):
    """The README's main job at its smallest: every line fits 120 columns, no negative number
    anywhere in what it prints, the summary is there and every subcommand wrote its plot."""
    proc = run_cli("--quick", "--no-progress", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "# What the tour found" in lines
    wide = [ln for ln in lines if len(ln) > 120]
    assert not wide, wide
    negative = [ln for ln in lines if NEGATIVE.search(ln)]
    assert not negative, negative
    for name in ("collectives", "moe", "train", "latency", "serve"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0, name
