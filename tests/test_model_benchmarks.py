"""The benchmarks' modeled side: --model-only sweeps (no host execution) and the modeled
columns of host tables, through the CLI as a user runs them."""
import json

from test_benchmarks_smoke import run_cli  # noqa: F401 - the CLI as a user runs it


def test_collectives_model_only_sweep(tmp_path):
    out = run_cli("collectives", "--model-only", "--model-npus", "8,384", "--model-sizes", "1K..256K",
                  "--op", "all_reduce,all_to_all", "--no-progress", "--out", str(tmp_path))
    assert "all_to_all  modeled on cloudmatrix384  N=384" in out
    data = json.loads((tmp_path / "collectives_model.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 9
    # less than one float32 per rank is skipped (said so), not timed as 0 us: only 1K at 384
    skipped = [(r["op"], r["npus"], r["size"]) for r in rows if r["status"] != "ok"]
    assert skipped == [("all_to_all", 384, 1024)], skipped
    assert "less than one float32 per rank" in out
    rows = [r for r in rows if r["status"] == "ok"]
    for r in rows:
        assert 0 < r["strata_us"] <= r["bc_us"] and r["ratio"] >= 1
    assert (tmp_path / "collectives_model.png").stat().st_size > 0


def test_moe_model_only_at_deepep_shape(tmp_path):
    out = run_cli("moe", "--model-only", "--model-npus", "8,16", "--out", str(tmp_path))
    assert "tokens/rank=4096 hidden=7168 top-8 experts=256 bfloat16" in out
    rows = json.loads((tmp_path / "moe_model.json").read_text())["rows"]
    assert {(r["op"], r["npus"]) for r in rows} == {(o, n) for o in ("moe_dispatch", "moe_combine")
                                                    for n in (8, 16)}
    assert all(r["status"] == "ok" and r["ratio"] > 1 for r in rows)


def test_host_tables_carry_modeled_columns_and_train_writes_a_trace(tmp_path):
    out = run_cli("collectives", "-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1",
                  "--op", "all_reduce", "--mode", "all", "--no-progress", "--verbose", "--out", str(tmp_path))
    assert "modeled on the supernode" in out and "bc/strata" in out  # the details: --verbose
    rows = json.loads((tmp_path / "collectives.json").read_text())["rows"]
    strata_rows = [r for r in rows if r["impl"] == "strata" and r["status"] == "ok"]
    assert strata_rows and all(r["modeled_us"] > 0 for r in strata_rows)
    trace = tmp_path / "step.json"
    out = run_cli("train", "--tokens", "32", "--hidden", "32", "--ffn", "32", "--experts", "16",
                  "--topk", "2", "-n", "2", "-w", "1", "--impl", "strata", "--trace", str(trace),
                  "--no-progress", "--out", str(tmp_path))
    assert "one traced step" in out
    doc = json.loads(trace.read_text())
    pids = {e["pid"] for e in doc["traceEvents"]}
    assert {1000 + d for d in range(8)} <= pids and 1 in pids
    # The whole step modeled beside the ops: compute and communication on the modeled timeline.
    assert 3000 in pids and "the whole step (compute + communication) modeled" in out
    step = [e for e in doc["traceEvents"] if e["pid"] == 3000 and e["ph"] == "X"]
    assert any(e["args"]["kind"] == "compute" for e in step) and any(e["args"]["kind"] == "collective" for e in step)


def test_serve_model_only_writes_both_modes(tmp_path):
    out = run_cli("serve", "--model-only", "--model", "tiny", "--npus", "4", "--batch-per-npu", "4,8",
                  "--context", "64", "--out", str(tmp_path))
    assert "tiny decode modeled on cloudmatrix384_dies: 4 NPUs = 8 ranks" in out and "published" in out
    data = json.loads((tmp_path / "serve.json").read_text())
    for mode in ("strata", "buffer_centric"):
        assert data[mode]["tpot_ms"] > 0 and data[mode]["tokens_per_s_per_npu"] > 0
        # --npus counts packages: 4 sequences per NPU in one step of tpot_ms.
        assert abs(data[mode]["tokens_per_s_per_npu"] * data[mode]["tpot_ms"] / 1e3 - 4) < 1e-9
    assert data["buffer_centric"]["tpot_ms"] >= data["strata"]["tpot_ms"]
    sweep = data["sweep"]
    assert {(r["mode"], r["batch_per_npu"]) for r in sweep} == {(m, b) for m in ("strata", "buffer_centric")
                                                                for b in (4, 8)}
    for f in ("serve.png", "serve.csv", "serve_trace.json"):
        assert (tmp_path / f).stat().st_size > 0
    out = run_cli("serve", "--model-only", "--model", "tiny", "--phase", "prefill", "--npus", "2",
                  "--batch-per-npu", "2", "--prompt", "32", "--rank", "npu", "--out", str(tmp_path))
    data = json.loads((tmp_path / "serve.json").read_text())
    assert data["strata"]["ttft_ms"] > 0 and "a rank is a npu" in out


def test_train_model_only_writes_both_modes(tmp_path):
    out = run_cli("train", "--model-only", "--model", "tiny", "--npus", "4", "--seq", "64",
                  "--out", str(tmp_path))
    assert "training step (forward + backward) modeled" in out
    data = json.loads((tmp_path / "train_model.json").read_text())
    assert 0 < data["strata"]["iteration_ms"] <= data["buffer_centric"]["iteration_ms"]
    assert (tmp_path / "train_model.png").stat().st_size > 0


def test_serve_refuses_what_it_cannot_model(tmp_path):
    import subprocess
    import sys

    from test_benchmarks_smoke import ROOT
    for argv, says in ((["--npus", "400"], "more than the supernode's 384 NPUs"),
                       (["--batch-per-npu", "3"], "multiple of the 2 ranks"),
                       (["--batch-per-npu", "0"], "positive whole numbers")):
        proc = subprocess.run([sys.executable, "-m", "benchmarks", "serve", "--model-only", "--model", "tiny",
                               *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and says in proc.stderr, (argv, proc.stderr[-500:])
        assert "Traceback" not in proc.stderr
