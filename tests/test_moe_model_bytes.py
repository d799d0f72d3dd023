"""The supernode model's MoE work against what the runtime did, lane by lane:
an op runs on the host with stats on, then strata.emulator.model times the
same routing (the dispatch's pair_slot) with keep_slices; the bytes each
NPU's lanes moved in the exchange must be the bytes the model gave each of
them, exactly, and buffer_centric's staging must match too.

Every MoE op runs from the plans the model times, so they agree."""
import collections

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from random_data import random_array

N, K, E = 8, 4, 16
CORES, ENGINES = 4, 2


def _place(mesh, *arrays):
    return [jax.device_put(a, NamedSharding(mesh, P("x"))) for a in arrays]


def _smap(fn, mesh, n_in, out_specs):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * n_in, out_specs=out_specs))


def _squeeze(handle):
    return jax.tree.map(lambda a: a[0], handle)


def run_and_model(mesh, op, mode, dtype, tokens, hidden, capacity, seed, engines=ENGINES, planner="balanced"):
    """(runtime lane bytes, model exchange lane bytes, runtime stats, model
    bytes of its staging phases), each lane keyed (npu, "core"/"sdma", lane)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, E, (N * tokens, K)).astype(np.int32)
    x, ids, w, ey, ct = _place(mesh, random_array(rng, (N * tokens, hidden), dtype), idx,
                               random_array(rng, (N * tokens, K), np.float32),
                               random_array(rng, (E, capacity, hidden), dtype),
                               random_array(rng, (N * tokens, hidden), dtype))
    with strata.config(mode=mode, cores_per_npu=CORES, sdma_engines_per_npu=engines, planner=planner):
        def dispatch(x, i):
            recv, handle = strata.moe.dispatch(x, i, axis_name="x", num_experts=E, capacity=capacity)
            return recv, jax.tree.map(lambda a: a[None], handle)
        f = _smap(dispatch, mesh, 2, (P("x"), P("x")))
        if op == "moe_dispatch":
            jax.block_until_ready(f(x, ids))  # compiled and done before the stats start
            strata.reset_stats()
        _, handle = jax.block_until_ready(f(x, ids))
        if op == "moe_combine":
            g = _smap(lambda y, h, w: strata.moe.combine(y, _squeeze(h), w), mesh, 3, P("x"))
            args = (ey, handle, w)
        elif op == "moe_combine_backward":
            def backward(y, h, w, ct):
                return jax.vjp(lambda y, w: strata.moe.combine(y, _squeeze(h), w), y, w)[1](ct)
            g = _smap(backward, mesh, 4, (P("x"), P("x")))
            args = (ey, handle, w, ct)
        if op != "moe_dispatch":
            jax.block_until_ready(g(*args))
            strata.reset_stats()
            jax.block_until_ready(g(*args))
        stats = strata.stats()
    runtime = {}
    for kind in ("core", "sdma"):
        for npu, lanes in enumerate(stats[f"{kind}_bytes"]):
            runtime.update({(npu, kind, lane): b for lane, b in enumerate(lanes) if b})
    pair_slot = np.asarray(handle.pair_slot).reshape(N, tokens * K)
    m = strata.emulator.model(op, npus=N, tokens=tokens, hidden=hidden, top_k=K, num_experts=E,
                              capacity=capacity, dtype=np.dtype(dtype).name, mode=mode, cores_per_npu=CORES,
                              sdma_engines_per_npu=engines, keep_slices=True, pair_slot=pair_slot,
                              planner=planner)
    modeled, staged = collections.Counter(), 0
    for rank, kind, lane, phase, _, _, nbytes in m.slices:
        if m.phase_kinds[int(phase)] == 0:  # the exchange; 1, 2: staging in, out
            modeled[(int(rank), ("core", "sdma")[int(kind)], int(lane))] += int(nbytes)
        else:
            staged += int(nbytes)
    return runtime, dict(modeled), stats, staged


# capacity 20: most experts overflow (96 pairs each on average), pairs drop;
# 200: none drop and most rows stay empty (zeroed).
@pytest.mark.parametrize("mode", ["strata", "buffer_centric"])
@pytest.mark.parametrize("dtype", [np.float32, jax.numpy.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("capacity", [20, 200])
def test_dispatch_lanes_match_the_model(mesh8, mode, dtype, capacity):
    runtime, modeled, stats, staged = run_and_model(mesh8, "moe_dispatch", mode, dtype, 48, 136, capacity, 3)
    assert runtime and runtime == modeled
    if mode == "buffer_centric":
        # Dispatch is a plan (algorithms/moe_plan.h): the model's staging
        # lanes read and write each byte PlanJob stages (the x rows read in,
        # the rows that crossed out) and each row the owner copies from a
        # staged one (bytes_local: the fan-out happens at copy-out), and
        # write the rows it zeroes.
        rows = E * capacity * 136 * np.dtype(dtype).itemsize
        zeroed = rows - stats["bytes_exchanged"] - stats["bytes_local"]  # the rows no pair fills
        assert stats["bytes_local"] > 0 and zeroed >= 0
        assert staged == 2 * stats["bytes_staged"] + 2 * stats["bytes_local"] + zeroed
    else:
        assert staged == 0 and stats["bytes_staged"] == 0


@pytest.mark.parametrize("mode", ["strata", "buffer_centric"])
def test_dispatch_honours_the_planner(mesh8, mode):
    # strata.config(planner=) splits dispatch's plan as it splits the
    # collectives': the naive planner (a piece per lane in turn) gives other
    # lanes than the balanced one, on the host and in the model alike.
    naive, modeled, _, _ = run_and_model(mesh8, "moe_dispatch", mode, np.float32, 48, 136, 20, 3, planner="naive")
    balanced, _, _, _ = run_and_model(mesh8, "moe_dispatch", mode, np.float32, 48, 136, 20, 3)
    assert naive and naive == modeled
    assert naive != balanced and sum(naive.values()) == sum(balanced.values())


def test_dispatch_on_sdma_engines_matches_the_model(mesh8):
    # ~4.7 MB read + written per rank passes the one engine's 3.8 MB
    # (runtime/collective.h MovesOnSdma): the rows move on SDMA, in both.
    runtime, modeled, _, _ = run_and_model(mesh8, "moe_dispatch", "strata", np.float32, 256, 2048, 160, 4,
                                           engines=1)
    assert {kind for _, kind, _ in runtime} == {"sdma"}
    assert runtime == modeled


@pytest.mark.parametrize("mode", ["strata", "buffer_centric"])
@pytest.mark.parametrize("dtype", [np.float32, jax.numpy.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("capacity", [20, 200])
def test_combine_lanes_match_the_model(mesh8, mode, dtype, capacity):
    # Combine is two plans (algorithms/moe_combine_plan.h): the owners'
    # partials on their lanes, then the tokens' sums on theirs. In strata
    # mode the host fuses each partial into the sum that reads it, and still
    # credits the owners' lanes with the partials' bytes, as the model does.
    runtime, modeled, stats, staged = run_and_model(mesh8, "moe_combine", mode, dtype, 48, 136, capacity, 5)
    assert runtime and runtime == modeled
    owners = {npu for npu, _, _ in runtime}
    assert len(owners) == N
    if mode == "buffer_centric":
        # The owners' staging in (each (token, rank)'s row into its comm
        # buffer: a partial or a lone row as it is) reads every accepted row
        # and writes what crosses; each rank copies its y out.
        y_bytes = N * 48 * 136 * np.dtype(dtype).itemsize
        assert stats["bytes_staged"] == stats["bytes_exchanged"] + y_bytes
        assert staged == stats["bytes_local"] + stats["bytes_exchanged"] + 2 * y_bytes
    else:
        assert staged == 0 and stats["bytes_staged"] == 0


@pytest.mark.parametrize("mode", ["strata", "buffer_centric"])
@pytest.mark.parametrize("dtype", [np.float32, jax.numpy.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("capacity", [20, 200])
def test_combine_backward_lanes_match_the_model(mesh8, mode, dtype, capacity):
    # The backward is three plans (algorithms/moe_backward_plan.h): the
    # owners pull ct_y once per (token, rank), scale it into every row of
    # the token and take each pair's dot there. In strata mode the host reads
    # each carried row where it comes from, and still credits the carry's
    # lanes, as the model does.
    runtime, modeled, stats, staged = run_and_model(mesh8, "moe_combine_backward", mode, dtype, 48, 136, capacity, 5)
    assert runtime and runtime == modeled
    assert len({npu for npu, _, _ in runtime}) == N
    if mode == "buffer_centric":
        # ct_y and the expert rows staged in, d_expert_y and d_weights out.
        rb = 136 * np.dtype(dtype).itemsize
        ins = N * 48 * rb + E * capacity * rb
        outs = E * capacity * rb + N * 48 * K * 4
        assert stats["bytes_staged"] == ins + outs
        assert staged == 2 * (ins + outs)
    else:
        assert staged == 0 and stats["bytes_staged"] == 0
