"""strata.emulator.trace(): records of real runs on 8 emulated NPUs (host
timestamps per rank, the op's plan parameters, MoE routing), their modeled
twins in both modes, and the Chrome/Perfetto JSON (checked against a JSON
schema of the trace event format)."""
import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from conftest import random_array

# The subset of the Chrome trace event format we write (ts/dur in us).
TRACE_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {"traceEvents": {"type": "array", "items": {"oneOf": [
        {"type": "object", "required": ["ph", "name", "pid", "tid", "ts", "dur"],
         "properties": {"ph": {"const": "X"}, "name": {"type": "string"}, "pid": {"type": "integer"},
                        "tid": {"type": "integer"}, "ts": {"type": "number"},
                        "dur": {"type": "number", "minimum": 0}, "args": {"type": "object"}}},
        {"type": "object", "required": ["ph", "name", "pid", "tid", "args"],
         "properties": {"ph": {"const": "M"}, "name": {"enum": ["process_name", "thread_name"]},
                        "pid": {"type": "integer"}, "tid": {"type": "integer"},
                        "args": {"type": "object", "required": ["name"],
                                 "properties": {"name": {"type": "string"}}}}},
        {"type": "object", "required": ["ph", "name", "pid", "tid", "ts", "s"],
         "properties": {"ph": {"const": "i"}, "s": {"enum": ["t", "p", "g"]}}},
    ]}}},
}


def smap(fn, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def check_trace_file(path, devices):
    with open(path) as f:
        doc = json.load(f)
    jsonschema.validate(doc, TRACE_SCHEMA)
    ev = doc["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    # A modeled process per emulated NPU, with its cores and engines.
    for d in devices:
        assert f"NPU {d} (modeled" in procs[1000 + d]
        assert any(n.startswith("vector core") for (p, _), n in names.items() if p == 1000 + d)
        assert any(n.startswith("SDMA engine") for (p, _), n in names.items() if p == 1000 + d)
    # Complete slices on one track never partially overlap (they must nest).
    tracks = {}
    for e in ev:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    eps = 1e-6
    for key, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))  # parents before the children they hold
        open_ends: list[float] = []
        for b0, b1 in spans:
            while open_ends and b0 >= open_ends[-1] - eps:
                open_ends.pop()  # that slice has ended
            assert not open_ends or b1 <= open_ends[-1] + eps, (key, (b0, b1), open_ends[-1])
            open_ends.append(b1)
    return doc


def test_trace_records_collectives_with_modeled_twins(mesh8, tmp_path):
    rng = np.random.default_rng(0)
    x = random_array(rng, (8 * 4096,), np.float32)
    f = smap(lambda v: strata.all_gather(strata.all_reduce(v, "x"), "x", tiled=True), mesh8, P("x"), P("x"))
    xs = jax.device_put(x, NamedSharding(mesh8, P("x")))
    jax.block_until_ready(f(xs))  # compile outside the trace
    path = tmp_path / "trace.json"
    with strata.emulator.trace(str(path)) as tr:
        y = jax.block_until_ready(f(xs))
        with strata.config(mode="buffer_centric"):
            g = smap(lambda v: strata.all_to_all(v, "x", 0, 0, tiled=True), mesh8, P("x"), P("x"))
            jax.block_until_ready(g(xs))
    want = np.tile(x.reshape(8, -1).sum(0), 8 * 8)  # every rank holds the 8 gathered sums
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5)
    assert [o.op for o in tr.ops] == ["all_reduce", "all_gather", "all_to_all"]
    ar, ag, a2a = tr.ops
    assert ar.group_size == 8 and ar.bytes_per_rank == 4096 * 4 and ar.mode == "strata"
    assert a2a.mode == "buffer_centric"
    for o in tr.ops:
        assert o.host_us > 0 and len(o.arrive_us) == 8 and o.devices == list(range(8))
        assert 0 <= o.last_to_arrive < 8
        assert min(o.end_us) >= max(o.arrive_us) - 1e-3  # nobody ends before the last arrives
        assert 0 < o.modeled_us["strata"] <= o.modeled_us["buffer_centric"]
    # The trace's model of the recorded op equals model() of the same op.
    ref = strata.emulator.model("all_reduce", 4096 * 4, npus=8)
    assert ar.modeled_us["strata"] == pytest.approx(ref.time_us)
    doc = check_trace_file(path, range(8))
    host = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert sum(e["name"] == "all_reduce" for e in host) == 8  # one slice per rank
    modeled = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] >= 1000 and e["tid"] > 0]
    assert modeled and all(e["dur"] >= 0 for e in modeled)
    assert tr.table()[0]["modeled_strata_us"] == ar.modeled_us["strata"]
    assert "buffer_centric / strata" in tr.summary()


def test_trace_on_a_2d_mesh_models_each_group_where_it_sits(mesh2x4):
    x = np.arange(8 * 256, dtype=np.float32)
    f = smap(lambda v: strata.all_reduce(v, "npu"), mesh2x4, P(("node", "npu")), P(("node", "npu")))
    xs = jax.device_put(x, NamedSharding(mesh2x4, P(("node", "npu"))))
    jax.block_until_ready(f(xs))
    with strata.emulator.trace() as tr:
        jax.block_until_ready(f(xs))
    assert len(tr.ops) == 2 and {tuple(o.devices) for o in tr.ops} == {(0, 1, 2, 3), (4, 5, 6, 7)}
    assert all(o.group_size == 4 for o in tr.ops)


def test_trace_records_moe_routing(mesh8, tmp_path):
    n, t, h, k, e = 8, 32, 64, 2, 16
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n * t, h)).astype(np.float32)
    idx = np.argsort(rng.random((n * t, e)), axis=1)[:, :k].astype(np.int32)
    w = rng.random((n * t, k)).astype(np.float32)

    def body(xx, ii, ww):
        recv, handle = strata.moe.dispatch(xx, ii, axis_name="x", num_experts=e, capacity=t * k)
        return strata.moe.combine(recv * 2.0, handle, ww)

    f = smap(body, mesh8, (P("x"), P("x"), P("x")), P("x"))
    args = [jax.device_put(a, NamedSharding(mesh8, P("x"))) for a in (x, idx, w)]
    jax.block_until_ready(f(*args))
    with strata.emulator.trace(str(tmp_path / "moe.json")) as tr:
        y = jax.block_until_ready(f(*args))
    np.testing.assert_allclose(np.asarray(y), 2 * (w.sum(1, keepdims=True) * x), rtol=1e-5)
    ops = [o.op for o in tr.ops]
    assert ops == ["moe_dispatch", "moe_combine"]
    d = tr.ops[0]
    # The recorded layout is the runtime's (dispatch's pair_slot output), and the
    # model's own slot rule gives the same one from the routing.
    from stratacl_jax import _core
    want = _core.moe_pair_slots(n, e, t * k, np.ascontiguousarray(idx.reshape(n, t * k)))
    np.testing.assert_array_equal(d.params["routing"], want)
    ref = strata.emulator.model("moe_dispatch", npus=n, tokens=t, hidden=h, top_k=k, num_experts=e,
                                topk_idx=idx.reshape(n, t, k), capacity=t * k, dtype="float32")
    assert d.modeled_us["strata"] == pytest.approx(ref.time_us)
    assert all(0 < o.modeled_us["strata"] < o.modeled_us["buffer_centric"] for o in tr.ops)
    check_trace_file(tmp_path / "moe.json", range(8))


def test_trace_records_ragged_all_to_all_with_its_sizes(mesh8, tmp_path):
    from test_ragged_all_to_all import args_of, make_case, reference, run_per_rank

    c = make_case(np.random.default_rng(9), 8, k=2, row_shape=(6,), out_rows=60, dtype=np.int64)
    ragged = lambda *a: strata.ragged_all_to_all(*a, axis_name="x")  # noqa: E731
    run_per_rank(ragged, mesh8, *args_of(c))  # compile outside the trace
    with strata.emulator.trace(str(tmp_path / "ragged.json")) as tr:
        got = run_per_rank(ragged, mesh8, *args_of(c))
        with strata.config(mode="buffer_centric"):
            staged = run_per_rank(ragged, mesh8, *args_of(c))
    np.testing.assert_array_equal(got, reference(c))
    np.testing.assert_array_equal(staged, reference(c))
    assert [(o.op, o.mode) for o in tr.ops] == [("ragged_all_to_all", "strata"), ("ragged_all_to_all", "buffer_centric")]
    o = tr.ops[0]
    assert o.group_size == 8 and o.dtype == "int64" and o.bytes_per_rank == c["send_sizes"].sum() * 48 // 8
    # Every rank's vectors as it published them (int32 here, recorded as int64).
    for v in ("input_offsets", "send_sizes", "output_offsets"):
        np.testing.assert_array_equal(o.params[v], c[v])
    assert o.params["operand_rows"] == 9 and o.params["output_rows"] == 60 and o.params["row_bytes"] == 48
    # Re-timed from those sizes: model() of the same exchange.
    for mode in ("strata", "buffer_centric"):
        ref = strata.emulator.model("ragged_all_to_all", npus=8, dtype="int64", hidden=6, mode=mode,
                                    send_sizes=c["send_sizes"], input_offsets=c["input_offsets"],
                                    output_offsets=c["output_offsets"], operand_rows=9, output_rows=60)
        assert o.modeled_us[mode] == ref.time_us > 0
    assert o.modeled_us["strata"] < o.modeled_us["buffer_centric"]
    doc = check_trace_file(tmp_path / "ragged.json", range(8))
    host = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert sum(e["name"] == "ragged_all_to_all" for e in host) == 16  # a slice per rank per op
    lanes = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] >= 1000 and e["tid"] > 0]
    assert any(e["name"] == "ragged_all_to_all exchange" for e in lanes)
    assert any(e["name"] == "ragged_all_to_all stage in" for e in lanes)


def test_trace_captures_gradients_and_does_not_nest(mesh8):
    x = np.random.default_rng(2).standard_normal(8 * 64).astype(np.float32)
    f = smap(lambda v: jax.grad(lambda u: jnp.sum(strata.all_reduce(u, "x") ** 2))(v), mesh8, P("x"), P("x"))
    xs = jax.device_put(x, NamedSharding(mesh8, P("x")))
    jax.block_until_ready(f(xs))
    with strata.emulator.trace() as tr:
        jax.block_until_ready(f(xs))
        with pytest.raises(RuntimeError, match="do not nest"):
            with strata.emulator.trace():
                pass
    assert len(tr.ops) >= 1 and all(o.op == "all_reduce" for o in tr.ops)
    # Outside a trace nothing is recorded.
    jax.block_until_ready(f(xs))
    with strata.emulator.trace() as tr2:
        pass
    assert tr2.ops == []
