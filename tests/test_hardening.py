"""Issue 29's outside probe, as regressions: per-thread config contexts,
arguments validated as lax validates them (never silently truncated), a
timeout set after tracing that holds, arenas that give memory back and a
failed allocation that releases what it took."""
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import shard_run
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from stratacl_jax import _config

HERE = os.path.dirname(__file__)
SANITIZED = bool(os.environ.get("STRATA_SANITIZER"))


# --- item 6: NaN and the sign of zero as lax gives them ------------------------------------------


def _special_rows(rng, dtype, m):
    """Per-rank rows of random data with the values that tell the rules
    apart: a NaN at rank 0, at a middle rank and at the last rank; an
    all-NaN column; NaN beside -inf; all -0; -0 and +0 in both orders."""
    x = rng.standard_normal((8, m)).astype(dtype)
    nan, inf = np.nan, np.inf
    cols = {0: {0: nan}, 1: {3: nan}, 2: {7: nan}, 3: {r: nan for r in range(8)},
            4: {0: nan, 1: -inf, 2: -inf, 3: -inf, 4: -inf, 5: -inf, 6: -inf, 7: -inf},
            5: {r: -0.0 for r in range(8)}, 6: {r: (-0.0 if r % 2 == 0 else 0.0) for r in range(8)},
            7: {r: (0.0 if r % 2 == 0 else -0.0) for r in range(8)}, 8: {5: inf, 6: nan}}
    for c, vals in cols.items():
        for r, v in vals.items():
            x[r, c] = v
    return x.reshape(-1)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_nan_and_signed_zero_match_lax_bit_for_bit(mesh8, mesh2x4, dtype):
    """XLA:CPU's all-reduce folds from the identity with std::max/min: a NaN
    never wins pmax/pmin (all-NaN gives -inf/+inf), and -0s sum to +0.
    strata's all_reduce and reduce_scatter give the same bits, on a 1-D and
    a 2-D mesh, and so does lax routed to strata."""
    import ml_dtypes
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = _special_rows(np.random.default_rng(6), dt, 16)
    lax_ops = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}
    for mesh in (mesh8, mesh2x4):
        axes = tuple(mesh.axis_names)
        for op, lax_op in lax_ops.items():
            want = shard_run(lambda v: lax_op(v, axes), mesh, x)
            got = shard_run(lambda v: strata.all_reduce(v, axes, op=op), mesh, x)
            assert got.tobytes() == want.tobytes(), (dtype, op, axes, got[:16], want[:16])
            with strata.config(lax_collectives="strata"):
                routed = shard_run(lambda v: lax_op(v, axes), mesh, x)
            assert routed.tobytes() == want.tobytes(), (dtype, op, axes, "routed")
        scattered = shard_run(lambda v: strata.reduce_scatter(v, axes, op="sum", tiled=True), mesh, x)
        want = shard_run(lambda v: lax.psum_scatter(v, axes, tiled=True), mesh, x)
        assert scattered.tobytes() == want.tobytes(), (dtype, "reduce_scatter", axes)
    # The rules themselves, so that a change in XLA shows here and not as a mystery elsewhere.
    full = shard_run(lambda v: lax.pmax(v, "x"), mesh8, x).reshape(8, 16)[0].astype(np.float32)
    assert full[0] == np.nanmax(x.reshape(8, 16)[:, 0].astype(np.float32))
    assert full[3] == -np.inf
    summed = shard_run(lambda v: lax.psum(v, "x"), mesh8, x).reshape(8, 16)[0].astype(np.float32)
    assert summed[5] == 0 and not np.signbit(summed[5])


# --- item 4: with strata.config(...) holds for its own thread ---------------------------------


def test_config_with_blocks_are_per_thread_and_leave_the_global_alone():
    before = _config.current()
    barrier = threading.Barrier(2)
    seen, errors = {}, []

    def worker(name, timeout, mode):
        try:
            for _ in range(50):
                with strata.config(timeout_s=timeout, mode=mode):
                    barrier.wait()  # both threads are inside their blocks
                    s = _config.current()
                    seen.setdefault(name, set()).add((s.timeout_s, s.mode))
                    barrier.wait()
                seen.setdefault(name + " outside", set()).add(_config.current().timeout_s)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=("a", 2.0, "buffer_centric")),
               threading.Thread(target=worker, args=("b", 3.0, "strata"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen["a"] == {(2.0, "buffer_centric")} and seen["b"] == {(3.0, "strata")}, seen
    assert seen["a outside"] == seen["b outside"] == {before.timeout_s}
    assert _config.current() == before and _config.global_settings() == before


def test_config_statement_is_global_and_with_overrides_only_its_settings():
    before = _config.current()
    try:
        strata.config(cores_per_npu=7)
        got = []
        t = threading.Thread(target=lambda: got.append(_config.current().cores_per_npu))
        t.start()
        t.join()
        assert got == [7]  # another thread sees the global setter
        with strata.config(mode="buffer_centric"):
            strata.config(planner="naive")  # a statement inside a block is still global
            s = _config.current()
            assert (s.mode, s.cores_per_npu, s.planner) == ("buffer_centric", 7, "naive")
        assert _config.current().mode == "strata" and _config.current().planner == "naive"
    finally:
        strata.config(cores_per_npu=before.cores_per_npu, planner=before.planner)
    assert _config.current() == before


def test_config_made_then_entered_moves_to_the_thread():
    before = _config.current()
    c = strata.config(sdma_engines_per_npu=4)
    assert _config.global_settings().sdma_engines_per_npu == 4
    with c:
        assert _config.current().sdma_engines_per_npu == 4
        assert _config.global_settings() == before
    del c
    assert _config.current() == before


# --- item 8: errors that say what went wrong ---------------------------------------------------


@pytest.mark.parametrize("changes,error,match", [
    (dict(timeout_s=float("inf")), ValueError, "timeout_s must be finite, positive and at most"),
    (dict(timeout_s=float("nan")), ValueError, "timeout_s must be finite"),
    (dict(timeout_s=1e300), ValueError, "at most 1e\\+06 s"),
    (dict(timeout_s=-1), ValueError, "timeout_s must be finite, positive"),
    (dict(timeout_s="10"), TypeError, "timeout_s must be a number of seconds"),
    (dict(cores_per_npu=2.0), TypeError, "cores_per_npu must be a positive int"),
    (dict(comm_buffer_bytes=1 << 70), ValueError, "comm_buffer_bytes must be a positive int of at most"),
    (dict(mode=3), ValueError, "mode must be one of"),
])
def test_config_rejects_values_it_cannot_honour(changes, error, match):
    before = _config.current()
    with pytest.raises(error, match=match):
        strata.config(**changes)
    assert _config.current() == before


def test_config_accepts_numpy_numbers():
    with strata.config(timeout_s=np.float32(2.5), cores_per_npu=np.int64(4)) as s:
        assert s.timeout_s == 2.5 and s.cores_per_npu == 4 and type(s.cores_per_npu) is int


@pytest.mark.parametrize("call,error,match", [
    (lambda v: strata.all_reduce(v, 0), TypeError, "strata.all_reduce: axis_name must be a mesh axis name"),
    (lambda v: strata.all_gather(v, ("x", 1)), TypeError, "strata.all_gather: axis_name must be"),
    (lambda v: strata.ppermute(v, "x", [(0.5, 1), (1.9, 2)]), TypeError, "strata.ppermute: perm must hold int"),
    (lambda v: strata.all_gather(v, "x", axis=0.0), TypeError, "strata.all_gather: axis must be an int"),
    (lambda v: strata.all_to_all(v.reshape(8, -1), "x", 0.0, 0), TypeError, "split_axis must be an int"),
    (lambda v: strata.reduce_scatter(v, "x", scatter_dimension="0"), TypeError, "scatter_dimension must be"),
    (lambda v: strata.broadcast(v, "x", root=1.0), TypeError, "strata.broadcast: root must be an int"),
    (lambda v: strata.moe.dispatch(v.reshape(8, 3), jnp.zeros((8, 2), jnp.int32), axis_name="x",
                                   num_experts=8, capacity=2**40), ValueError,
     "strata.moe.dispatch: capacity=1099511627776"),
])
def test_bad_arguments_name_the_op_and_the_argument(mesh8, call, error, match):
    with pytest.raises(error, match=match):
        shard_run(call, mesh8, np.ones(8 * 24, np.float32))


def test_numpy_integer_arguments_are_accepted(mesh8):
    x = np.arange(8 * 3, dtype=np.float32)
    got = shard_run(lambda v: strata.broadcast(v, "x", root=np.int32(1)), mesh8, x)
    np.testing.assert_array_equal(got.reshape(8, 3), np.tile(x.reshape(8, 3)[1], (8, 1)))
    perm = [(np.int64(i), np.int32((i + 1) % 8)) for i in range(8)]
    got = shard_run(lambda v: strata.ppermute(v, "x", perm), mesh8, x)
    np.testing.assert_array_equal(got.reshape(8, 3), np.roll(x.reshape(8, 3), 1, axis=0))


@pytest.mark.parametrize("shape,error,match", [
    ((2**62, 8), ValueError, "strata.memory.zeros: shape \\(4611686018427387904, 8\\) of float32 is"),
    ((8, 2.5), TypeError, "strata.memory.zeros: shape must be a tuple of non-negative ints"),
    ((8, -1), ValueError, "strata.memory.zeros: shape must be a tuple of non-negative ints"),
])
def test_memory_shapes_are_checked(mesh8, shape, error, match):
    with pytest.raises(error, match=match):
        strata.memory.zeros(shape, np.float32, NamedSharding(mesh8, P("x")))


# --- item 7: arguments are never silently truncated --------------------------------------------


def test_ragged_int64_offsets_that_do_not_fit_int32_are_an_error_not_wrapped(mesh8):
    """Rank 0 sends 2**32 + 1 rows to itself (and says it receives them):
    this used to run as 1 row (a cast to int32)."""
    n = 8
    operand = np.arange(n * 4, dtype=np.float32)
    output = np.full(n * 4, -1, np.float32)

    def vectors(value, dtype, at=2):
        sizes = np.zeros(n * n, dtype)
        sizes[0] = value  # rank 0's entry for rank 0
        offsets = np.zeros(n * n, dtype)
        offsets[0] = at
        return offsets, sizes, np.zeros(n * n, dtype), sizes

    def f(op, out, io, ss, oo, rs):
        return strata.ragged_all_to_all(op, out, io, ss, oo, rs, "x")

    with pytest.raises(Exception, match=r"strata.ragged_all_to_all: rank 0: input_offsets\[0\]=2 \+ "
                                        r"send_sizes\[0\]=4294967297 is outside its operand's 4 rows"):
        shard_run(f, mesh8, operand, output, *vectors(2**32 + 1, np.int64))
    # uint32 sizes past int32's range are read as they are, too.
    with pytest.raises(Exception, match=r"send_sizes\[0\]=3000000000"):
        shard_run(f, mesh8, operand, output, *vectors(3_000_000_000, np.uint32))
    # Wide vectors whose values fit run as int32 ones do.
    for dtype in (np.int64, np.uint32, np.int8):
        got = shard_run(f, mesh8, operand, output, *vectors(1, dtype)).reshape(n, 4)
        want = output.reshape(n, 4).copy()
        want[0, 0] = operand[2]
        np.testing.assert_array_equal(got, want)


# --- item 10: the timeout in force when a program runs is the one it waits ---------------------


def _skipping_program(mesh):
    def body(v, skip):
        return lax.cond((lax.axis_index("x") == 2) & (skip[0] > 0), lambda u: u,
                        lambda u: strata.ppermute(u, "x", [(i, (i + 1) % 8) for i in range(8)]), v)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))


@pytest.mark.parametrize("how", ["global", "with"])
def test_timeout_set_after_tracing_applies(mesh8, how):
    f = _skipping_program(mesh8)
    x = jax.device_put(np.arange(8 * 4, dtype=np.float32), NamedSharding(mesh8, P("x")))
    run, skip = (jax.device_put(np.full(8, v, np.int32), NamedSharding(mesh8, P("x"))) for v in (0, 1))
    f(x, run).block_until_ready()  # traced and compiled under the default 60 s
    before = _config.current()
    start = time.monotonic()
    try:
        with pytest.raises(Exception, match="timed out"):
            if how == "global":
                strata.config(timeout_s=1.0)
                f(x, skip).block_until_ready()
            else:
                with strata.config(timeout_s=1.0):
                    f(x, skip).block_until_ready()
    finally:
        strata.config(timeout_s=before.timeout_s)
    assert time.monotonic() - start < 20, "the timeout traced with the program (60 s) was used"
    np.testing.assert_array_equal(np.asarray(f(x, run)).reshape(8, 4), np.roll(np.asarray(x).reshape(8, 4), 1, 0))


# --- item 5: arenas give memory back; a failed allocation releases what it took ----------------


def test_arena_returns_freed_chunks_to_the_os(mesh8):
    sharding = NamedSharding(mesh8, P("x"))
    for mib in range(33, 49):  # each larger than the last, each freed before the next
        a = strata.memory.zeros((8 * mib * 2**18,), np.float32, sharding)
        a.block_until_ready()
        del a
    gc.collect()
    info = strata.memory.arena_info(0)
    assert info["bytes_in_use"] == 0 and info["live_blocks"] == 0, info
    # At most one wholly free chunk of up to 64 MiB is kept (the policy).
    assert info["bytes_reserved"] <= 64 << 20 and info["chunks"] <= 1, info
    assert info["chunks_released"] >= 15, info


@pytest.mark.skipif(SANITIZED, reason="an address-space limit and a sanitizer's shadow memory do not mix")
def test_failed_multi_device_allocation_releases_and_names_op_size_device():
    script = textwrap.dedent("""
        import gc, resource
        import stratacl_jax as strata
        strata.emulator.ensure_devices(8)
        import jax, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = strata.emulator.make_mesh((8,), ("x",))
        sh = NamedSharding(mesh, P("x"))
        jax.block_until_ready(jax.device_put(np.ones(8, np.float32), sh))
        vm = int(open("/proc/self/statm").read().split()[0]) * 4096
        # Room for about three 256 MiB shards of eight.
        resource.setrlimit(resource.RLIMIT_AS, (vm + (800 << 20), resource.RLIM_INFINITY))
        try:
            strata.memory.zeros((8 * (256 << 20) // 4,), np.float32, sh)
            raise SystemExit("allocated past the limit")
        except MemoryError as e:
            print("ERROR:", e)
        gc.collect()
        print("RESERVED:", [strata.memory.arena_info(d)["bytes_reserved"] for d in range(8)])
        x = strata.memory.device_put(np.arange(64, dtype=np.float32), sh)
        f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        print("SUM:", float(np.asarray(f(x))[0]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    error = next(line for line in out.splitlines() if line.startswith("ERROR:"))
    assert "strata.memory.zeros: cannot allocate 268435456 bytes" in error and " on cpu:3" in error, error
    assert "released" in error, error
    reserved = eval(next(line for line in out.splitlines() if line.startswith("RESERVED:")).split(":", 1)[1])
    assert all(r <= 64 << 20 for r in reserved), reserved
    assert "SUM: " + str(float(sum(range(0, 64, 8)))) in out, out


# --- item 1: several Python threads launching without waiting ----------------------------------


def test_pool_is_sized_for_several_launching_threads():
    from stratacl_jax import _runtime_setup

    # (T + 1) x devices for T = 8 launching threads; 2 x devices at the least.
    assert _runtime_setup.pool_for(8) == 72
    assert _runtime_setup.pool_for(384) == 768
    assert _runtime_setup.client_pool_threads() >= 72


@pytest.mark.skipif(SANITIZED, reason="a stress run; too slow under a sanitizer")
def test_two_launching_threads_never_hang():
    """2 threads x 200 calls in flight each, strata and lax.psum, in a fresh
    process that did not set PJRT_NPROC itself (hung with a 2N pool)."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "stress_runtime.py"), "--threads", "2",
                           "--iterations", "200", "--runs", "1", "--timeout", "120"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "2 passed, 0 failed" in proc.stdout, proc.stdout + proc.stderr


# --- item 2: a timeout next to XLA's own collectives says what comes next ----------------------


def test_timeout_beside_an_xla_collective_says_to_restart():
    """Rank-dependent cond: strata.all_reduce on some ranks, lax.psum on the
    others. strata times out; the ranks in XLA's rendezvous cannot be
    released and XLA aborts the process later, so the error says so."""
    script = textwrap.dedent("""
        import os
        import stratacl_jax as strata
        strata.emulator.ensure_devices(8)
        import jax, numpy as np
        from jax import lax
        from jax.sharding import NamedSharding, PartitionSpec as P
        mesh = strata.emulator.make_mesh((8,), ("x",))
        def body(v):
            return lax.cond(lax.axis_index("x") < 4, lambda u: strata.all_reduce(u, "x"),
                            lambda u: lax.psum(u, "x"), v)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        x = jax.device_put(np.ones(8 * 4, np.float32), NamedSharding(mesh, P("x")))
        with strata.config(timeout_s=2.0):
            try:
                # Rank 0 took strata's branch: its shard carries strata's error.
                f(x).addressable_shards[0].data.block_until_ready()
                print("NO ERROR", flush=True)
            except Exception as e:
                print("ERROR:", str(e).replace(chr(10), " "), flush=True)
        os._exit(0)  # XLA's rendezvous would abort the process later
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    error = next((line for line in proc.stdout.splitlines() if line.startswith("ERROR:")), "")
    assert "strata.all_reduce" in error and "timed out" in error, proc.stdout + proc.stderr[-3000:]
    assert "XLA's own collectives" in error and "restart the process" in error, error
