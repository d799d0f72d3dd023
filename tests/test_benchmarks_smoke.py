"""Smoke test of the benchmark suite: every subcommand runs with tiny sizes, prints its table,
writes JSON/CSV/PNG, and every measured row is exact (#wrong == 0).

The CLI runs in a subprocess: it must set the emulated NPU count before JAX starts, which this
test process (conftest) has already done for itself."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `benchmarks` is a top-level folder of the repo, not installed

from benchmarks import collectives, common  # noqa: E402


def run_cli_raw(*argv, timeout=300):
    """`python -m benchmarks ARGV` as a user runs it, from the checkout; the finished process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "PJRT_NPROC", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_cli(*argv, timeout=300):
    proc = run_cli_raw(*argv, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def check_rows(path, min_ok):
    data = json.loads(Path(path).read_text())
    rows = data["rows"]
    errors = [(r.get("op"), r["impl"], r["mode"], r["reason"]) for r in rows
              if r["status"] == "error"]
    assert not errors, f"rows that failed: {errors}"
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) >= min_ok, f"only {len(ok)} rows ran: {rows}"
    wrong = [(r.get("op"), r["impl"], r["mode"], r["wrong"]) for r in ok if r.get("wrong")]
    assert not wrong, f"#wrong != 0: {wrong}"
    return data


def test_collectives_cli(tmp_path):
    out = run_cli("collectives", "-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-w", "1",
                  "--npus", "8", "--mode", "all", "--repeats", "2", "--out", str(tmp_path))
    assert "#wrong" in out and "Avg bus bandwidth" in out and "launch" in out
    data = check_rows(tmp_path / "collectives.json", min_ok=len(collectives.OPS) * 2)
    for r in data["rows"]:  # every variant timed once per interleaved round, floor and launch too
        if r["status"] == "ok":
            assert len(r["rounds_us"]) == 2 and r["floor_us"] > 0 and r["launch_us"] > 0, r
    lax = [r for r in data["rows"] if r["impl"] == "lax"]
    assert lax and all(r["status"] == "ok" and r["wrong"] == 0 for r in lax)
    # Plain jax.device_put inputs for every row; arena inputs only in the extra strata row.
    for r in data["rows"]:
        assert r["alloc"] == ("strata.memory" if r["mode"] == collectives.ARENA else "jax"), r
    assert {r["op"] for r in data["rows"] if r["mode"] == collectives.ARENA} == set(collectives.OPS)
    assert (tmp_path / "collectives.csv").stat().st_size > 0
    assert (tmp_path / "collectives.png").stat().st_size > 0


def test_collectives_cli_mesh_and_dtype(tmp_path):
    run_cli("collectives", "-b", "256", "-e", "256", "-n", "2", "-w", "1", "--mesh", "2x4",
            "-d", "int32", "-o", "max", "--op", "all_reduce,reduce_scatter,all_to_all",
            "--json", str(tmp_path / "c.json"))
    data = check_rows(tmp_path / "c.json", min_ok=3)
    assert data["params"]["mesh"] == [2, 4]


def test_moe_cli(tmp_path):
    out = run_cli("moe", "--tokens", "32", "--hidden", "64", "--topk", "2", "--experts", "16",
                  "--ffn", "32", "--capacity-factor", "0.75", "-n", "2", "-w", "1",
                  "--out", str(tmp_path))
    assert "dispatch" in out and "combine" in out and "#wrong" in out
    data = check_rows(tmp_path / "moe.json", min_ok=3)
    assert data["params"]["dropped_pairs"] > 0  # the drop path was exercised


def test_train_cli(tmp_path):
    out = run_cli("train", "--tokens", "32", "--hidden", "32", "--ffn", "32", "--experts", "16",
                  "--topk", "2", "-n", "2", "-w", "1", "--out", str(tmp_path))
    assert "step" in out
    check_rows(tmp_path / "train.json", min_ok=1)


def test_train_cli_lax_in_child(tmp_path):
    """--isolate on: the lax step runs in a child process (as above 64 NPUs, where XLA can
    abort in its own rendezvous) and its parameters still check the strata step."""
    run_cli("train", "--tokens", "32", "--hidden", "32", "--ffn", "32", "--experts", "16",
            "--topk", "2", "-n", "2", "-w", "1", "--isolate", "on", "--out", str(tmp_path))
    data = check_rows(tmp_path / "train.json", min_ok=2)
    lax = [r for r in data["rows"] if r["impl"] == "lax"]
    assert len(lax) == 1 and lax[0]["status"] == "ok" and lax[0]["step_ms"] > 0
    strata_rows = [r for r in data["rows"] if r["impl"] == "strata" and r["status"] == "ok"]
    assert strata_rows and all(r["wrong"] == 0 and r["speedup"] > 0 for r in strata_rows)


def test_latency_cli(tmp_path):
    out = run_cli("latency", "--npus", "8", "--sizes", "1K", "--chain", "2", "-n", "2", "-w", "1",
                  "--repeats", "2", "--out", str(tmp_path))
    assert "per-op cost" in out and "barrier" in out
    data = json.loads((tmp_path / "latency.json").read_text())
    rows = data["rows"]
    from benchmarks import latency

    assert {(r["op"], r["impl"], r["pattern"]) for r in rows} == {
        (op, impl, pat) for op in latency.OPS for impl in latency.IMPLS for pat in latency.PATTERNS}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["per_op_us"] is not None and len(r["rounds_us"]) == 2, r
        assert r["copy_floor_us"] is not None and r["barrier_floor_us"] is not None, r
        assert r["meet_floor_us"] is not None, r
        # the output-fill floor belongs to all_gather's rows alone
        assert (r["fill_floor_us"] is not None) == (r["op"] == "all_gather"), r
        # strata's chained/independent programs compute what lax's do
        assert r["matches_peer"] is True, r
    # each pattern is set beside floors measured in that pattern (two timings of different
    # programs: equal values would mean one pattern's floor was copied to the other)
    for floor in ("copy_floor_us", "barrier_floor_us", "meet_floor_us"):
        by_pattern = {r["pattern"]: r[floor] for r in rows if r["op"] == "all_reduce"}
        assert by_pattern["chained"] != by_pattern["independent"], (floor, by_pattern)
    assert (tmp_path / "latency.png").stat().st_size > 0


def test_latency_chain_per_npu_count():
    from benchmarks import latency

    def parse(npus, chain):
        return latency.chains(argparse.Namespace(npus=npus, chain=chain))

    assert parse("8,64,384", "32,16,8") == {8: 32, 64: 16, 384: 8}
    assert parse("8,384", "12") == {8: 12, 384: 12}
    for bad in ("32,16", "0", "x"):
        with pytest.raises(SystemExit):
            parse("8,64,384", bad)


# Pure helpers (no devices needed)

def test_sizes():
    assert common.parse_size("4K") == 4096 and common.parse_size("1M") == 1 << 20
    assert common.parse_size("2G") == 2 << 30 and common.parse_size("100") == 100
    assert common.size_sweep(1024, 16384, 4) == [1024, 4096, 16384]
    with pytest.raises(ValueError):
        common.parse_size("4X")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "uint8", "float32"])
@pytest.mark.parametrize("redop", ["sum", "prod", "max", "min"])
@pytest.mark.parametrize("n", [8, 384])
def test_inputs_keep_reductions_exact(dtype, redop, n):
    """The #wrong check relies on every reduction of the inputs being exactly representable."""
    spec = collectives.SPECS["all_reduce"]
    vals = collectives.make_values(spec, redop, dtype, n, 64)
    dt = collectives.np_dtype(dtype)
    exact = collectives.reduce_np(vals, redop)
    assert np.array_equal(exact.astype(dt).astype(np.float64), exact.astype(np.float64))
    assert np.array_equal(vals.astype(dt).astype(np.int64), vals)  # inputs exact too
    if redop == "sum":
        assert len(np.unique(vals[:, 0])) > 1 or n > 255  # depends on the rank


def test_ref_copy_copies_and_refuses_a_mismatched_output():
    """The latency floors' copying call: the output is the input; an output of another size
    is an error, not a partial copy."""
    import jax
    import stratacl_jax  # noqa: F401 - registers the reference handlers

    x = np.random.default_rng(3).standard_normal(37).astype(np.float32)
    call = jax.ffi.ffi_call("strata_ref_copy", jax.ShapeDtypeStruct((37,), np.float32))
    np.testing.assert_array_equal(np.asarray(jax.jit(call)(x)), x)
    bad = jax.ffi.ffi_call("strata_ref_copy", jax.ShapeDtypeStruct((3 * 37,), np.float32))
    with pytest.raises(Exception, match="strata_ref_copy: the output's size differs"):
        jax.block_until_ready(jax.jit(bad)(x))


@pytest.mark.parametrize("kind", ["meet", "fill", "barrier"])
@pytest.mark.parametrize("pattern", ["chained", "independent"])
def test_meeting_floors_compute_what_they_claim(mesh8, kind, pattern):
    """The meeting floors' result, against numpy: each rank's own values with element 0 the
    group's sum of element 0, scaled by 1/N, once per step (fill writes an all_gather's N-times
    output first and slices it). A floor that skipped its meeting or its output would fail."""
    from benchmarks import latency

    n, k = 8, 3
    x = np.random.default_rng(7).standard_normal((n, 5)).astype(np.float32)

    def step_np(v):  # v: [n, 5], one row per rank
        v = v.copy()
        v[:, 0] = v[:, 0].sum()
        return v * np.float32(1.0 / n)

    if pattern == "chained":
        want = x
        for _ in range(k):
            want = step_np(want)
    else:
        want = sum(step_np(x + np.float32(i)) for i in range(k))
    prog = latency.program(latency.ref_step(kind, "x", n), pattern, k, mesh8, "x")
    got = np.asarray(prog(x.reshape(-1))).reshape(n, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_latency_peer_child_that_outlives_its_timeout_reads_timed_out(monkeypatch):
    """Above 64 NPUs a lax child gets --peer-timeout (lax's MoE at 384 compiles for minutes):
    its cells read 'timed out' with the reason, strata's children keep the long timeout, and
    the run goes on."""
    from benchmarks import __main__ as cli
    from benchmarks import latency

    seen = []

    def fake_run_child(sub, argv, timeout):
        impl = argv[argv.index("--impl") + 1]
        seen.append((impl, timeout))
        return ("timeout", "still compiling") if impl == "lax" else (0, "")

    monkeypatch.setattr(common, "run_child", fake_run_child)
    args = cli.parse("latency", ["--npus", "384", "--op", "all_reduce", "--peer-timeout", "7",
                                 "--no-progress", "--out", ""])
    report = latency.run(args)
    assert sorted(seen) == [("lax", 7), ("strata", 1200)]
    lax_rows = [r for r in report.rows if r["impl"] == "lax"]
    assert lax_rows and all(r["status"] == "timed out" for r in lax_rows), lax_rows
    assert all(r["reason"].startswith("timed out after 7 s") for r in lax_rows), lax_rows
    table = latency._table(report.rows, 384, 8)
    assert "timed out" in table


# --- issue 30: collectives/moe/train output and CLI ---

import re  # noqa: E402

WIDTH = 120


@pytest.mark.parametrize("argv, says", [
    (["collectives", "--op", "allreduce"], "all_reduce"),  # names the valid ops
    (["collectives", "-b", "1M", "-e", "4K"], "-b 1M is larger than -e 4K"),
    (["collectives", "-b", "4Q"], "bad size '4Q'"),
    (["collectives", "--mode", "fast"], "buffer_centric"),
    (["collectives", "--impl", "nccl"], "strata, lax"),
    (["collectives", "--mesh", "2xq"], "--mesh"),
    (["collectives", "-d", "float99"], "float32"),
    (["collectives", "-o", "mean"], "sum, prod, max, min, avg"),
    (["collectives", "--npus", "8", "--mesh", "2x2"], "does not match"),
    (["collectives", "--root", "8"], "--root 8"),
    (["moe", "--ops", "dispatsh"], "dispatch"),
    (["moe", "--experts", "12", "--npus", "8"], "multiple of --npus"),
    (["train", "--mode", "x"], "strata, buffer_centric"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, says):
    """A bad command line: exit status 2, one line on stderr that says what is wrong, no
    traceback, nothing on stdout (it fails before JAX starts)."""
    proc = run_cli_raw(*argv, timeout=60)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert len(err) == 1, err
    assert says in err[0] and "error" in err[0], err
    assert not proc.stdout.strip(), proc.stdout


def _data_lines(text):
    return [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def test_collectives_default_output_is_compact_and_honest(tmp_path):
    """Default output: every line <= 120 characters, sizes as 4K, no negative number in any
    table cell, a share of the floor never above 100% (nor 'beaten!'), every time carrying its
    spread, legends from style, a plot written."""
    proc = run_cli_raw("collectives", "-b", "1K", "-e", "16K", "-f", "4", "-n", "4", "-w", "1",
                       "--npus", "8", "--mode", "all", "--op", "all_reduce,all_gather,broadcast",
                       "--no-progress", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    long = [ln for ln in out.splitlines() if len(ln) > WIDTH]
    assert not long, long
    rows = _data_lines(out)
    assert rows and all(re.match(r"^\s+(1K|4K|16K)\s", ln) for ln in rows), rows
    for ln in rows:  # no negative number anywhere in a row (times, speedups, shares)
        assert not re.search(r"(?<![\w.])-\d", ln), ln
        assert "beaten" not in ln, ln
        assert "±" in ln, ln  # strata time carries its spread
    assert "strata (strata)" not in out and "of floor" in out and "--verbose" in out
    data = check_rows(tmp_path / "collectives.json", min_ok=3 * 3 * 4)
    for r in data["rows"]:
        if r["status"] != "ok":
            continue
        assert r["time_us"] > 0 and r["spread_us"] >= 0 and len(r["blocks_us"]) >= 2, r
        assert 0 < r["floor_share"] <= 1 and not r["floor_beaten"], r
        assert r["floor_bytes"] == r["npus"] * r["out_bytes"], r
        assert r["ref_us"] > 0, r  # the memory reference is kept, under its own name
        if r.get("speedup") is not None:
            assert r["speedup"] > 0 and isinstance(r["speedup_within_noise"], bool), r
        assert r.get("minus_launch_us") is None or r["minus_launch_us"] > 0, r
    assert (tmp_path / "collectives.png").stat().st_size > 0


def test_collectives_verbose_keeps_the_details(tmp_path):
    out = run_cli("collectives", "-b", "1K", "-e", "1K", "-n", "2", "-w", "1", "--npus", "4",
                  "--op", "all_gather", "--verbose", "--alloc", "jax")
    assert "mem ref" in out and "algbw" in out and "- launch" in out and "memory reference" in out
    assert "floor" in out
    for ln in _data_lines(out):
        assert not re.search(r"(?<![\w.])-\d", ln), ln


def test_collectives_all_reductions_and_dtypes(tmp_path):
    """nccl-tests' -o all -d all: every reduction of every dtype runs (or is skipped with its
    reason: bool does not reduce, integers have no avg), every result exact."""
    out = run_cli("collectives", "-o", "all", "-d", "all", "--op", "all_reduce,all_gather",
                  "-b", "256", "-e", "256", "-n", "2", "-w", "0", "--npus", "4", "--alloc", "jax",
                  "--json", str(tmp_path / "c.json"))
    data = check_rows(tmp_path / "c.json", min_ok=1)
    rows = data["rows"]
    assert set(data["params"]["dtypes"]) == set(collectives.DTYPES)
    assert data["params"]["redops"] == list(collectives.REDOPS)
    got = {(r["op"], r["dtype"], r["redop"]) for r in rows if r["status"] == "ok"}
    for dt in collectives.DTYPES:
        assert ("all_gather", dt, "none") in got, dt
        if dt == "bool":
            continue
        for red in collectives.REDOPS:
            if red == "avg" and not dt.startswith(("float", "bfloat")):
                continue
            assert ("all_reduce", dt, red) in got, (dt, red)
    skipped = {(r["dtype"], r["redop"]) for r in rows if r["status"] == "skipped"}
    assert ("int32", "avg") in skipped and ("bool", "sum") in skipped
    assert "bool does not reduce" in out and "avg of int32" in out
    assert all(len(ln) <= WIDTH for ln in out.splitlines())


def test_moe_and_train_tables_fit_and_plot(tmp_path):
    out = run_cli("moe", "--tokens", "32", "--hidden", "64", "--topk", "2", "--experts", "16",
                  "--ffn", "32", "-n", "2", "-w", "1", "--mode", "all", "--out", str(tmp_path))
    out += run_cli("train", "--tokens", "32", "--hidden", "32", "--ffn", "32", "--experts", "16",
                   "--topk", "2", "-n", "2", "-w", "1", "--mode", "all", "--repeats", "1",
                   "--out", str(tmp_path))
    assert all(len(ln) <= WIDTH for ln in out.splitlines()), \
        [ln for ln in out.splitlines() if len(ln) > WIDTH]
    for ln in _data_lines(out):
        assert not re.search(r"(?<![\w.])-\d", ln.split("   ")[0] if "skipped" in ln else ln) \
            or "e-" in ln, ln
    # train's labels fit their column: the longest one is right-aligned, not spilling over
    assert "strata, buffer_centric mode" in out and "+strata.moe" not in out
    for name in ("moe", "train"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0
        for r in json.loads((tmp_path / f"{name}.json").read_text())["rows"]:
            if r.get("speedup") is not None:
                assert r["speedup"] > 0 and "speedup_within_noise" in r, r


def test_speedup_within_noise_prints_as_such():
    cell, sp, within = common.fmt_speedup(100.0, 95.0, 4.0, 3.0)
    assert cell == "≈1" and within and sp == pytest.approx(100 / 95)
    cell, sp, within = common.fmt_speedup(200.0, 100.0, 4.0, 3.0)
    assert cell == "2.00" and not within
    assert common.fmt_speedup(None, 1.0)[0] == "N/A"
    assert common.fmt_time(294.61, 12.3) == "294.6 ±12.3" and common.fmt_time(2472.1, 120.4) == "2472 ±120"
    assert common.fmt_time(None) == "N/A"


def test_fit_width_wraps_comments_and_cuts_notes():
    text = "# " + "word " * 60 + "\n" + " 4K 1.0" + " note" * 40
    lines = common.fit_width(text, 60).splitlines()
    assert all(len(ln) <= 60 for ln in lines) and lines[0].startswith("# ")
    assert lines[-1].endswith("...") and all(ln.startswith("#") for ln in lines[:-1])


def test_write_floor_is_a_minimum_and_cached():
    a = common.write_floor_us(1 << 20)
    assert a > 0 and common.write_floor_us(1 << 20) == a  # measured once per run
    buf = np.ones(1 << 20, dtype=np.uint8)
    import time as _time

    t0 = _time.perf_counter()
    buf.fill(3)
    once = (_time.perf_counter() - t0) * 1e6
    assert a <= once * 1.5 + 1  # the best of many fills is not slower than one fill


def test_log_plot_marks_values_it_cannot_draw():
    """On a log axis a missing or non-positive value is a marker at the axis bottom with a
    legend entry, not a silently shorter line."""
    plt = common.pyplot()
    fig, ax = plt.subplots()
    ax.set_yscale("log")
    n = common.log_plot(ax, [1, 2, 3, 4], [1.0, None, 0.0, 2.0], key="strata")
    assert n == 2
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert labels[0] == "strata" and "no value" in labels[1]
    assert list(ax.get_lines()[0].get_xdata()) == [1, 4]
    assert list(ax.get_lines()[1].get_xdata()) == [2, 3]
    plt.close(fig)


def test_plots_use_style_labels(tmp_path):
    """The collectives plot's legend reads style's labels ('strata', 'lax (XLA)'), not
    'strata (strata)'."""
    from benchmarks import style

    rows = []
    for size in (4096, 16384):
        for impl, mode in (("lax", None), ("strata", "strata"), ("strata", "buffer_centric")):
            rows.append({"op": "all_reduce", "impl": impl, "mode": mode, "size": size,
                         "dtype": "float32", "redop": "sum", "status": "ok",
                         "busbw": 0.0 if mode == "buffer_centric" and size == 4096 else 1.0,
                         "s_bytes": size, "bus_factor": 1.75, "floor_us": 1.0})
    report = common.Report("collectives", {"ops": ["all_reduce"], "modes": ["strata", "buffer_centric"],
                                           "npus": 8, "dtype": "float32", "dtypes": ["float32"],
                                           "redops": ["sum"]}, rows)
    seen = {}
    plt = common.pyplot()
    orig = plt.Figure.savefig

    def grab(fig, path, **kw):
        seen["labels"] = [ln.get_label() for ax in fig.axes for ln in ax.get_lines()]
        seen["title"] = fig._suptitle.get_text()
        return orig(fig, path, **kw)

    plt.Figure.savefig = grab
    try:
        collectives.plot(report, str(tmp_path / "c.png"))
    finally:
        plt.Figure.savefig = orig
    assert style.series("lax")["label"] in seen["labels"]
    assert "strata" in seen["labels"] and "strata (strata)" not in seen["labels"]
    assert any("no value" in lbl for lbl in seen["labels"])  # the 0.0 busbw is marked
    assert "no value" in seen["title"]
    assert (tmp_path / "c.png").stat().st_size > 0
