"""The extension's op registry and code tables (xla_ffi/algorithms/op_registry.h,
runtime/dtypes.h, exported by _core) against the tables the library derives from them
(mean as a sum, names in code order) and the copies the benchmarks keep (they run
without the library under --impl lax): a code or name that drifts from the C++ one
would send the wrong op, dtype or reduction to the handlers, the model or the trace
reader."""
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from conftest import random_array
from stratacl_jax import _config, _core, _ffi
from stratacl_jax.supernode import op_model as _model
from stratacl_jax.supernode import trace as _trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` is a folder of the repo

from benchmarks import collectives as bench_collectives  # noqa: E402
from benchmarks import latency as bench_latency  # noqa: E402
from benchmarks import multiprocess as bench_multiprocess  # noqa: E402

GROUP_SIZES = (1, 2, 3, 5, 8, 384)


def test_op_names_are_the_python_tables_in_code_order():
    names = _core.op_names()
    fixed = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute")
    assert names == fixed + ("ragged_all_to_all", "moe_dispatch")
    assert _model.OPS == names
    assert _model.OP_KIND == {name: code for code, name in enumerate(names)}
    # ragged_all_to_all's and MoE dispatch's plans are built at the rendezvous from their ranks' data.
    assert [_core.op_planned_at_rendezvous(name) for name in names] == [False] * 6 + [True] * 2
    assert _model.COLLECTIVES == fixed and _model.RAGGED_OPS == ("ragged_all_to_all",)
    assert bench_collectives.OPS == fixed
    assert bench_multiprocess.OPS == fixed
    assert tuple(op for op in bench_latency.OPS if op != "moe") == fixed
    assert set(bench_collectives.SPECS) == set(fixed)
    # Every op is a registered FFI target under its registry name.
    targets = _core.registrations()
    assert all(f"strata_{name}" in targets for name in names)


def test_ops_planned_at_the_rendezvous_have_no_block_size_plan():
    assert _core.bus_factor("ragged_all_to_all", 8) == pytest.approx(7 / 8)
    with pytest.raises(ValueError, match="ragged_all_to_all's plan is built from the sizes its ranks publish"):
        _core.op_block_counts("ragged_all_to_all", 8)
    with pytest.raises(ValueError, match="ragged_all_to_all's plan is built from the sizes its ranks publish"):
        _core.plan_info(_model.OP_KIND["ragged_all_to_all"], 0, 0, 8, 1024, 4, 0)
    with pytest.raises(ValueError, match="moe_dispatch's plan is built from the pair slots its ranks' routing gets"):
        _core.op_block_counts("moe_dispatch", 8)


@pytest.mark.parametrize("n", GROUP_SIZES)
def test_bus_factors_and_block_counts_agree(n):
    for name in _model.COLLECTIVES:
        assert _core.bus_factor(name, n) == pytest.approx(_model.bus_factor(name, n)), name
        assert _core.bus_factor(name, n) == pytest.approx(bench_collectives.SPECS[name].bus_factor(n)), name
        # What _model and _trace assume: these ops' inputs (outputs) hold a block per rank.
        in_blocks, out_blocks = _core.op_block_counts(name, n)
        assert in_blocks == (n if name in ("reduce_scatter", "all_to_all") else 1), name
        assert out_blocks == (n if name in ("all_gather", "all_to_all") else 1), name
        # round_bytes keeps a whole float32 per input block: 4n + 4 bytes -> 4n where blocks split.
        assert _model.round_bytes(name, 4 * n + 4, n) == (4 * n if in_blocks > 1 else 4 * n + 4), name


def test_registry_refuses_unknown_names_and_codes():
    with pytest.raises(ValueError, match="no collective is named all_sum"):
        _core.bus_factor("all_sum", 8)
    with pytest.raises(ValueError, match="no collective has code 8"):
        _core.plan_info(8, 0, 0, 8, 1024, 4, 0)


def test_dtype_codes_and_sizes_agree():
    codes, sizes = _core.dtype_codes(), _core.dtype_sizes()
    assert set(codes) == set(sizes)
    assert _model.DTYPE_CODE == codes
    assert _model.DTYPE_SIZE == sizes
    assert _trace._DTYPE_NAME == {code: name for name, code in codes.items()}
    for name, size in sizes.items():
        assert bench_collectives.np_dtype(name).itemsize == size, name
    # Every dtype the handlers accept has a code (the trace names it, the model times it).
    assert {str(d) for d in _ffi.SUPPORTED_DTYPES} == set(codes)
    assert set(bench_collectives.DTYPES) <= set(codes)


def test_reduction_mode_and_planner_codes_agree():
    ops = _core.reduce_ops()
    assert {**_ffi.REDUCE_OPS, "none": _ffi.NO_REDUCTION} == ops
    assert {k: v for k, v in _model.REDUCE_CODE.items() if k != "mean"} == {k: v for k, v in ops.items() if k != "none"}
    assert _model.REDUCE_CODE["mean"] == ops["sum"]  # a mean is a sum, then a division in Python
    assert _trace._REDUCE_NAME == {code: name for name, code in ops.items()}
    modes, planners = _core.mode_codes(), _core.planner_codes()
    assert _ffi._MODE_CODE == modes
    assert _model.MODES == tuple(sorted(modes, key=modes.get))
    assert _config.MODES == _model.MODES
    assert _ffi._PLANNER_CODE == planners == _model._PLANNER_CODE
    assert _config.PLANNERS == tuple(sorted(planners, key=planners.get))


@pytest.mark.parametrize("dtype", ["complex64", "complex128"])
def test_a_traced_complex_op_is_recorded_and_modeled(mesh8, dtype):
    # The trace reads dtype codes back; complex ones were missing from its table.
    rng = np.random.default_rng(3)
    x = (random_array(rng, (8 * 256,), np.float64) + 1j * random_array(rng, (8 * 256,), np.float64)).astype(dtype)
    f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "x"), mesh=mesh8, in_specs=P("x"), out_specs=P("x")))
    xs = jax.device_put(x, NamedSharding(mesh8, P("x")))
    jax.block_until_ready(f(xs))  # compile outside the trace
    with strata.emulator.trace() as tr:
        y = jax.block_until_ready(f(xs))
    want = np.tile(x.reshape(8, -1).sum(0), 8)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5 if dtype == "complex64" else 1e-12)
    (op,) = tr.ops
    assert op.op == "all_reduce" and op.bytes_per_rank == 256 * np.dtype(dtype).itemsize
    ref = strata.emulator.model("all_reduce", op.bytes_per_rank, npus=8, dtype=dtype)
    assert op.modeled_us["strata"] == pytest.approx(ref.time_us)
