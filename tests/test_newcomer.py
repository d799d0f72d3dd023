"""What a newcomer meets first in the Python API (issue 30): sizes as the CLI writes them, a
trace that is not silently empty without `with`, one-line reprs with more on request, and a
trace whose modeled view can be read without zooming."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from conftest import random_array

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smap(fn, mesh):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def _inputs(mesh, n=4096):
    x = random_array(np.random.default_rng(3), (8 * n,), np.float32)
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("x"))), x


def test_trace_without_with_records_and_stop_writes(mesh8, tmp_path):
    f = smap(lambda a: strata.all_reduce(a, "x"), mesh8)
    x, host = _inputs(mesh8)
    jax.block_until_ready(f(x))  # compiled and run before: not recorded
    path = tmp_path / "t.json"
    tr = strata.emulator.trace(str(path))
    assert tr.recording and "recording" in repr(tr)
    out = jax.block_until_ready(f(x))
    np.testing.assert_allclose(np.asarray(out)[:4096], host.reshape(8, -1).sum(0), rtol=1e-5)
    assert not path.exists()
    tr.stop()
    assert not tr.recording and path.exists()
    assert [o.op for o in tr.ops] == ["all_reduce"]
    tr.stop()  # stopping twice does nothing
    # a second trace may start once the first stopped; `with` on a started trace is that trace
    with strata.emulator.trace() as tr2:
        jax.block_until_ready(f(x))
    assert len(tr2.ops) == 1 and not tr2.recording
    # two recording at once: an error that says what to do, not a silent second trace
    tr3 = strata.emulator.trace()
    try:
        with pytest.raises(RuntimeError, match="already recording.*stop"):
            strata.emulator.trace()
    finally:
        tr3.stop()


def test_trace_left_recording_is_written_at_exit_with_a_warning(tmp_path):
    path = tmp_path / "forgot.json"
    script = textwrap.dedent(f"""
        import stratacl_jax as strata
        strata.emulator.ensure_devices(8)
        import jax, jax.numpy as jnp
        from jax.sharding import PartitionSpec as P, NamedSharding
        mesh = strata.emulator.make_mesh((8,), ("i",))
        f = jax.jit(jax.shard_map(lambda a: strata.all_gather(a, "i", tiled=True), mesh=mesh, check_vma=False,
                                  in_specs=P("i"), out_specs=P()))
        x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("i")))
        tr = strata.emulator.trace({str(path)!r})
        jax.block_until_ready(f(x))
        print("ran", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ran" in r.stdout
    assert "still recording at exit" in r.stderr and "tr.stop()" in r.stderr, r.stderr[-2000:]
    doc = json.loads(path.read_text())
    assert any(e.get("name") == "all_gather" and e["ph"] == "X" for e in doc["traceEvents"])


def test_records_print_as_one_line(mesh8):
    f = smap(lambda a: strata.all_reduce(a, "x"), mesh8)
    x, _ = _inputs(mesh8, 1000)
    jax.block_until_ready(f(x))
    with strata.emulator.trace() as tr:
        jax.block_until_ready(f(x))
    (rec,) = tr.ops
    text = repr(rec)
    assert "\n" not in text and len(text) < 200, text
    assert text.startswith("OpRecord(all_reduce, 8 ranks, 4000B per rank float32, mode=strata: host ")
    assert f"modeled {rec.modeled_us['strata']:.3g} us" in text
    assert "1 strata ops" in tr.summary() and tr.table()[0]["op"] == "all_reduce"
    assert "\n" not in repr(tr) and "1 ops" in repr(tr)


def test_modeled_view_is_scaled_to_be_seen_and_says_so(mesh8, tmp_path):
    f = smap(lambda a: strata.all_reduce(a, "x"), mesh8)
    x, _ = _inputs(mesh8, 256)
    jax.block_until_ready(f(x))
    with strata.emulator.trace(str(tmp_path / "t.json")) as tr:
        for _ in range(20):
            x = f(x)
        jax.block_until_ready(x)
    doc = json.loads((tmp_path / "t.json").read_text())
    ev = doc["traceEvents"]
    scale = doc["otherData"]["modeled_time_scale"]
    host = [e for e in ev if e["ph"] == "X" and e["pid"] == 1]
    modeled = [e for e in ev if e["ph"] == "X" and 1000 <= e["pid"] < 2000 and e["tid"] == 0]
    assert len(modeled) == 20 * 8
    host_span = max(e["ts"] + e["dur"] for e in host)
    model_span = max(e["ts"] + e["dur"] for e in modeled)
    # without the scale the modeled view is orders of magnitude shorter than the host's
    assert scale >= 10 and np.log10(scale) == int(np.log10(scale))
    assert host_span / 10 < model_span <= host_span * 1.0001, (host_span, model_span, scale)
    for e in modeled:  # the true modeled time stays in the args
        assert e["dur"] == pytest.approx(e["args"]["modeled_us"] * scale)
    procs = [e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name" and e["pid"] >= 1000]
    assert procs and all(f"time x{scale:g}" in p for p in procs if "modeled on" in p)
    # asked for modeled time as is
    tr.modeled_time_scale = 1
    raw = tr.to_json()
    assert raw["otherData"]["modeled_time_scale"] == 1
    assert max(e["ts"] + e["dur"] for e in raw["traceEvents"]
               if e["ph"] == "X" and 1000 <= e["pid"] < 2000) == pytest.approx(model_span / scale)
