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
    assert len(rows) == 2 * 2 * 9 and all(r["status"] == "ok" for r in rows)
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
                  "--op", "all_reduce", "--mode", "all", "--no-progress", "--out", str(tmp_path))
    assert "modeled on the supernode" in out and "bc/strata" in out
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
