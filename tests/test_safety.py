"""No hangs, no silent loss: a sound XLA runtime, timeouts naming the missing
ranks, mismatches naming the disagreeing ranks, clear argument errors."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import shard_run
from jax import lax

import stratacl_jax as strata
from stratacl_jax import _core

HERE = os.path.dirname(__file__)


def test_back_to_back_executions_never_hang():
    """600 chained and 600 independent executions, strata and lax.psum, each in
    a fresh process that did not set PJRT_NPROC itself."""
    proc = subprocess.run([sys.executable, os.path.join(HERE, "stress_runtime.py"), "--iterations", "600",
                           "--runs", "1", "--timeout", "240"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed, 0 failed" in proc.stdout


def test_missing_peer_times_out_with_names_and_runtime_recovers(mesh8):
    x = np.arange(8 * 4, dtype=np.float32)

    def skips_on_rank_2(v):
        return lax.cond(lax.axis_index("x") == 2, lambda u: u, 
                        lambda u: strata.ppermute(u, "x", [(i, (i + 1) % 8) for i in range(8)]), v)

    with strata.config(timeout_s=1.0):
        with pytest.raises(Exception) as info:
            shard_run(skips_on_rank_2, mesh8, x)
    message = str(info.value)
    assert "strata.ppermute" in message and "timed out" in message
    assert "waiting for ranks [2]" in message
    # The process still runs collectives correctly afterwards.
    got = shard_run(lambda v: strata.all_reduce(v, "x"), mesh8, x)
    np.testing.assert_array_equal(got.reshape(8, 4)[0], x.reshape(8, 4).sum(0))
    assert _core.live_slot_count() == 0


def run_threads(block_bytes, absent=(), timeout_s=1.0, kind=0, reduce_op=0):
    n = len(block_bytes)
    inputs = [np.random.default_rng(r).integers(0, 255, max(block_bytes), dtype=np.uint8) for r in range(n)]
    outputs = [np.zeros(max(block_bytes) * 8, np.uint8) for _ in range(n)]
    errors = _core.run_ranks(kind, 7, reduce_op, 0, [], list(block_bytes), 1, 0, 4, 4, 0, 1 << 20,
                             timeout_s, 999, int(np.random.default_rng().integers(1, 1 << 40)), inputs,
                             outputs, list(absent))
    return errors, inputs, outputs


def test_mismatched_ranks_name_the_op_and_the_ranks():
    errors, _, _ = run_threads([64, 64, 128, 64])
    assert all(errors), errors
    assert "strata.all_reduce" in errors[0] and "ranks disagree" in errors[0] and "rank 2" in errors[0]


def test_threads_harness_all_reduce_closed_form():
    errors, inputs, outputs = run_threads([96] * 4)
    assert errors == ["", "", "", ""]
    want = (sum(i.astype(np.int64) for i in inputs) % 256).astype(np.uint8)
    for out in outputs:
        np.testing.assert_array_equal(out[:96], want)


def test_absent_rank_times_out_in_threads_harness():
    errors, _, _ = run_threads([64] * 4, absent=[1], timeout_s=0.5)
    assert errors[1] == ""
    assert all("waiting for ranks [1]" in e for i, e in enumerate(errors) if i != 1), errors


def test_too_small_thread_pool_is_refused_not_hung():
    script = textwrap.dedent("""
        import jax, numpy as np
        jax.config.update("jax_num_cpu_devices", 8)
        jax.devices()  # the backend starts before stratacl_jax can size it
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import stratacl_jax as strata
        assert any("PJRT_NPROC" in str(x.message) for x in w), [str(x.message) for x in w]
        from jax.sharding import PartitionSpec as P, NamedSharding
        mesh = strata.emulator.make_mesh((8,), ("x",))
        f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        try:
            f(jax.device_put(np.ones(8, np.float32), NamedSharding(mesh, P("x")))).block_until_ready()
        except Exception as e:
            assert "PJRT_NPROC=16" in str(e), str(e)
            print("refused")
    """)
    env = dict(os.environ, PJRT_NPROC="8")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stdout + proc.stderr


def test_outside_shard_map_is_a_clear_error():
    with pytest.raises(NameError, match="strata.all_reduce must be called inside jax.shard_map"):
        jax.jit(lambda v: strata.all_reduce(v, "x"))(jnp.ones(3))


@pytest.mark.parametrize("call,error,match", [
    (lambda v: strata.all_reduce(v.astype(jnp.float8_e4m3fn), "x"), TypeError, "dtype float8_e4m3fn is not supported"),
    (lambda v: strata.all_reduce(v.astype(jnp.complex64), "x", op="max"), TypeError, "complex numbers have no max"),
    (lambda v: strata.reduce_scatter(v.astype(jnp.complex128), "x", op="min"), TypeError, "complex numbers have no min"),
    (lambda v: strata.all_reduce(v, "x", op="median"), ValueError, "op must be one of"),
    (lambda v: strata.all_gather(v, "x", to="reduced"), NotImplementedError, "to='reduced' is not supported"),
    (lambda v: strata.all_gather(v, "x", to="sideways"), ValueError, "to must be one of"),
    (lambda v: strata.ragged_all_to_all(v, v, jnp.zeros(8, jnp.int32), jnp.zeros(8, jnp.int32),
                                        jnp.zeros(8, jnp.int32), jnp.zeros(7, jnp.int32), "x"),
     ValueError, "recv_sizes must be 1-D with a positive multiple"),
    (lambda v: strata.ragged_all_to_all(v, v.astype(jnp.float64), *[jnp.zeros(8, jnp.int32)] * 4, "x"),
     ValueError, "must have one dtype"),
    (lambda v: strata.ragged_all_to_all(v, v, *[jnp.zeros(8, jnp.float32)] * 4, "x"),
     ValueError, "input_offsets must be of an integer type"),
    (lambda v: strata.all_reduce(v, "y"), NameError, "unbound axis name 'y'"),
    (lambda v: strata.ppermute(v, "x", [(0, 8)]), ValueError, "out of range"),
    (lambda v: strata.ppermute(v, "x", [(0, 1), (2, 1)]), ValueError, "repeats"),
    (lambda v: strata.broadcast(v, "x", root=8), ValueError, "root must be"),
    (lambda v: strata.reduce_scatter(v, "x", tiled=True), ValueError, "not divisible"),
    (lambda v: strata.all_to_all(v, "x", 0, 0), ValueError, "must equal"),
    (lambda v: strata.all_gather(v, "x", axis=3), ValueError, "out of range"),
])
def test_bad_arguments_raise_at_trace_time(mesh8, call, error, match):
    with pytest.raises(error, match=match):
        shard_run(call, mesh8, np.ones(8 * 3, np.float32))
