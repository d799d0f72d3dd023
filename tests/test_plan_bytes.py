"""One engine, one model (issue 28): every plan op run on the host with tracing on moves,
per rank and per lane, exactly the bytes of the plan the supernode model times for it.

Each op runs once on 8 emulated NPUs (random data, odd sizes) in both modes; its result is
checked against lax (or numpy where XLA:CPU cannot run lax's twin); then the runtime's
counters (strata.stats(): core_bytes / sdma_bytes per NPU and lane, staged_bytes per NPU)
must equal the modeled plan's (the trace record re-timed: ModeledOp.lane_bytes and
staged_bytes), byte for byte. Exact equality is the point: a model that counted one
transfer twice, or staged a block the runtime does not, fails (test_the_check_catches_*)."""
import dataclasses

import jax
import numpy as np
import pytest
from conftest import random_array
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_ragged_all_to_all import args_of, make_case, reference

import stratacl_jax as strata

N = 8
MODES = ("strata", "buffer_centric")
# A comm buffer small enough that buffer_centric runs every op below in several rounds of
# columns, one of them partial: the model must count each round as the runtime runs it.
COMM_BUFFER_BYTES = 1 << 12


def per_rank_table(table, lanes):
    """stats' [npu][lane] lists (grown on demand, so ragged or missing) as an [N, lanes] array."""
    out = np.zeros((N, lanes), np.int64)
    for npu, row in enumerate(table):
        out[npu, :len(row)] = row
    return out


def per_rank_vector(values):
    out = np.zeros(N, np.int64)
    out[:len(values)] = values
    return out


def check_moved_equals_modeled(stats, modeled):
    """The executor's per-(rank, lane) and per-rank staged bytes against the modeled plan's."""
    cores = modeled.settings["cores_per_npu"]
    engines = modeled.settings["sdma_engines_per_npu"]
    np.testing.assert_array_equal(per_rank_table(stats["core_bytes"], cores), modeled.lane_bytes[:, :cores],
                                  err_msg=f"{modeled.op} {modeled.mode}: core lane bytes")
    np.testing.assert_array_equal(per_rank_table(stats["sdma_bytes"], engines), modeled.lane_bytes[:, cores:],
                                  err_msg=f"{modeled.op} {modeled.mode}: SDMA lane bytes")
    np.testing.assert_array_equal(per_rank_vector(stats["staged_bytes"]), modeled.staged_bytes,
                                  err_msg=f"{modeled.op} {modeled.mode}: staged bytes")


def run_traced(fn, mesh, args, mode, **settings):
    """fn under jit(shard_map) over the ranks (args lead with the rank axis): compiled, then
    run once from fresh counters with tracing on. Returns (outputs, stats, the one record)."""
    spec = P("x")
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in args]
    body = lambda *us: jax.tree.map(lambda y: y[None], fn(*[u[0] for u in us]))  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec))
    with strata.config(mode=mode, comm_buffer_bytes=COMM_BUFFER_BYTES, **settings):
        jax.block_until_ready(f(*placed))  # compile (and warm) outside what is counted
        strata.reset_stats()
        with strata.emulator.trace() as tr:
            out = jax.block_until_ready(f(*placed))
        stats = strata.stats()
    (record,) = tr.ops
    assert record.ok and record.mode == mode
    return np.asarray(out), stats, tr, record


def retimed(tr, record):
    """The trace record timed again in the mode it ran with (what the trace shows)."""
    modeled = tr._model(record, record.mode)
    assert modeled.time_us == record.modeled_us[record.mode] > 0
    return modeled


def lax_twin(fn, mesh, args):
    spec = P("x")
    body = lambda *us: jax.tree.map(lambda y: y[None], fn(*[u[0] for u in us]))  # noqa: E731
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(args), out_specs=spec))
    return np.asarray(f(*[jax.device_put(a, NamedSharding(mesh, spec)) for a in args]))


RING_PART = [(0, 3), (3, 5), (5, 1), (1, 0), (2, 6)]  # ranks 4 and 7 receive nothing: zeros

# op -> (strata body, lax body or None, per-rank input shape)
CASES = {
    "all_reduce": (lambda x: strata.all_reduce(x, "x"), lambda x: lax.psum(x, "x"), (1001,)),
    "all_gather": (lambda x: strata.all_gather(x, "x"), lambda x: lax.all_gather(x, "x"), (333,)),
    "reduce_scatter": (lambda x: strata.reduce_scatter(x, "x", tiled=True),
                       lambda x: lax.psum_scatter(x, "x", tiled=True), (N * 131,)),
    "all_to_all": (lambda x: strata.all_to_all(x, "x", 0, 0, tiled=True),
                   lambda x: lax.all_to_all(x, "x", 0, 0, tiled=True), (N * 97,)),
    "broadcast": (lambda x: strata.broadcast(x, "x", root=5), None, (1003,)),
    "ppermute": (lambda x: strata.ppermute(x, "x", RING_PART), lambda x: lax.ppermute(x, "x", RING_PART), (999,)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", list(CASES))
def test_collective_moves_the_modeled_plan(mesh8, op, mode):
    body, twin, shape = CASES[op]
    x = random_array(np.random.default_rng(len(op)), (N,) + shape, np.float32)
    got, stats, tr, record = run_traced(body, mesh8, [x], mode)
    if twin is not None:
        np.testing.assert_allclose(got, lax_twin(twin, mesh8, [x]), rtol=1e-6)
    else:  # lax.pbroadcast lowers only on GPU
        np.testing.assert_array_equal(got, np.broadcast_to(x[5], got.shape))
    assert record.op == op
    modeled = retimed(tr, record)
    check_moved_equals_modeled(stats, modeled)
    assert modeled.lane_bytes.sum() > 0
    assert (stats["bytes_staged"] > 0) == (mode == "buffer_centric")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 2])
def test_ragged_all_to_all_moves_the_modeled_plan(mesh8, k, mode):
    # Rows of 160 bytes, overlapping reads, gaps and rows nobody writes.
    c = make_case(np.random.default_rng(40 + k), N, k=k, row_shape=(40,), out_rows=30 * k)
    ragged = lambda *a: strata.ragged_all_to_all(*a, axis_name="x")  # noqa: E731
    got, stats, tr, record = run_traced(ragged, mesh8, args_of(c), mode)
    np.testing.assert_array_equal(got, reference(c))  # XLA:CPU cannot run lax's (jax#34755)
    assert record.op == "ragged_all_to_all"
    np.testing.assert_array_equal(record.params["send_sizes"], c["send_sizes"])
    modeled = retimed(tr, record)
    check_moved_equals_modeled(stats, modeled)
    # Each receiver's lanes read and write the rows it receives.
    received = c["recv_sizes"].sum(axis=1) * 160
    np.testing.assert_array_equal(modeled.lane_bytes.sum(axis=1), 2 * received)


@pytest.mark.parametrize("op", ["all_gather", "ragged_all_to_all"])
def test_sdma_lanes_move_the_modeled_plan(mesh8, op):
    # One engine per NPU puts movement past ~3.8 MB per rank (read + written) on SDMA.
    rng = np.random.default_rng(7)
    if op == "all_gather":
        x = random_array(rng, (N, 1 << 17), np.float32)  # 512 KiB in, 4 MiB out per rank
        got, stats, tr, record = run_traced(lambda v: strata.all_gather(v, "x"), mesh8, [x], "strata",
                                            sdma_engines_per_npu=1)
        np.testing.assert_array_equal(got, lax_twin(lambda v: lax.all_gather(v, "x"), mesh8, [x]))
    else:
        c = make_case(rng, N, in_rows=300, out_rows=8 * 300, row_shape=(512,), max_size=300)
        got, stats, tr, record = run_traced(lambda *a: strata.ragged_all_to_all(*a, axis_name="x"), mesh8,
                                            args_of(c), "strata", sdma_engines_per_npu=1)
        np.testing.assert_array_equal(got, reference(c))
    modeled = retimed(tr, record)
    assert modeled.lanes == "sdma" and sum(map(sum, stats["sdma_bytes"])) > 0
    check_moved_equals_modeled(stats, modeled)


@pytest.mark.parametrize("mode", MODES)
def test_the_check_catches_a_transfer_counted_twice(mesh8, mode):
    c = make_case(np.random.default_rng(5), N, row_shape=(40,), out_rows=30)
    got, stats, tr, record = run_traced(lambda *a: strata.ragged_all_to_all(*a, axis_name="x"), mesh8,
                                        args_of(c), mode)
    modeled = retimed(tr, record)
    check_moved_equals_modeled(stats, modeled)
    # A model whose lane moved one row's transfer (160 bytes read + 160 written: the
    # smallest there is) twice, or that staged one row more, is caught.
    rank, lane = np.argwhere(modeled.lane_bytes > 0)[0]
    twice = modeled.lane_bytes.copy()
    twice[rank, lane] += 2 * 160
    with pytest.raises(AssertionError, match="lane bytes"):
        check_moved_equals_modeled(stats, dataclasses.replace(modeled, lane_bytes=twice))
    staged = modeled.staged_bytes.copy()
    staged[rank] += 160
    with pytest.raises(AssertionError, match="staged bytes"):
        check_moved_equals_modeled(stats, dataclasses.replace(modeled, staged_bytes=staged))
