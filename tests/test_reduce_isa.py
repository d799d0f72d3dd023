"""The reduction kernels per instruction set (issue 31): every variant this
machine runs gives the bits of the baseline variant, of a numpy fold in rank
order and, through the collectives, of lax; the choice is reported, forceable
and refuses what the CPU cannot run; the extension holds no fused multiply-add.

Variants: _core.reduce_isas_available() (baseline, avx2, avx512 as built and
supported). Kernels are called directly with _core.reduce_with (no global
switch); the collectives run one compiled program under each variant in turn
(_core.set_reduce_isa: the choice is read per kernel call, not baked in)."""
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import random_array
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import stratacl_jax as strata
from stratacl_jax import _core

ISAS = _core.reduce_isas_available()
DTYPES = ["float32", "float64", "float16", "bfloat16", "complex64", "complex128",
          "int8", "int32", "int64", "uint8", "uint32", "bool"]
OPS = ["sum", "max", "min", "prod"]
SIZES = [0, 1, 3, 17, 1001, 40009]  # 40009: past every kernel's strip, odd
SOURCES = [1, 2, 3, 4, 5, 8, 9]  # the 1..4-sources-per-pass tails, several passes


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def kernel_ops(dtype):
    """What the kernels are asked for: complex numbers have no order; a sum of
    bools is counted in int32 before any kernel sees it."""
    if dtype.startswith("complex"):
        return ["sum", "prod"]
    if dtype == "bool":
        return ["max", "min", "prod"]
    return OPS


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def special_data(rng, dtype, shape):
    """Random data with the values that tell kernels apart: for floats, random
    bit patterns (NaNs with payloads and both signs, infinities, subnormals,
    signed zeros, huge values) mixed with normal values; integers over their
    whole range."""
    dt = np_dtype(dtype)
    n = int(np.prod(shape))
    if dtype == "bool":
        return rng.random(n) < 0.5
    if np.issubdtype(dt, np.integer):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dt)
    if dtype.startswith("complex"):
        part = "float32" if dtype == "complex64" else "float64"
        re_, im_ = special_data(rng, part, shape), special_data(rng, part, shape)
        out = np.empty(n, dt)
        out.real, out.imag = re_, im_
        return out
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[dt.itemsize]
    bits = rng.integers(0, np.iinfo(uint).max, size=n, endpoint=True, dtype=uint).view(dt)
    normal = rng.standard_normal(n).astype(dt)
    out = np.where(rng.random(n) < 0.3, bits, normal)
    picks = rng.random(n)
    out[picks < 0.02] = 0
    out[(picks >= 0.02) & (picks < 0.04)] = -np.asarray(0, dt)
    return out.astype(dt)


def fold_reference(srcs, dtype, op):
    """The kernels' contract in numpy, one ufunc per step (nothing fused):
    sources fold in rank order from the reduction's identity, as XLA:CPU's
    all-reduce does (a float sum starts at +0, so -0s sum to +0; float
    max/min start at -inf/+inf and compare with std::max/min, so a NaN never
    wins and all-NaN gives -inf/+inf); 16-bit floats widen to float32 and
    round once (but a float16 sum rounds every step, as lax's does); integers
    wrap; complex products are (ac - bd, ad + bc)."""
    dt = np_dtype(dtype)
    if dtype.startswith("complex"):
        acc_re, acc_im = srcs[0].real.copy(), srcs[0].imag.copy()
        with np.errstate(all="ignore"):
            if op == "sum":  # from +0, as floats
                acc_re, acc_im = acc_re + 0, acc_im + 0
            for s in srcs[1:]:
                if op == "sum":
                    acc_re, acc_im = acc_re + s.real, acc_im + s.imag
                else:
                    acc_re, acc_im = acc_re * s.real - acc_im * s.imag, acc_re * s.imag + acc_im * s.real
        out = np.empty(len(acc_re), dt)
        out.real, out.imag = acc_re, acc_im
        return out
    wide = np.float32 if dt.itemsize == 2 and not np.issubdtype(dt, np.integer) else dt
    acc, rest = srcs[0].astype(wide), srcs[1:]
    if np.issubdtype(wide, np.floating) and op in ("sum", "max", "min"):
        # Fold every source, from the identity.
        acc, rest = np.full(acc.shape, {"sum": 0, "max": -np.inf, "min": np.inf}[op], wide), srcs
    with np.errstate(all="ignore"):
        for s in rest:
            b = s.astype(wide)
            if op == "sum":
                acc = acc + b
                if dtype == "float16":  # lax's float16 sum rounds every step
                    acc = acc.astype(np.float16).astype(wide)
            elif op == "prod":
                acc = (acc * b) if dtype != "bool" else (acc & b)
            elif np.issubdtype(wide, np.floating):
                # std::max / std::min: (a < b ? b : a) / (b < a ? b : a).
                better = (acc < b) if op == "max" else (b < acc)
                acc = np.where(better, b, acc)
            else:
                acc = (np.maximum if op == "max" else np.minimum)(acc, b)
        return acc.astype(dt)


def same_bits(got, want, dtype, nan_payloads=True):
    """Bit equality; with nan_payloads=False a NaN only has to meet a NaN
    (numpy and XLA pick NaN payloads their own way)."""
    gb, wb = got.view(np.uint8), want.view(np.uint8)
    if nan_payloads or dtype in ("bool",) or np.issubdtype(np_dtype(dtype), np.integer):
        return np.array_equal(gb, wb)
    flat = lambda a: a.view(a.real.dtype) if dtype.startswith("complex") else a  # noqa: E731
    with np.errstate(all="ignore"):
        g, w = flat(got).astype(np.float64), flat(want).astype(np.float64)
    nan = np.isnan(g)
    if not np.array_equal(nan, np.isnan(w)):
        return False
    return np.array_equal(flat(got)[~nan].view(np.uint8), flat(want)[~nan].view(np.uint8))


def exact_nans(op):
    """Whether variants must agree on NaN payloads too. Max/min never give
    a NaN (see fold_reference): yes, trivially. When two NaNs meet in a sum or
    product, which payload survives is the hardware's first operand, and the
    compiler may commute an add or multiply (C and IEEE leave the payload
    unspecified): the ASan build's AVX2 code kept the other NaN than its
    baseline code. So for sum/prod a NaN has to meet a NaN, and every other
    value must match bit for bit."""
    return op in ("max", "min")


def run_kernel(isa, dtype, op, srcs, num_outs=1, streaming=False):
    raw = [np.ascontiguousarray(s).view(np.uint8).reshape(-1) for s in srcs]
    outs = [np.full(raw[0].size, 0xA5, np.uint8) for _ in range(num_outs)]
    _core.reduce_with(isa, "bool" if dtype == "bool" else str(np_dtype(dtype)), op, raw, outs, streaming)
    for o in outs[1:]:
        assert np.array_equal(o, outs[0]), "the copies of one result differ"
    return outs[0].view(np_dtype(dtype))


def test_choice_is_reported_and_the_widest_the_cpu_runs():
    assert ISAS[0] == "baseline"
    assert set(ISAS) <= set(_core.reduce_isas_known()) == {"baseline", "avx2", "avx512"}
    assert strata.stats()["reduce_isa"] == _core.reduce_isa()
    flags = cpu_flags()
    if "avx2" in flags:  # a build that dropped the variant would fall back silently
        assert "avx2" in ISAS
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert "avx512" in ISAS
    if os.environ.get("STRATA_REDUCE_ISA", "auto") == "auto":
        assert _core.reduce_isa() == ISAS[-1]


def test_set_reduce_isa_switches_and_refuses_what_it_cannot_run():
    before = _core.reduce_isa()
    try:
        for isa in ISAS:
            _core.set_reduce_isa(isa)
            assert _core.reduce_isa() == strata.stats()["reduce_isa"] == isa
        with pytest.raises(ValueError, match="unknown reduction ISA 'sse9'"):
            _core.set_reduce_isa("sse9")
        for isa in set(_core.reduce_isas_known()) - set(ISAS):
            with pytest.raises(ValueError, match=isa):
                _core.set_reduce_isa(isa)
            with pytest.raises(ValueError, match=isa):
                _core.reduce_with(isa, "float32", "sum", [np.zeros(4, np.uint8)], [np.zeros(4, np.uint8)])
        _core.set_reduce_isa("auto")
        assert _core.reduce_isa() == ISAS[-1]
    finally:
        _core.set_reduce_isa(before)


@pytest.mark.parametrize("env, want, warns", [("baseline", "baseline", False),
                                              ("sse9", None, True), ("avx512", None, "avx512" not in ISAS)])
def test_environment_variable_is_read_at_load(env, want, warns):
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import stratacl_jax as s; from stratacl_jax import _core\n"
            "print('ISA', s.stats()['reduce_isa'], _core.reduce_isas_available()[-1])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "STRATA_REDUCE_ISA": env})
    assert r.returncode == 0, r.stderr
    got, widest = re.search(r"ISA (\S+) (\S+)", r.stdout).groups()
    assert got == (want or (env if env in ISAS else widest))
    assert ("STRATA_REDUCE_ISA=" + env + " ignored" in r.stderr) == bool(warns), r.stderr


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_bit_identical_to_baseline_and_rank_order_fold(dtype):
    rng = np.random.default_rng(abs(hash(dtype)) % (1 << 32))
    for op in kernel_ops(dtype):
        for size in SIZES:
            for n in (SOURCES if size < 40009 else (1, 3, 8)):
                srcs = [special_data(rng, dtype, (size,)) for _ in range(n)]
                base = run_kernel("baseline", dtype, op, srcs)
                want = fold_reference(srcs, dtype, op)
                assert same_bits(base, want, dtype, nan_payloads=False), (dtype, op, size, n)
                for isa in ISAS[1:]:
                    got = run_kernel(isa, dtype, op, srcs, num_outs=2, streaming=size == 1001)
                    assert same_bits(got, base, dtype, nan_payloads=exact_nans(op)), (isa, dtype, op, size, n)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_kernels_on_every_bit_pattern(dtype):
    """Every 16-bit pattern as a source, against shuffled partners: each
    widening, and the rounding of sums and products that land in every range
    (subnormal, normal, overflow, NaN, ties)."""
    rng = np.random.default_rng(7)
    every = np.arange(1 << 16, dtype=np.uint16).view(np_dtype(dtype))
    for op in OPS:
        for srcs in ([every], [every, rng.permutation(every)],
                     [rng.permutation(every), every, rng.permutation(every)]):
            base = run_kernel("baseline", dtype, op, srcs)
            assert same_bits(base, fold_reference(srcs, dtype, op), dtype, nan_payloads=False), (dtype, op)
            for isa in ISAS[1:]:
                assert same_bits(run_kernel(isa, dtype, op, srcs), base, dtype,
                                 nan_payloads=exact_nans(op)), (isa, dtype, op)


def rank_fold_lax(g, dtype, op):
    """lax's side in rank order: g = all_gather of the ranks' blocks; the same
    fold as the kernels, each step an XLA elementwise op, a sum from +0 as
    XLA:CPU's all-reduce starts it. Max/min: None, meaning lax.pmax/pmin
    themselves (XLA:CPU folds them from -inf/+inf with std::max/min, so a
    NaN never wins; the kernels do the same, bit for bit)."""
    if op in ("max", "min"):
        return None
    # bfloat16 widens and rounds once; float16 products too, but float16 sums
    # round every step (XLA's float16 add), as lax.psum's do.
    wide = jnp.float32 if dtype == "bfloat16" or (dtype == "float16" and op == "prod") else None
    step = {"sum": jnp.add, "prod": jnp.multiply}[op]
    acc = g[0].astype(wide) if wide else g[0]
    if op == "sum" and not np.issubdtype(np_dtype(dtype), np.integer):
        acc = jnp.zeros_like(acc) + acc
    for k in range(1, g.shape[0]):
        acc = step(acc, g[k].astype(wide) if wide else g[k])
    return acc.astype(g.dtype)


@pytest.mark.parametrize("op", OPS)
def test_collectives_under_every_variant_match_lax_bit_for_bit(mesh8, op):
    """all_reduce and reduce_scatter of every dtype, odd and tiny sizes, one
    compiled program run under each variant; lax's side in rank order."""
    rng = np.random.default_rng(31 + OPS.index(op))
    dtypes = [d for d in DTYPES if op in ("sum", "prod") or not d.startswith("complex")]
    sizes = [1, 7, 1001, 8 * 1250 + 3]  # elements per rank (all_reduce)
    xs = {}
    for d in dtypes:
        for m in sizes:
            x = random_array(rng, (8 * m,), np_dtype(d)) if not d.startswith("complex") else \
                (rng.standard_normal(8 * m) + 1j * rng.standard_normal(8 * m)).astype(d)
            if np.issubdtype(np_dtype(d), np.floating) and m > 1:
                x[::97] = np.inf
                x[5::101] = -np.inf
                x[3::89] = np.nan
            if d in ("int8", "uint8") and op == "prod":
                x = rng.integers(0, 256, size=8 * m).astype(np.uint8).view(np_dtype(d))  # wraps
            xs[(d, m)] = x
    sharding = NamedSharding(mesh8, P("x"))
    placed = {k: jax.device_put(v, sharding) for k, v in xs.items()}
    # reduce_scatter scatters the per-rank block over 8 ranks: sizes divisible by 8 only.
    rs_keys = [k for k in xs if (xs[k].size // 8) % 8 == 0]

    def strata_fn(t):
        ar = {k: strata.all_reduce(v, "x", op=op) for k, v in t.items()}
        rs = {k: strata.reduce_scatter(t[k], "x", tiled=True, op=op) for k in rs_keys}
        return ar, rs

    def lax_fn(t):
        out = {}
        for (d, m), v in t.items():
            if op == "sum" and d == "bool":
                out[(d, m)] = lax.psum(v, "x")
            elif d == "bool":  # max: any, min and prod: all
                g = lax.all_gather(v, "x")
                acc = g[0]
                for k in range(1, 8):
                    acc = (acc | g[k]) if op == "max" else (acc & g[k])
                out[(d, m)] = acc
            else:
                folded = rank_fold_lax(lax.all_gather(v, "x"), d, op)
                if folded is None:
                    folded = (lax.pmax if op == "max" else lax.pmin)(v, "x")
                elif np.issubdtype(np_dtype(d), np.integer) and op == "sum":
                    folded = lax.psum(v, "x")
                out[(d, m)] = folded
        return out

    def smap(fn, out_specs):
        return jax.jit(jax.shard_map(fn, mesh=mesh8, in_specs=(P("x"),), out_specs=out_specs,
                                     check_vma=False))

    run_strata = smap(strata_fn, ({k: P("x") for k in xs}, {k: P("x") for k in rs_keys}))
    run_lax = smap(lax_fn, {k: P("x") for k in xs})
    want = jax.tree.map(np.asarray, run_lax(placed))
    before = _core.reduce_isa()
    try:
        results = {}
        for isa in ISAS:
            _core.set_reduce_isa(isa)
            results[isa] = jax.tree.map(np.asarray, run_strata(placed))
    finally:
        _core.set_reduce_isa(before)
    for isa, (ar, rs) in results.items():
        for k in xs:
            d, m = k
            # lax's side is every rank's copy of the full result.
            full = want[k].reshape(8, m)[0]
            if d.startswith("complex") and op == "prod":
                # XLA:CPU fuses complex products into FMAs on FMA hosts (even
                # written out on planes: it contracts a*b - c*d); the kernels
                # round each product, as the issue asks. So: the exact
                # two-rounding fold, and lax within an ulp or two.
                full = fold_reference(list(xs[k].reshape(8, m)), d, op)
                eps = np.finfo(np_dtype(d)).eps
                np.testing.assert_allclose(ar[k].reshape(8, m)[0], want[k].reshape(8, m)[0],
                                           rtol=64 * eps, atol=64 * eps)
            assert same_bits(ar[k].reshape(8, m)[0], full, d, nan_payloads=False), (isa, op, d, m, "all_reduce")
            assert all(ar[k].reshape(8, m)[r].tobytes() == ar[k].reshape(8, m)[0].tobytes() for r in range(8))
            if isa != "baseline":
                assert same_bits(ar[k], results["baseline"][0][k], d, nan_payloads=exact_nans(op)), (isa, op, d, m)
        for k in rs_keys:
            d, m = k
            full = want[k].reshape(8, m)[0]
            if d.startswith("complex") and op == "prod":
                full = fold_reference(list(xs[k].reshape(8, m)), d, op)
            assert same_bits(rs[k], full, d, nan_payloads=False), (isa, op, d, m, "reduce_scatter")
            if isa != "baseline":
                assert same_bits(rs[k], results["baseline"][1][k], d, nan_payloads=exact_nans(op)), (isa, op, d, m)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_empty_collectives(mesh8, op):
    x = jax.device_put(np.zeros((0,), np.float32), NamedSharding(mesh8, P("x")))
    before = _core.reduce_isa()
    try:
        for isa in ISAS:
            _core.set_reduce_isa(isa)
            f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "x", op=op), mesh=mesh8,
                                      in_specs=P("x"), out_specs=P("x")))
            assert np.asarray(f(x)).shape == (0,)
    finally:
        _core.set_reduce_isa(before)


def test_extension_has_no_fused_multiply_add():
    """No variant may fuse a product into an add (one rounding where XLA
    rounds twice). -ffp-contract=off is not enough with GCC 12: its vectoriser
    fuses a complex product's (ac - bd, ad + bc) lanes into vfmaddsub when the
    ISA has FMA (AVX-512), which reduce_kernels.inc's layout avoids."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not installed")
    r = subprocess.run([objdump, "-d", "--no-show-raw-insn", _core.__file__], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    fused = [line for line in r.stdout.splitlines() if re.search(r"\bv?f(n?m(add|sub)|maddsub|msubadd)\w*", line)]
    assert not fused, fused[:5]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_moe_combine_under_every_variant(mesh8, dtype):
    """The combine's weighted accumulation (AxpyRow and the rounded partials)
    follows the same choice: one compiled program under each variant gives
    the bits of a numpy model of combine's order (float32 accumulator, float64
    for float64 rows; each product rounded, then added; from zero, ranks
    ascending: a rank holding one of the token's pairs adds w * row, one
    holding several adds their sum in k order rounded to the row type; the
    total rounded to the row type)."""
    from test_moe import np_dispatch, np_layout

    n, t, h, k, e, cap = 8, 16, 40, 3, 16, 5
    rng = np.random.default_rng(3)
    dt = np_dtype(dtype)
    idx = rng.integers(0, e, (n, t, k)).astype(np.int32)
    x = rng.standard_normal((n, t, h)).astype(dt)
    wdt = np.float64 if dtype == "float64" else np.float32
    w = rng.random((n, t, k)).astype(wdt)
    spec = P("x")
    args = [jax.device_put(a, NamedSharding(mesh8, spec))
            for a in (x.reshape(n * t, h), idx.reshape(n * t, k), w.reshape(n * t, k))]

    def body(xs, ids, ws):
        recv, hd = strata.moe.dispatch(xs, ids, axis_name="x", num_experts=e, capacity=cap)
        return strata.moe.combine(recv, hd, ws)

    f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=(spec,) * 3, out_specs=spec))
    before = _core.reduce_isa()
    try:
        outs = {}
        for isa in ISAS:
            _core.set_reduce_isa(isa)
            outs[isa] = np.asarray(f(*args))
    finally:
        _core.set_reduce_isa(before)

    slot, _, _ = np_layout(idx, e, cap)
    rows = np_dispatch(x, slot, e, cap).reshape(e * cap, h)
    acc_t = np.float64 if dtype == "float64" else np.float32
    slots_per_rank = e // n * cap
    want = np.zeros((n, t, h), dt)
    for (r, i), token_slots in zip(np.ndindex(n, t), slot.reshape(n * t, k)):
        acc = np.zeros(h, acc_t)
        for owner in sorted({s // slots_per_rank for s in token_slots if s >= 0}):
            part, pairs = np.zeros(h, acc_t), 0
            for j, s in enumerate(token_slots):
                if s >= 0 and s // slots_per_rank == owner:
                    part = part + w[r, i, j].astype(acc_t) * rows[s].astype(acc_t)
                    pairs += 1
            acc = acc + (part if pairs == 1 else part.astype(dt).astype(acc_t))
        want[r, i] = acc.astype(dt)
    want = want.reshape(n * t, h)
    for isa, got in outs.items():
        assert got.tobytes() == want.tobytes(), (isa, dtype)
