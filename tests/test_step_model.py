"""The step model (strata.emulator.simulate): closed forms a scheduler of one
rank's streams, cores and HBM must meet, checked on small programs."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata

simulate = strata.emulator.simulate
SPEC = strata.emulator.preset("cloudmatrix384")
N = 8


def sharded(body, n_in, mesh=None, out_specs=P("x")):
    mesh = mesh if mesh is not None else strata.emulator.abstract_mesh((N,), ("x",))
    return jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * n_in, out_specs=out_specs, check_vma=False)


def sds(shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def roofline(flops, nbytes, peak_tflops, bw_gbps):
    return max(flops / (SPEC.compute_efficiency * peak_tflops * 1e6),
               nbytes / (SPEC.hbm_efficiency * bw_gbps * 1e3)) + SPEC.kernel_launch_us


@pytest.mark.parametrize("m,k,n,dtype", [(4096, 7168, 2048, jnp.bfloat16), (16, 7168, 2048, jnp.bfloat16),
                                         (512, 1024, 512, jnp.int8), (333, 77, 129, jnp.float32)])
def test_one_matmul_takes_its_roofline_time(m, k, n, dtype):
    out_dtype = jnp.int32 if dtype == jnp.int8 else dtype
    f = sharded(lambda a, b: lax.dot_general(a, b[0], (((1,), (0,)), ((), ())),
                                             preferred_element_type=out_dtype), 2)
    r = simulate(f, sds((N * m, k), dtype), sds((N, k, n), dtype))
    item = np.dtype(dtype).itemsize
    want = roofline(2.0 * m * n * k, (m * k + k * n) * item + m * n * np.dtype(out_dtype).itemsize,
                    SPEC.cube_tflops_per_rank(np.dtype(dtype).name), SPEC.hbm_gbps_per_rank)
    assert r.time_us == pytest.approx(want, rel=1e-9)
    (op,) = r.ops
    assert op["kind"] == "compute" and op["unit"] == "cube" and op["flops"] == 2.0 * m * n * k
    assert r.compute_us == pytest.approx(want) and r.comm_us == 0 and r.exposed_comm_us == 0


def test_matmul_rates_follow_the_dtype_and_what_a_rank_is():
    assert SPEC.cube_tflops_per_rank("int8") == 2 * SPEC.cube_tflops_per_rank("bfloat16")
    assert SPEC.cube_tflops_per_rank("bfloat16") == 752.0  # a rank is a package: 2 dies
    dies = strata.emulator.preset("cloudmatrix384_dies")
    assert dies.cube_tflops_per_rank("bfloat16") == 376.0
    assert dies.hbm_gbps_per_rank == 1600 and dies.ub_egress_gbps_per_rank == 196
    assert dies.vector_cores_per_rank == 48 and SPEC.vector_cores_per_rank == 96


@pytest.mark.parametrize("op,lax_twin", [
    ("all_reduce", lambda x: lax.psum(x, "x")),
    ("all_gather", lambda x: lax.all_gather(x, "x", tiled=True)),
    ("reduce_scatter", lambda x: lax.psum_scatter(x, "x", tiled=True)),
    ("all_to_all", lambda x: lax.all_to_all(x, "x", 0, 0, tiled=True)),
])
@pytest.mark.parametrize("size", [4096, 1 << 20, 12_345_664])
def test_one_collective_takes_exactly_the_op_models_time(op, lax_twin, size):
    count = size // 4
    ours = {"all_reduce": lambda x: strata.all_reduce(x, "x"),
            "all_gather": lambda x: strata.all_gather(x, "x", tiled=True),
            "reduce_scatter": lambda x: strata.reduce_scatter(x, "x", tiled=True),
            "all_to_all": lambda x: strata.all_to_all(x, "x", 0, 0, tiled=True)}[op]
    for mode in ("strata", "buffer_centric"):
        r = simulate(sharded(ours, 1), sds((N * count,)), mode=mode)
        want = strata.emulator.model(op, size, npus=N, mode=mode)
        assert r.time_us == want.time_us and r.comm_us == want.time_us, (op, mode)
        assert r.ops[0]["kind"] == "collective" and r.ops[0]["library"] == "strata"
    # XLA's own collective is timed as the vendor library runs it, whatever the mode.
    for mode in ("strata", "buffer_centric"):
        r = simulate(sharded(lax_twin, 1), sds((N * count,)), mode=mode)
        assert r.time_us == strata.emulator.model(op, size, npus=N, mode="buffer_centric").time_us
        assert r.ops[0]["library"] == "xla"


def _mm_and_collective(dependent: bool):
    def body(a, b, x):
        y = a @ b[0]
        z = strata.all_reduce(y if dependent else x, "x")
        return z.sum() if dependent else y.sum() + z.sum()
    return sharded(body, 3, out_specs=P())


def test_an_independent_collective_overlaps_a_matmul_a_dependent_one_does_not():
    args = (sds((N * 2048, 4096), jnp.bfloat16), sds((N, 4096, 2048), jnp.bfloat16),
            sds((N * 2048 * 2048,), jnp.bfloat16))
    for dependent in (False, True):
        r = simulate(_mm_and_collective(dependent), *args)
        mm = next(o for o in r.ops if o["unit"] == "cube")
        coll = next(o for o in r.ops if o["kind"] == "collective")
        assert mm["alone_us"] > 20 and coll["alone_us"] > 20  # both matter
        if dependent:
            assert coll["start_us"] == mm["end_us"]
            assert r.exposed_comm_us == pytest.approx(r.comm_us)
        else:
            # Both run from the start; the step is at least the longer, less than both in turn.
            assert coll["start_us"] == 0 and mm["start_us"] == 0
            assert r.time_us < sum(o["alone_us"] for o in r.ops)
            assert r.time_us >= max(mm["alone_us"], coll["alone_us"])
            assert r.exposed_comm_us < r.comm_us
    seq = simulate(_mm_and_collective(True), *args)
    assert seq.time_us == pytest.approx(sum(o["end_us"] - o["start_us"] for o in seq.ops))
    assert seq.time_us == pytest.approx(sum(o["alone_us"] for o in seq.ops), rel=1e-9)


def _vector_beside(collective):
    """A compute-bound vector kernel (a long fused chain on 16 MB) beside a collective on 16 MB."""
    def body(v, x):
        for _ in range(100):
            v = jnp.sin(v)
        return collective(x).sum() + v.sum()
    return simulate(sharded(body, 2, out_specs=P()), sds((N * (4 << 20),)), sds((N * (4 << 20),)))


def test_a_reduction_on_vector_cores_delays_vector_compute_an_sdma_copy_does_not():
    red = _vector_beside(lambda x: strata.all_reduce(x, "x"))
    copy = _vector_beside(lambda x: strata.all_gather(x, "x", tiled=True))
    for r, unit in ((red, "vector"), (copy, "sdma")):
        coll = next(o for o in r.ops if o["kind"] == "collective")
        assert coll["unit"] == unit, coll
        assert coll["start_us"] == 0
    vec_red = max((o for o in red.ops if o["kind"] == "compute"), key=lambda o: o["flops"])
    vec_copy = max((o for o in copy.ops if o["kind"] == "compute"), key=lambda o: o["flops"])
    assert vec_red["bound"] == "compute" and vec_red["alone_us"] == vec_copy["alone_us"]
    # The reduction holds cores_per_npu (48) of the rank's 96 vector cores: the kernel runs at
    # half speed while they overlap.
    assert vec_red["end_us"] - vec_red["start_us"] > 1.3 * vec_red["alone_us"]
    assert vec_copy["end_us"] - vec_copy["start_us"] == pytest.approx(vec_copy["alone_us"], rel=1e-9)
    assert red.breakdown["compute_slowdown_us"] > 0 and copy.breakdown["compute_slowdown_us"] == 0


def _mlp_step(batch):
    def body(x, w1, w2, idx):
        h = jax.nn.gelu(x @ w1[0])
        y = h @ w2[0]
        y = strata.all_reduce(y, "x")
        r, handle = strata.moe.dispatch(y, idx, axis_name="x", num_experts=2 * N, capacity=max(1, batch // 4))
        return strata.moe.combine(r * 2, handle, jnp.ones(idx.shape, jnp.float32)).sum()
    f = sharded(body, 4, out_specs=P())
    return f, (sds((N * batch, 1024), jnp.bfloat16), sds((N, 1024, 4096), jnp.bfloat16),
               sds((N, 4096, 1024), jnp.bfloat16), sds((N * batch, 2), jnp.int32))


def test_doubling_the_batch_never_shortens_a_step():
    last = 0.0
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        f, args = _mlp_step(batch)
        for mode in ("strata", "buffer_centric"):
            t = simulate(f, *args, mode=mode).time_us
            if mode == "strata":
                assert t >= last, (batch, t, last)
                last = t


def test_the_same_program_gives_the_same_step_on_a_real_and_an_abstract_mesh():
    real = strata.emulator.make_mesh((2, 4), ("node", "npu"))
    abstract = strata.emulator.abstract_mesh((2, 4), ("node", "npu"))

    def step(mesh):
        def body(x, w):
            y = strata.all_reduce(x @ w, "npu")
            return lax.psum(jnp.tanh(y), "node")
        return jax.shard_map(body, mesh=mesh, in_specs=(P(("node", "npu")), P()), out_specs=P(("node", "npu")))

    x = np.random.default_rng(0).standard_normal((8 * 64, 256)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((256, 512)).astype(np.float32)
    a = simulate(step(real), x, w)
    b = simulate(step(abstract), sds(x.shape), sds(w.shape))
    assert a.time_us == b.time_us and a.npus == b.npus == 8
    assert [(o["name"], o["start_us"], o["end_us"]) for o in a.ops] == \
        [(o["name"], o["start_us"], o["end_us"]) for o in b.ops]
    # The group over "npu" is 4 ranks; over "node" 2 ranks, strided across the mesh.
    groups = [o["group"] for o in a.ops if o["kind"] == "collective"]
    assert groups == [4, 2]


def test_a_scan_of_layers_takes_layers_times_one_layer():
    def layer(h, w):
        return strata.all_reduce(jnp.tanh(h @ w), "x"), None

    def body(h, ws):
        return lax.scan(layer, h, ws)[0]

    f = jax.shard_map(body, mesh=strata.emulator.abstract_mesh((N,), ("x",)), in_specs=(P("x"), P()),
                      out_specs=P("x"), check_vma=False)
    one = simulate(f, sds((N * 256, 1024), jnp.bfloat16), sds((1, 1024, 1024), jnp.bfloat16))
    six = simulate(f, sds((N * 256, 1024), jnp.bfloat16), sds((6, 1024, 1024), jnp.bfloat16))
    assert len(six.ops) == 6 * len(one.ops)
    assert six.time_us == pytest.approx(6 * one.time_us, rel=1e-9)


def test_elementwise_chains_fuse_and_read_their_inputs_once():
    def body(x):
        return (jnp.exp(x) * 2 + jnp.sin(x)).astype(jnp.bfloat16)
    r = simulate(sharded(body, 1), sds((N * 1_000_000,)))
    (op,) = r.ops
    assert op["unit"] == "vector" and op["bytes"] == 1_000_000 * (4 + 2)


def test_lax_collectives_autodiff_inserts_are_timed():
    # check_vma=True: the gradient of a replicated weight is reduced by XLA's psum_invariant,
    # which the user never wrote; the step model times it as the vendor library would.
    mesh = strata.emulator.abstract_mesh((N,), ("x",))

    def loss(w, x):
        return jax.shard_map(lambda w, x: lax.psum(jnp.sum(jnp.tanh(x @ w)), "x"), mesh=mesh, in_specs=(P(), P("x")),
                             out_specs=P())(w, x)

    r = simulate(jax.grad(loss), sds((512, 512)), sds((N * 64, 512)))
    colls = [o for o in r.ops if o["kind"] == "collective"]
    assert colls and all(o["library"] == "xla" and o["mode"] == "buffer_centric" for o in colls)
    assert any(o["bytes_per_rank"] == 512 * 512 * 4 for o in colls)


def test_summary_repr_and_trace_read_well(tmp_path):
    f, args = _mlp_step(64)
    r = simulate(f, *args)
    assert "\n" not in repr(r) and "ModeledStep(" in repr(r)
    text = r.summary()
    assert len(text.splitlines()) < 40 and "critical path" in text
    rows = r.table()
    assert len(rows) == len(r.ops) and [x["start_us"] for x in rows] == sorted(x["start_us"] for x in rows)
    assert all(x["us"] == x["end_us"] - x["start_us"] >= 0 for x in rows)
    path = r.save_trace(str(tmp_path / "step.json"), npus=2)
    events = json.load(open(path))["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert {"cube", "vector", "sdma", "ub"} <= names
    slices = [e for e in events if e["ph"] == "X"]
    assert slices and all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    assert {e["pid"] for e in slices} == {2000, 2001}
    assert any(e["ph"] == "s" for e in events) and any(e["ph"] == "f" for e in events)
    # Slices on one track never overlap (Perfetto needs them nested).
    by_track = {}
    for e in slices:
        by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(spans, spans[1:]))
    assert r.critical_path and r.critical_path[-1] in {o["name"] for o in r.ops}


def test_bad_arguments_are_clear_errors():
    f, args = _mlp_step(4)
    with pytest.raises(ValueError, match="mode"):
        simulate(f, *args, mode="fast")
    with pytest.raises(TypeError, match="unknown setting"):
        simulate(f, *args, timeout=3)
    with pytest.raises(ValueError, match="exceed"):
        strata.emulator.abstract_mesh((385,), ("x",))
    with pytest.raises(ValueError, match="differ in length"):
        strata.emulator.abstract_mesh((2, 4), ("x",))
    with pytest.raises(TypeError, match="callable"):
        simulate(3, *args)


def test_full_size_deepseek_decode_on_320_ranks():
    """The DeepSeek-shaped decode step (benchmarks/deepseek.py, run for real at a tiny size in
    tests/test_deepseek.py) simulated at full size: one rank per die, EP320."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import deepseek

    dies = strata.emulator.preset("cloudmatrix384_dies")
    mesh = strata.emulator.abstract_mesh((320,), ("ep",), spec=dies)
    cfg = deepseek.deepseek_v3(param_dtype="int8")
    fn, args = deepseek.decode_step(cfg, mesh, batch_per_rank=48, context=4096, microbatches=2)
    r = simulate(fn, *args, spec=dies)
    names = [o["name"] for o in r.ops]
    # 58 MoE layers x 2 micro-batches: a dispatch and a combine each; 61 x 2 attention kernels.
    assert names.count("strata moe_dispatch") == names.count("strata moe_combine") == 116
    assert names.count("mla_decode_attention") == 122
    assert all(o["group"] == 320 for o in r.ops if o["kind"] == "collective")
    assert r.npus == 320 and r.time_us == max(o["end_us"] for o in r.ops)
    assert r.compute_us + r.exposed_comm_us <= r.time_us * (1 + 1e-9)
    assert 0 < r.exposed_comm_us < r.comm_us  # the micro-batches hide part of the communication
    # int8 weights: the expert and projection matmuls run on int8 operands.
    assert any(o["unit"] == "cube" and o.get("dtype") == "int8" for o in r.ops)
