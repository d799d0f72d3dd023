"""The fabric runtime: registration-on-allocation, the two communication
modes, balanced core partitioning and the statistics that show them."""
import gc

import jax
import numpy as np
import pytest
from conftest import random_array, shard_run
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from stratacl_jax import _core

OPS = {
    "all_reduce": (lambda v: strata.all_reduce(v, "x"), lambda v: lax.psum(v, "x"), (1, 1)),
    "all_gather": (lambda v: strata.all_gather(v, "x", tiled=True), lambda v: lax.all_gather(v, "x", tiled=True), (1, 8)),
    "reduce_scatter": (lambda v: strata.reduce_scatter(v, "x", tiled=True),
                       lambda v: lax.psum_scatter(v, "x", tiled=True), (8, 1)),
    "all_to_all": (lambda v: strata.all_to_all(v, "x", 0, 0, tiled=True),
                   lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True), (8, 8)),
    "ppermute": (lambda v: strata.ppermute(v, "x", [(i, (i + 3) % 8) for i in range(8)]),
                 lambda v: lax.ppermute(v, "x", [(i, (i + 3) % 8) for i in range(8)]), (1, 1)),
}


@pytest.mark.parametrize("comm_buffer_bytes", [1 << 20, 4096], ids=["fits", "rounds"])
@pytest.mark.parametrize("op", list(OPS))
def test_buffer_centric_equals_lax_and_stages_as_predicted(mesh8, op, comm_buffer_bytes):
    sop, lop, (in_blocks, out_blocks) = OPS[op]
    x = random_array(np.random.default_rng(0), (8 * 64, 33), np.float32)  # 8448 bytes per rank
    want = shard_run(lop, mesh8, x)
    strata.reset_stats()
    with strata.config(mode="buffer_centric", comm_buffer_bytes=comm_buffer_bytes):
        got = shard_run(sop, mesh8, x)
    stats = strata.stats()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    per_rank = x.nbytes // 8
    # Every rank copies its whole input in and its whole output out, whatever
    # the number of rounds: in + out bytes, summed over the 8 ranks.
    block = per_rank // in_blocks
    assert stats["bytes_staged"] == 8 * (in_blocks + out_blocks) * block
    assert stats["bytes_direct"] == 0


@pytest.mark.parametrize("op", list(OPS))
def test_strata_mode_with_registered_arrays_stages_nothing(mesh8, op):
    sop, lop, _ = OPS[op]
    x = random_array(np.random.default_rng(1), (8 * 64, 5), np.float32)
    sharding = NamedSharding(mesh8, P("x"))
    xr = strata.memory.device_put(x, sharding)
    assert strata.memory.is_registered(xr)
    f = jax.jit(jax.shard_map(sop, mesh=mesh8, in_specs=P("x"), out_specs=P("x")))
    f(xr).block_until_ready()
    strata.reset_stats()
    got = np.asarray(f(xr))
    stats = strata.stats()
    np.testing.assert_allclose(got, shard_run(lop, mesh8, x), rtol=1e-5, atol=1e-5)
    assert stats["bytes_staged"] == 0 and stats["bytes_direct"] > 0
    assert stats["operand_registry_misses"] == 0
    assert stats["registry_hits"] >= 8  # every rank's input was found registered


def test_plain_device_put_is_registered_on_first_use_and_counted(mesh8):
    x = random_array(np.random.default_rng(2), (8 * 3001,), np.float32)
    xs = jax.device_put(x, NamedSharding(mesh8, P("x")))
    assert not strata.memory.is_registered(xs)
    f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "x"), mesh=mesh8, in_specs=P("x"), out_specs=P("x")))
    strata.reset_stats()
    f(xs).block_until_ready()
    first = strata.stats()
    # One lookup per input and per output on each of the 8 ranks; each miss
    # is a registration for that op, counted.
    assert first["registry_lookups"] == 16
    assert first["registrations"] == first["registry_misses"] == 16 - first["registry_hits"]
    strata.reset_stats()
    f(xs).block_until_ready()
    # Not cached past the op: XLA may free the buffer and reuse its address.
    assert strata.stats()["operand_registry_misses"] == 8


def test_memory_arrays_are_zero_copy_and_return_to_the_arena(mesh8):
    sharding = NamedSharding(mesh8, P("x"))
    x = random_array(np.random.default_rng(3), (8 * 100, 7), np.float32)
    a = strata.memory.device_put(x, sharding)
    np.testing.assert_array_equal(np.asarray(a), x)
    before = strata.memory.arena_info(0)
    assert before["live_blocks"] >= 1
    del a
    gc.collect()
    after = strata.memory.arena_info(0)
    assert after["bytes_in_use"] < before["bytes_in_use"]
    reserved = after["bytes_reserved"]
    for i in range(1000):
        t = strata.memory.zeros((8 * 257, 3), np.float32, sharding)
        if i % 100 == 0:
            assert float(np.asarray(t).sum()) == 0.0
        del t
    gc.collect()
    end = strata.memory.arena_info(0)
    assert end["bytes_reserved"] == reserved  # no growth over 1,000 cycles
    assert end["live_blocks"] <= after["live_blocks"] + 1


def test_memory_arrays_work_as_jit_inputs_with_donation(mesh8):
    sharding = NamedSharding(mesh8, P("x"))
    x = random_array(np.random.default_rng(4), (8 * 16,), np.float32)
    a = strata.memory.device_put(x, sharding)
    e = strata.memory.empty((8 * 16,), np.float32, sharding)
    step = jax.jit(jax.shard_map(lambda v, w: strata.all_reduce(v, "x") + 0 * w, mesh=mesh8,
                                 in_specs=(P("x"), P("x")), out_specs=P("x")), donate_argnums=(1,))
    got = np.asarray(step(a, e))
    np.testing.assert_allclose(got.reshape(8, 16)[0], x.reshape(8, 16).sum(0), rtol=1e-6)


def test_mode_is_baked_in_at_trace_time(mesh8):
    x = random_array(np.random.default_rng(5), (8 * 8,), np.float32)
    xs = jax.device_put(x, NamedSharding(mesh8, P("x")))
    with strata.config(mode="buffer_centric"):
        f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "x"), mesh=mesh8, in_specs=P("x"), out_specs=P("x")))
        f(xs).block_until_ready()
    strata.reset_stats()
    f(xs).block_until_ready()  # traced under buffer_centric: still stages
    assert strata.stats()["bytes_staged"] > 0


def test_config_validation():
    with pytest.raises(ValueError, match="mode must be one of"):
        strata.config(mode="nccl")
    with pytest.raises(TypeError, match="unknown setting"):
        strata.config(colour="blue")
    with strata.config(cores_per_npu=7) as s:
        assert s.cores_per_npu == 7
    assert strata._config.current().cores_per_npu == 48


def test_reductions_run_on_cores_and_movement_by_size(mesh8):
    # Reductions run on vector cores. Pure movement runs on SDMA engines once
    # their descriptor cost is amortised (collective.h, MovesOnSdma: input +
    # output per rank >= descriptor_us x engines x 2 x sdma_gbps, 61 MB with
    # 16 engines), on cores below; with one engine the threshold is 3.8 MB.
    x = random_array(np.random.default_rng(6), (8 * 4096,), np.float32)
    strata.reset_stats()
    shard_run(lambda v: strata.all_reduce(v, "x"), mesh8, x)
    s = strata.stats()
    assert sum(map(sum, s["core_bytes"])) > 0 and sum(map(sum, s["sdma_bytes"])) == 0
    strata.reset_stats()
    shard_run(lambda v: strata.all_gather(v, "x", tiled=True), mesh8, x)  # 16 KB per rank: cores
    s = strata.stats()
    assert sum(map(sum, s["core_bytes"])) > 0 and sum(map(sum, s["sdma_bytes"])) == 0
    big = random_array(np.random.default_rng(7), (8 * (128 << 10),), np.float32)  # 512 KB per rank
    with strata.config(sdma_engines_per_npu=1):
        strata.reset_stats()
        shard_run(lambda v: strata.all_gather(v, "x", tiled=True), mesh8, big)  # in + out 4.7 MB: SDMA
        s = strata.stats()
    assert sum(map(sum, s["sdma_bytes"])) > 0 and sum(map(sum, s["core_bytes"])) == 0
    assert len(s["sdma_bytes"]) == 8 and len(s["sdma_bytes"][0]) == 1
    # The same op traced with 16 engines stays on cores (4.7 MB < 61 MB).
    strata.reset_stats()
    shard_run(lambda v: strata.all_gather(v, "x", tiled=True), mesh8, big)
    s = strata.stats()
    assert sum(map(sum, s["core_bytes"])) > 0 and sum(map(sum, s["sdma_bytes"])) == 0


@pytest.mark.parametrize("kind,name", [(0, "all_reduce"), (3, "all_to_all"), (2, "reduce_scatter")])
def test_balanced_planner_vs_naive_split(kind, name):
    """8 ranks × 48 cores: the balanced planner stays within 1 % of a perfect
    split where the per-peer split leaves most cores idle."""
    block_bytes = (8 << 20) // (8 if kind in (2, 3) else 1)
    balanced = _core.plan_info(kind, 0, 0 if kind != 3 else 4, 8, block_bytes, 48, 0)
    naive = _core.plan_info(kind, 0, 0 if kind != 3 else 4, 8, block_bytes, 48, 1)
    print(f"{name}: balanced imbalance {balanced['imbalance']:.4f}, naive {naive['imbalance']:.2f}")
    assert balanced["imbalance"] <= 1.01
    assert naive["imbalance"] > 2.0
    # Same bytes either way: only the split differs.
    assert sum(map(sum, balanced["lane_bytes"])) == sum(map(sum, naive["lane_bytes"]))


def _run_copy_as_threads(kind, dtype, root, block, rows, site, rng, inputs, outputs):
    """One copy-only op (no reduction) over len(inputs) ranks run as threads,
    strata mode, 4 lanes, the balanced planner; every rank must succeed."""
    n = len(inputs)
    errors = _core.run_ranks(kind, dtype, 4, root, [], [block] * n, rows, 0, 4, 4, 0, 1 << 20, 30.0,
                             site, int(rng.integers(1, 1 << 40)), inputs, outputs, [])
    assert errors == [""] * n


@pytest.mark.parametrize("n,block,rows,dtype", [(96, 4, 1, 0), (96, 2, 3, 3), (40, 8, 1, 1), (33, 12, 2, 7)])
def test_strided_moves_all_to_all_matches_numpy(n, block, rows, dtype):
    """Many ranks of tiny blocks: each destination's pulls fold into a few strided
    moves (not one per source), and executing them still puts every block in place.
    Ranks are threads, so the group can be larger than the mesh."""
    info = _core.plan_info(3, dtype, 4, n, block, 4, 0)
    assert info["copies"] == n * n
    assert info["moves"] <= 2 * n  # the wrap of the d, d+1, ... source order splits a run in two
    rng = np.random.default_rng(n * block + rows)
    inputs = [rng.integers(0, 256, rows * n * block, dtype=np.uint8) for _ in range(n)]
    outputs = [np.full(rows * n * block, 7, np.uint8) for _ in range(n)]
    _run_copy_as_threads(3, dtype, 0, block, rows, 4242, rng, inputs, outputs)
    sent = np.stack([i.reshape(rows, n, block) for i in inputs])  # [src, row, dst, :]
    for d in range(n):
        np.testing.assert_array_equal(outputs[d].reshape(rows, n, block), sent[:, :, d].transpose(1, 0, 2))


@pytest.mark.parametrize("kind,n,block,rows,dtype", [
    (1, 96, 4, 1, 0), (1, 70, 12, 3, 7), (1, 8, 65536, 1, 0), (1, 33, 6, 2, 3),
    (4, 96, 1024, 1, 0), (4, 41, 10, 3, 1)])
def test_pulled_fan_out_copies_match_numpy(kind, n, block, rows, dtype):
    """all_gather (kind 1) and broadcast (kind 4) whose sources fit in cache run
    destination by destination (one strided move per destination's run); every
    output still holds exactly what numpy says. Ranks are threads."""
    info = _core.plan_info(kind, dtype, 4, n, block, 4, 0)
    assert info["copies"] == n * (n if kind == 1 else 1)
    assert info["moves"] <= 2 * n  # a run per destination, cut at most once by a chunk boundary
    root = n // 3 if kind == 4 else 0
    rng = np.random.default_rng(n * block + rows + kind)
    inputs = [rng.integers(0, 256, rows * block, dtype=np.uint8) for _ in range(n)]
    out_blocks = n if kind == 1 else 1
    outputs = [np.full(rows * out_blocks * block, 7, np.uint8) for _ in range(n)]
    _run_copy_as_threads(kind, dtype, root, block, rows, 4343 + kind, rng, inputs, outputs)
    if kind == 1:
        want = np.stack([i.reshape(rows, block) for i in inputs], axis=1)  # [row, src, :]
    else:
        want = inputs[root].reshape(rows, 1, block)
    for d in range(n):
        np.testing.assert_array_equal(outputs[d].reshape(rows, out_blocks, block), want)


def test_large_fan_out_keeps_source_major_strips():
    """Sources beyond the pull limit (1 MiB in all) are read once each, not once per destination."""
    assert _core.plan_info(1, 0, 4, 8, 262144, 4, 0)["moves"] == 0
    assert _core.plan_info(1, 0, 4, 8, 131072, 4, 0)["moves"] == 8


def test_naive_planner_gives_the_same_results(mesh8):
    x = random_array(np.random.default_rng(7), (8 * 8, 3001), np.float32)
    with strata.config(planner="naive"):
        got = shard_run(lambda v: strata.all_to_all(v, "x", 0, 0, tiled=True), mesh8, x)
    np.testing.assert_array_equal(got, shard_run(lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True), mesh8, x))


def test_large_all_gather_streams_its_stores_and_is_exact(mesh8):
    # 1 MB per rank: the group writes 64 MB, beyond the streaming threshold
    # (half the last-level cache), so this runs the non-temporal copy path.
    rng = np.random.default_rng(11)
    x = rng.standard_normal(8 * 262147).astype(np.float32)  # odd: unaligned blocks and tails
    got = shard_run(lambda v: strata.all_gather(v, "x", tiled=True), mesh8, x)
    np.testing.assert_array_equal(got.reshape(8, -1), np.broadcast_to(x, (8, x.size)))


STREAMING_SCRIPT = r"""
import numpy as np
import stratacl_jax as strata
strata.emulator.ensure_devices(8)
import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = strata.emulator.make_mesh((8,), ("x",))
rng = np.random.default_rng(5)
ops = {
    "all_reduce": (lambda v: strata.all_reduce(v, "x"), lambda v: lax.psum(v, "x")),
    "all_reduce_max": (lambda v: strata.all_reduce(v, "x", op="max"), lambda v: lax.pmax(v, "x")),
    "all_gather": (lambda v: strata.all_gather(v, "x", tiled=True), lambda v: lax.all_gather(v, "x", tiled=True)),
    "reduce_scatter": (lambda v: strata.reduce_scatter(v, "x", tiled=True), lambda v: lax.psum_scatter(v, "x", tiled=True)),
    "all_to_all": (lambda v: strata.all_to_all(v, "x", 0, 0, tiled=True), lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True)),
    "broadcast": (lambda v: strata.broadcast(v, "x", root=3), lambda v: lax.all_gather(v, "x")[3]),
}
checked = 0
for dtype in (np.float32, np.int8, jax.numpy.bfloat16):
    for count in (8, 8 * 37, 8 * 1001, 8 * 70001):
        x = (rng.standard_normal(8 * count) * 4).astype(dtype)
        xs = jax.device_put(x, NamedSharding(mesh, P("x")))
        for name, (mine, ref) in ops.items():
            run = lambda f: np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(xs))
            a, b = run(mine), run(ref)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            if name.startswith("all_reduce") or name == "reduce_scatter":
                np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=2e-2, atol=0.5)
            else:
                np.testing.assert_array_equal(a, b)
            checked += 1
print("checked", checked)
"""


def _sysfs_last_level_cache_bytes():
    """cpu0's deepest data cache in sysfs, in bytes (None where sysfs has none)."""
    from pathlib import Path

    best = None
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((d / "level").read_text())
            kind = (d / "type").read_text().strip()
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction" or not size:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        value = int(size.rstrip("KMG")) * scale
        if best is None or level >= best[0]:
            best = (level, value)
    return None if best is None else best[1]


def test_streaming_threshold_is_half_the_cache_a_core_shares():
    # Outputs above half the last-level cache are streamed. The size comes
    # from sysfs: glibc's sysconf reported 320 MiB (the host's) on 32 MiB VMs.
    import os

    if "STRATA_STREAM_BYTES" in os.environ:
        pytest.skip("STRATA_STREAM_BYTES overrides the default")
    llc = _sysfs_last_level_cache_bytes()
    if llc is None:
        pytest.skip("no cache description in sysfs")
    previous = _core.set_streaming_threshold_bytes(-1)  # -1: back to the default
    default = _core.set_streaming_threshold_bytes(previous)
    assert default == llc // 2, (default, llc)


def test_streaming_stores_forced_on_match_lax():
    # STRATA_STREAM_BYTES=0 streams every store: odd sizes exercise the
    # unaligned head and the tail of the non-temporal copy, reductions their
    # streamed output stores.
    import os
    import subprocess
    import sys

    env = dict(os.environ, STRATA_STREAM_BYTES="0")
    proc = subprocess.run([sys.executable, "-c", STREAMING_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "checked 72" in proc.stdout, proc.stdout + proc.stderr
