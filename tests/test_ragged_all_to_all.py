"""strata.ragged_all_to_all against a numpy reference (XLA:CPU cannot run
lax.ragged_all_to_all, jax#34755): random ragged sizes including zeros,
rows nobody writes, several slices per peer, grad, jvp, vmap, 2-D meshes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_array
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata

VECTORS = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def disjoint_layout(rng, sizes, rows):
    """Offsets placing slices of `sizes` without overlap in `rows` rows, in
    random order with random gaps."""
    assert sizes.sum() <= rows
    gaps = rng.multinomial(rows - sizes.sum(), np.ones(len(sizes) + 1) / (len(sizes) + 1))
    offsets, cursor = np.zeros_like(sizes), 0
    for i, gap in zip(rng.permutation(len(sizes)), gaps):
        cursor += gap
        offsets[i] = cursor
        cursor += sizes[i]
    return offsets


def make_case(rng, n, *, k=1, in_rows=9, out_rows=30, row_shape=(3,), dtype=np.float32, max_size=3,
              overlapping_reads=True):
    """One exchange over n ranks, as per-rank numpy arrays ([n, ...] each).
    Senders read anywhere (reads may overlap) or from disjoint rows (what a
    gradient needs, as lax's); each receiver lays the slices it gets out
    without overlap, with random gaps, in random order."""
    sizes = rng.integers(0, max_size + 1, size=(n, n * k))
    sizes[rng.random(sizes.shape) < 0.3] = 0  # plenty of empty slices
    if overlapping_reads:
        input_offsets = rng.integers(0, in_rows - sizes + 1)
    else:
        input_offsets = np.stack([disjoint_layout(rng, sizes[s], in_rows) for s in range(n)])
    output_offsets = np.zeros_like(sizes)
    recv_sizes = np.zeros_like(sizes)
    for d in range(n):
        incoming = [(s, j) for s in range(n) for j in range(k)]
        total = sum(sizes[s, d * k + j] for s, j in incoming)
        assert total <= out_rows
        gaps = rng.multinomial(out_rows - total, np.ones(len(incoming) + 1) / (len(incoming) + 1))
        cursor = 0
        for (s, j), gap in zip([incoming[i] for i in rng.permutation(len(incoming))], gaps):
            cursor += gap
            output_offsets[s, d * k + j] = cursor
            recv_sizes[d, s * k + j] = sizes[s, d * k + j]
            cursor += sizes[s, d * k + j]
    return dict(operand=random_array(rng, (n, in_rows) + row_shape, dtype),
                output=random_array(rng, (n, out_rows) + row_shape, dtype),
                input_offsets=input_offsets.astype(np.int32), send_sizes=sizes.astype(np.int32),
                output_offsets=output_offsets.astype(np.int32), recv_sizes=recv_sizes.astype(np.int32))


def reference(c, operand=None, output=None):
    operand = c["operand"] if operand is None else operand
    out = (c["output"] if output is None else output).copy()
    n, entries = c["send_sizes"].shape
    k = entries // n
    for s in range(n):
        for i in range(entries):
            size, src, dst = c["send_sizes"][s, i], c["input_offsets"][s, i], c["output_offsets"][s, i]
            out[i // k, dst:dst + size] = operand[s, src:src + size]
    return out


def written_rows(c):
    n, entries = c["send_sizes"].shape
    k = entries // n
    mask = np.zeros(c["output"].shape[:2], bool)
    for s in range(n):
        for i in range(entries):
            mask[i // k, c["output_offsets"][s, i]:c["output_offsets"][s, i] + c["send_sizes"][s, i]] = True
    return mask


def run_per_rank(fn, mesh, *arrays, out_specs=None):
    """fn(*per-rank arrays) under jit(shard_map); arrays lead with the rank axis."""
    spec = P(tuple(mesh.axis_names))
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]
    body = lambda *us: jax.tree.map(lambda y: y[None], fn(*[u[0] for u in us]))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(arrays),
                              out_specs=spec if out_specs is None else out_specs))
    return jax.tree.map(np.asarray, f(*placed))


def args_of(c):
    return [c["operand"], c["output"]] + [c[v] for v in VECTORS]


def ragged(axis):
    return lambda op, out, *vs: strata.ragged_all_to_all(op, out, *vs, axis_name=axis)


@pytest.mark.parametrize("k,row_shape,dtype", [
    (1, (3,), np.float32), (2, (), np.int32), (1, (2, 2), np.complex64), (3, (5,), jnp.bfloat16)])
def test_values_match_numpy(mesh8, k, row_shape, dtype):
    c = make_case(np.random.default_rng(k), 8, k=k, row_shape=row_shape, dtype=dtype, out_rows=30 * k)
    got = run_per_rank(ragged("x"), mesh8, *args_of(c))
    want = reference(c)
    np.testing.assert_array_equal(got, want)
    untouched = ~written_rows(c)
    assert untouched.any() and (~untouched).any()
    np.testing.assert_array_equal(got[untouched], c["output"][untouched])  # keep output's values
    again = run_per_rank(ragged("x"), mesh8, *args_of(c))
    assert got.tobytes() == again.tobytes()


def test_two_dimensional_mesh_groups(mesh2x4):
    rng = np.random.default_rng(7)
    cases = [make_case(rng, 4), make_case(rng, 4)]  # node 0's and node 1's groups over "npu"
    both = {key: np.concatenate([c[key] for c in cases]) for key in cases[0]}
    got = run_per_rank(ragged("npu"), mesh2x4, *args_of(both))
    np.testing.assert_array_equal(got, np.concatenate([reference(c) for c in cases]))


def test_jvp_and_grad_match_numpy(mesh8):
    rng = np.random.default_rng(11)
    c = make_case(rng, 8, dtype=np.float64, in_rows=30, overlapping_reads=False)
    t_operand = rng.standard_normal(c["operand"].shape)
    t_output = rng.standard_normal(c["output"].shape)
    weights = rng.standard_normal(c["output"].shape)

    def tangent(op, out, t_op, t_out, *vs):
        return jax.jvp(lambda a, b: strata.ragged_all_to_all(a, b, *vs, axis_name="x"), (op, out), (t_op, t_out))

    primal, tan = run_per_rank(tangent, mesh8, c["operand"], c["output"], t_operand, t_output,
                               *[c[v] for v in VECTORS])
    np.testing.assert_array_equal(primal, reference(c))
    np.testing.assert_allclose(tan, reference(c, t_operand, t_output), rtol=1e-12)

    def grads(op, out, w, *vs):
        loss = lambda a, b: (strata.ragged_all_to_all(a, b, *vs, axis_name="x") * w).sum()
        return jax.grad(loss, argnums=(0, 1))(op, out)

    g_operand, g_output = run_per_rank(grads, mesh8, c["operand"], c["output"], weights, *[c[v] for v in VECTORS])
    want_operand = np.zeros_like(c["operand"])
    n, entries = c["send_sizes"].shape
    for s in range(n):
        for i in range(entries):
            size, src, dst = c["send_sizes"][s, i], c["input_offsets"][s, i], c["output_offsets"][s, i]
            want_operand[s, src:src + size] += weights[i, dst:dst + size]
    np.testing.assert_allclose(g_operand, want_operand, rtol=1e-12)
    np.testing.assert_allclose(g_output, np.where(written_rows(c)[..., None], 0.0, weights), rtol=1e-12)


def test_check_grads_both_modes(mesh8):
    from jax.test_util import check_grads

    c = make_case(np.random.default_rng(12), 8, dtype=np.float64, in_rows=16, out_rows=24, max_size=2,
                  overlapping_reads=False)
    spec = P("x")
    vs = [jax.device_put(c[v], NamedSharding(mesh8, spec)) for v in VECTORS]
    f = jax.jit(jax.shard_map(
        lambda a, b, *v: strata.ragged_all_to_all(jnp.sin(a[0]) * a[0], b[0] ** 2, *[u[0] for u in v],
                                                  axis_name="x")[None],
        mesh=mesh8, in_specs=(spec,) * 6, out_specs=spec))
    args = [jax.device_put(c[k], NamedSharding(mesh8, spec)) for k in ("operand", "output")]
    check_grads(lambda a, b: f(a, b, *vs), args, order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("batched_vectors", [True, False])
def test_vmap_is_independent_exchanges(mesh8, batched_vectors):
    rng = np.random.default_rng(13)
    cases = [make_case(rng, 8), make_case(rng, 8)]
    if not batched_vectors:  # one set of offsets and sizes for both batch elements
        for v in VECTORS:
            cases[1][v] = cases[0][v]
    stacked = {key: np.stack([c[key] for c in cases], axis=1) for key in cases[0]}  # [n, B, ...]
    in_axes = (0, 0) + ((0,) * 4 if batched_vectors else (None,) * 4)

    def body(op, out, *vs):
        vs = vs if batched_vectors else [v[0] for v in vs]
        return jax.vmap(ragged("x"), in_axes=in_axes)(op, out, *vs)

    got = run_per_rank(body, mesh8, *args_of(stacked))
    np.testing.assert_array_equal(got, np.stack([reference(c) for c in cases], axis=1))


def test_disagreeing_sizes_are_a_clear_error(mesh8):
    c = make_case(np.random.default_rng(14), 8)
    c["recv_sizes"] = c["recv_sizes"].copy()
    c["recv_sizes"][3, 5] += 1
    with pytest.raises(Exception, match="strata.ragged_all_to_all: rank 5 sends .* whose recv_sizes"):
        run_per_rank(ragged("x"), mesh8, *args_of(c))
    c = make_case(np.random.default_rng(15), 8)
    c["input_offsets"] = c["input_offsets"].copy()
    c["input_offsets"][2, 1] = 100
    c["send_sizes"][2, 1] = c["recv_sizes"][1, 2] = 1
    with pytest.raises(Exception, match="outside its operand"):
        run_per_rank(ragged("x"), mesh8, *args_of(c))
    # The runtime works on after a failed op.
    c = make_case(np.random.default_rng(16), 8)
    np.testing.assert_array_equal(run_per_rank(ragged("x"), mesh8, *args_of(c)), reference(c))


@pytest.mark.parametrize("comm_buffer_bytes", [1 << 20, 30 * 64], ids=["fits", "rounds"])
def test_buffer_centric_matches_strata_and_stages(mesh8, comm_buffer_bytes):
    # Rows of 160 bytes: a 1920-byte buffer holds 64 columns of each of the
    # 30 output rows, so the exchange runs in three rounds of columns.
    c = make_case(np.random.default_rng(17), 8, row_shape=(40,), out_rows=30)
    strata.reset_stats()
    direct = run_per_rank(ragged("x"), mesh8, *args_of(c))
    stats = strata.stats()
    assert stats["bytes_staged"] == 0 and stats["bytes_direct"] > 0
    strata.reset_stats()
    with strata.config(mode="buffer_centric", comm_buffer_bytes=comm_buffer_bytes):
        staged = run_per_rank(ragged("x"), mesh8, *args_of(c))
    stats = strata.stats()
    np.testing.assert_array_equal(staged, direct)
    np.testing.assert_array_equal(staged, reference(c))
    # Each rank stages in the rows it sends (once, however many slices read
    # them) and stages out the rows it receives: rows nobody writes keep
    # the output's values.
    row_bytes = 40 * 4
    read = np.zeros(c["operand"].shape[:2], bool)
    for s in range(8):
        for off, size in zip(c["input_offsets"][s], c["send_sizes"][s]):
            read[s, off:off + size] = True
    assert stats["bytes_staged"] == (read.sum() + written_rows(c).sum()) * row_bytes
    assert stats["bytes_direct"] == 0
    assert stats["bytes_exchanged"] == c["send_sizes"].sum() * row_bytes


@pytest.mark.parametrize("engines", [16, 1])
def test_lane_bytes_add_up_to_the_rows_moved(mesh8, engines):
    # 2 KiB rows. The busiest rank's bytes read + written decide the lanes
    # (MovesOnSdma): ~4 MB with 200-row slices stays on the 48 cores with 16
    # engines (below 61 MB); ~20 MB with 1200-row slices goes to the one
    # engine (past 3.8 MB).
    rng = np.random.default_rng(18)
    rows = 200 if engines == 16 else 1200
    c = make_case(rng, 8, in_rows=rows, out_rows=8 * rows, row_shape=(512,), max_size=rows)
    strata.reset_stats()
    with strata.config(sdma_engines_per_npu=engines, cores_per_npu=48):
        got = run_per_rank(ragged("x"), mesh8, *args_of(c))
    stats = strata.stats()
    np.testing.assert_array_equal(got, reference(c))
    row_bytes = 512 * 4
    received = c["recv_sizes"].sum(axis=1) * row_bytes
    lanes = "sdma_bytes" if engines == 1 else "core_bytes"
    other = "core_bytes" if engines == 1 else "sdma_bytes"
    per_npu = np.array([sum(lane) for lane in stats[lanes]])
    # Each receiver's lanes read and write the rows it receives.
    np.testing.assert_array_equal(per_npu, 2 * received)
    assert sum(map(sum, stats[other])) == 0
    assert max(len(lane) for lane in stats[lanes]) == (1 if engines == 1 else 48)
    assert stats["bytes_exchanged"] == stats["bytes_direct"] == received.sum()
