"""Shared plumbing for the benchmark subcommands: devices, strata loading, timing, tables, outputs.

Nothing here may start JAX's CPU backend at import time: the device count and the PjRt thread
pool size are fixed when the backend starts, so `setup_devices` must run first.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

# ----------------------------------------------------------------------------------------------
# Arguments


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)[bB]?\s*$")
_SIZE_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str | int) -> int:
    """'4K' -> 4096, '1M' -> 1048576 (binary suffixes, as nccl-tests)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r}: use a number with an optional K/M/G suffix")
    return int(float(m.group(1)) * _SIZE_MULT[m.group(2).lower()])


def format_size(nbytes: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult and nbytes % mult == 0:
            return f"{nbytes // mult}{unit}"
    return f"{nbytes}"


def size_sweep(begin: int, end: int, factor: float) -> list[int]:
    """nccl-tests' -b/-e/-f: begin, begin*f, ... up to end (inclusive)."""
    if begin <= 0 or end < begin:
        raise ValueError("need 0 < -b <= -e")
    if factor <= 1:
        return [begin] if begin == end else [begin, end]
    sizes, s = [], float(begin)
    while s <= end * (1 + 1e-9):
        sizes.append(int(round(s)))
        s *= factor
    return sizes


def parse_mesh(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        shape = tuple(int(p) for p in re.split(r"[x,*]", text.lower()) if p)
    except ValueError:
        raise ValueError(f"bad --mesh {text!r}: use e.g. 8 or 2x4") from None
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"bad --mesh {text!r}")
    return shape


def mesh_axis_names(shape: Sequence[int]) -> tuple[str, ...]:
    if len(shape) == 1:
        return ("npu",)
    if len(shape) == 2:
        return ("node", "npu")  # supernode reading: nodes of NPUs
    return tuple(f"a{i}" for i in range(len(shape)))


def split_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items == ["all"]:
        return list(allowed)
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"bad {what} {text!r}: choose from {', '.join(allowed)} or all")
    return items


def modes_from_arg(text: str) -> list[str]:
    return split_list(text, ("strata", "buffer_centric"), "--mode")


def impls_from_arg(text: str) -> list[str]:
    return split_list(text, ("strata", "lax"), "--impl")


# argparse types: a bad value is one line on stderr and exit status 2, never a traceback.


def size_arg(text: str) -> int:
    """argparse type of -b/-e: '4K' -> 4096; a bad size is a one-line usage error."""
    try:
        v = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: must be > 0")
    return v


def sizes_arg(text: str) -> str:
    """argparse type of --sizes: checks every item, returns the text (callers split it)."""
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("empty --sizes")
    for t in items:
        size_arg(t)
    return text


def list_arg(allowed: Sequence[str], what: str, aliases: dict | None = None):
    """argparse type of a comma list of `allowed` names (or 'all'): returns the text unchanged
    (run() splits it with split_list), or a one-line error naming the valid choices."""
    def check(text: str) -> str:
        items = [t.strip() for t in str(text).split(",") if t.strip()]
        bad = [t for t in items if t != "all" and t not in allowed and t not in (aliases or {})]
        if bad or not items or ("all" in items and len(items) > 1):
            import difflib

            near = [m for t in bad for m in difflib.get_close_matches(t, allowed, 1)]
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(bad) or repr(text)}"
                f"{' (did you mean ' + ', '.join(near) + '?)' if near else ''}: choose from "
                f"{', '.join(allowed)}, a comma list of them, or all")
        return text

    check.__name__ = what.lstrip("-").replace("-", "_")
    return check


def mesh_arg(text: str) -> str:
    try:
        parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def int_at_least(lo: int):
    def check(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be >= {lo}")
        return v

    check.__name__ = f"integer >= {lo}"
    return check


def one_line_errors(p, validate: Callable | None = None) -> None:
    """Make parser `p` report a bad command line as one line (`prog: error: ...`, exit 2, no usage
    dump, no traceback), and run `validate(args, p)` right after every parse, for checks that
    need several arguments (-b <= -e, --root < N). Installed by add_args, so the CLI needs no
    extra call."""
    def error(message: str):
        p.exit(2, f"{p.prog}: error: {message} (see -h)\n")

    p.error = error
    if validate is not None:
        parse_known = p.parse_known_args

        def parse_known_args(args=None, namespace=None):
            ns, extra = parse_known(args, namespace)
            try:
                validate(ns, p)
            except (ValueError, argparse.ArgumentTypeError) as e:  # one line, exit 2
                p.error(str(e))
            return ns, extra

        p.parse_known_args = parse_known_args


# ----------------------------------------------------------------------------------------------
# Devices and the library under test

MAX_NPUS = 384
_DEVICE_SETUP: dict = {}
_STRATA: tuple[Any, str] | None = None


def disable_strata(reason: str) -> None:
    """Never import the library in this process (e.g. --impl lax: keep lax runs independent)."""
    global _STRATA
    _STRATA = (None, reason)


def load_strata() -> tuple[Any, str]:
    """(module, "") or (None, reason). Cached: import errors are reported as skipped rows."""
    global _STRATA
    if _STRATA is None:
        try:
            import stratacl_jax as strata  # noqa: PLC0415 - optional, loaded late on purpose

            _STRATA = (strata, "")
        except Exception as e:  # ImportError, or a half-built extension failing at load
            _STRATA = (None, f"stratacl_jax not importable: {one_line(e)}")
    return _STRATA


def setup_devices(n: int) -> dict:
    """Give this process >= n CPU devices and a PjRt pool of >= 2n threads, before JAX starts.

    Prefers strata.emulator.ensure_devices; falls back to doing the same by hand so the lax
    side still runs when the library is missing. A pool smaller than 2n threads deadlocks
    back-to-back multi-device programs on small machines (FACTS §1b)."""
    if not 1 <= n <= MAX_NPUS:
        raise ValueError(f"--npus must be in 1..{MAX_NPUS}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    strata, _ = load_strata()
    how = "manual"
    ensure = getattr(getattr(strata, "emulator", None), "ensure_devices", None)
    if ensure is not None:
        try:
            ensure(n)
            how = "strata.emulator.ensure_devices"
        except Exception as e:
            print(f"# warning: strata.emulator.ensure_devices({n}) failed: {one_line(e)}",
                  file=sys.stderr)
    if how == "manual":
        import jax

        want = 2 * n
        if int(os.environ.get("PJRT_NPROC", "0") or 0) < want:
            os.environ["PJRT_NPROC"] = str(want)
        try:
            if jax.config.jax_num_cpu_devices < n:
                jax.config.update("jax_num_cpu_devices", n)
        except Exception as e:  # backend already up (in-process use): checked just below
            print(f"# warning: could not set jax_num_cpu_devices: {one_line(e)}", file=sys.stderr)
    import jax

    have = len(jax.devices())
    if have < n:
        raise SystemExit(
            f"this process has {have} CPU devices, {n} needed: set devices before JAX starts "
            f"(run the CLI in a fresh process)")
    _DEVICE_SETUP.update(device_setup=how, devices=have)
    return dict(_DEVICE_SETUP)


def make_mesh(shape: Sequence[int], names: Sequence[str]):
    """The library's mesh when it has one, else the same thing from jax (axis types Auto)."""
    strata, _ = load_strata()
    mm = getattr(getattr(strata, "emulator", None), "make_mesh", None)
    if mm is not None:
        try:
            return mm(tuple(shape), tuple(names))
        except Exception as e:
            print(f"# warning: strata.emulator.make_mesh failed ({one_line(e)}); using jax's",
                  file=sys.stderr)
    import jax
    from jax.sharding import AxisType

    n = math.prod(shape)
    return jax.make_mesh(tuple(shape), tuple(names), axis_types=(AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:n])


def one_line(e: BaseException, limit: int = 160) -> str:
    msg = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {msg[0] if msg else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Skip(Exception):
    """A measurement that cannot run here (feature missing, unsupported combination)."""


def failure(e: BaseException) -> dict:
    """Row fields for a measurement that did not run: status, one-line reason, full detail."""
    status, reason = classify_failure(e)
    detail = str(e).strip()
    return {"status": status, "reason": reason,
            "detail": detail[:4000] if status == "error" and len(detail) > len(reason) else None}


def classify_failure(e: BaseException) -> tuple[str, str]:
    """('skipped'|'error', reason). Missing features skip; anything else is an error."""
    if isinstance(e, Skip):
        return "skipped", str(e)
    if isinstance(e, NotImplementedError) or (
            isinstance(e, AttributeError) and "module 'stratacl_jax" in str(e)):
        return "skipped", one_line(e)  # the library does not have it (yet)
    return "error", one_line(e)


def strata_mode_context(strata, mode: str):
    """strata.config(mode=...) as a context manager, or Skip if the mode is not there."""
    if strata is None:
        raise Skip(load_strata()[1])
    cfg = getattr(strata, "config", None)
    if cfg is None:
        if mode == "strata":
            import contextlib

            return contextlib.nullcontext()
        raise Skip("strata.config missing")
    try:
        ctx = cfg(mode=mode)
        if not hasattr(ctx, "__enter__"):
            raise TypeError("strata.config(...) is not a context manager")
        return ctx
    except Exception as e:
        raise Skip(f"mode={mode} unsupported: {one_line(e)}") from e


def strata_stats(strata) -> dict | None:
    fn = getattr(strata, "stats", None) if strata is not None else None
    if fn is None:
        return None
    try:
        return dict(fn())
    except Exception:
        return None


def reset_strata_stats(strata) -> None:
    fn = getattr(strata, "reset_stats", None) if strata is not None else None
    if fn is not None:
        try:
            fn()
        except Exception:
            pass


# ----------------------------------------------------------------------------------------------
# Child processes: where XLA:CPU may abort (its own rendezvous timing out at 384 devices), a
# measurement runs in a child so that a crash costs its cells, not the run.


def run_child(subcommand: str, argv: Sequence[str], timeout: float) -> tuple[int | str, str]:
    """`python -m benchmarks SUBCOMMAND ARGV` with no outputs of its own; (exit code or
    'timeout', stderr)."""
    import subprocess

    cmd = [sys.executable, "-m", "benchmarks", subcommand, *argv,
           "--out", "", "--json", "", "--csv", "", "--plot", "", "--no-progress"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return "timeout", err


def child_failure(rc, stderr: str) -> str:
    """The child's exit status and the line that says why (XLA's fatal log line if any)."""
    stderr = stderr or ""
    m = re.search(r"Termination timeout for `([^`]*?) Rendezvous.*?Expected (\d+) threads.*?"
                  r"only (\d+) of them arrived", stderr)
    if m:  # XLA:CPU's own abort when a collective's rendezvous never completes
        return (f"child process exited {rc}: XLA aborted, `{m.group(1)}` rendezvous timed out "
                f"(only {m.group(3)} of {m.group(2)} device threads arrived)")
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    why = next((ln for ln in lines if ln.startswith("F") and "]" in ln), None) or \
        next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), None) or \
        (lines[-1] if lines else "")
    if "] " in why:
        why = why.split("] ", 1)[1]
    why = why if len(why) <= 150 else why[:147] + "..."
    return f"child process {'timed out' if rc == 'timeout' else f'exited {rc}'}: {why}"



def child_aborted(rc, reason: str) -> bool:
    """SIGABRT, or XLA's own abort message: the cell says 'aborted'."""
    return rc == -6 or "abort" in reason.lower()


# ----------------------------------------------------------------------------------------------
# Timing

# XLA:CPU lets at most 32 executions be in flight; beyond that a small thread pool deadlocks
# (FACTS §1b). Blocking every 16 calls keeps far from that and costs little pipelining.
SYNC_EVERY = 16


@dataclass
class Timing:
    mean_us: float  # per call: the mean of one block of calls, or the median of block means
    iters: int
    warmup: int
    first_call_s: float  # trace + compile + first execution (0 when already compiled)
    total_s: float
    blocks_us: list = field(default_factory=list)  # per-call mean of each timed block


def time_calls(fn: Callable, args: tuple, *, iters: int, warmup: int, repeats: int = 1,
               max_seconds: float = 0.0, chain: Callable | None = None,
               first_call: bool = True, sync_every: int = SYNC_EVERY) -> tuple[Timing, Any]:
    """Mean wall time per call of `fn(*args)` over `iters` back-to-back calls.

    The first call (trace + compile + run) is not counted; then `warmup` calls; then the timed
    calls, issued without waiting, blocking every `sync_every` calls and after the last. With
    `repeats` > 1 the timed block runs that many times and the median block mean is reported
    (the machine is shared: one slow block should not decide). `chain(args, out) -> args` feeds
    outputs back in (training steps). `max_seconds` > 0 lowers the iteration count so one
    measurement stays near that budget (estimated from the warm-up)."""
    import jax

    out, first = None, 0.0
    if first_call:
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        first = time.perf_counter() - t0
        if chain is not None:
            args = chain(args, out)

    def issue(calls: int, out, args):
        """`calls` back-to-back calls, blocking every `sync_every` and after the last;
        returns (last output, args, seconds)."""
        t0 = time.perf_counter()
        for k in range(calls):
            out = fn(*args)
            if chain is not None:
                args = chain(args, out)
            if (k + 1) % sync_every == 0:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        return out, args, time.perf_counter() - t0

    out, args, dt = issue(warmup, out, args)
    per_call = dt / warmup if warmup else first
    if max_seconds > 0 and per_call > 0:
        iters = max(1, min(iters, int(max_seconds / repeats / per_call)))
    blocks, total = [], 0.0
    for _ in range(max(1, repeats)):
        out, args, dt = issue(iters, out, args)
        total += dt
        blocks.append(dt / iters * 1e6)
    timing = Timing(float(np.median(blocks)), iters, warmup, first, total, blocks)
    return (timing, (out, args)) if chain is not None else (timing, out)


_FLOOR_INPUTS: np.ndarray | None = None


# How many calls' outputs XLA:CPU keeps alive in the timed loops (the host blocks every
# SYNC_EVERY calls), and the most memory the floor's copies may hold to mirror that.
FLOOR_WINDOW_BYTES = 256 << 20


def floor_copy_us(nbytes_read_plus_written: int, ranks: int = 1, out_bytes: int = 0,
                  in_bytes: int = 0, min_reps: int = 3, min_seconds: float = 0.02,
                  max_reps: int = 50, threads: int | None = None) -> float:
    """Time of the memory reference (not a lower bound: strata can beat it): np.copyto calls
    laid out like the op, on every core.

    Each of `ranks` ranks fills its whole output (`out_bytes`, the op's per-rank output size;
    at least 1/(2*ranks) of the op's minimal traffic, so the copies move at least half of it)
    from the op's inputs (`in_bytes` per rank, one touched pool; 0: every rank copies the
    same input, as a broadcast's ranks all read the root's). The outputs are fresh
    memory, as the op's are: np.empty (malloc, like XLA:CPU's output buffers) for every rank
    and repetition, and the outputs of the last SYNC_EVERY repetitions stay alive, as the
    timed loop keeps that many calls' outputs (at most FLOOR_WINDOW_BYTES). So glibc hands the
    floor the same kind of memory it hands XLA: new pages above its mmap threshold, recycled
    heap pages below it, and not the cache-hot buffer just freed.

    The copies run on `threads` threads (default: every core; np.copyto releases the GIL) in
    pieces of at least 256 KiB, and also on one thread: the floor is the faster of the two
    medians (threads cost more than they give on small copies). Median over repetitions,
    after one window of untimed ones."""
    ranks = max(1, ranks)
    copy = max(1, out_bytes, nbytes_read_plus_written // 2 // ranks)
    stride = max(0, in_bytes)  # 0: every rank reads the same source (broadcast)
    pool = _floor_inputs(max(copy, ranks * stride))
    srcs = [pool[o:o + copy] for o in (min(r * stride, pool.size - copy) for r in range(ranks))]
    window = max(1, min(SYNC_EVERY, FLOOR_WINDOW_BYTES // (ranks * copy)))
    threads = max(1, threads or os.cpu_count() or 1)
    piece = max(256 << 10, -(-ranks * copy // threads))  # bytes per piece, ceil

    def pieces(outs):
        for dst, src in zip(outs, srcs):
            for o in range(0, copy, piece):
                yield dst[o:o + piece], src[o:o + piece]

    def run(executor):
        alive: list[list[np.ndarray]] = []
        times: list[float] = []
        spent = 0.0
        rep = 0
        while len(times) < max_reps and (len(times) < min_reps or spent < min_seconds):
            if len(alive) >= window:
                alive.pop(0)
            t0 = time.perf_counter()
            outs = [np.empty(copy, dtype=np.uint8) for _ in srcs]
            if executor is None:
                for dst, src in pieces(outs):
                    np.copyto(dst, src)
            else:
                work = list(pieces(outs))
                list(executor.map(lambda k: [np.copyto(d, s) for d, s in work[k::threads]],
                                  range(threads)))
            dt = time.perf_counter() - t0
            alive.append(outs)
            del outs
            rep += 1
            if rep > window:  # the first window fills the allocator's state as the op's calls do
                times.append(dt)
                spent += dt
        return float(np.median(times)) * 1e6

    best = run(None)
    if threads > 1 and ranks * copy > piece:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads) as executor:
            best = min(best, run(executor))
    return best


def _floor_inputs(nbytes: int) -> np.ndarray:
    """The floor's touched input pool (cached: made once per size)."""
    global _FLOOR_INPUTS
    if _FLOOR_INPUTS is None or _FLOOR_INPUTS.size != nbytes:
        _FLOOR_INPUTS = None  # free the old pool before making the new one
        _FLOOR_INPUTS = np.ones(nbytes, dtype=np.uint8)  # ones: touched, not the zero page
    return _FLOOR_INPUTS


_WRITE_FLOOR: dict[int, float] = {}
# Above this many bytes the floor is measured on this many and scaled linearly (a rate at
# 256 MiB is already main memory's: writing more cannot go faster per byte).
WRITE_FLOOR_MAX_BYTES = 256 << 20


def write_floor_us(nbytes: int, threads: int | None = None, reps: int = 40,
                   min_seconds: float = 0.02) -> float:
    """A lower bound on the time of any op whose outputs hold `nbytes` bytes in all.

    Why it is a bound: the op (not donating its input) must write every byte of its outputs
    into distinct buffers, and no way of writing B bytes on this machine is faster than the
    fastest one we can find: memset (ndarray.fill) of B bytes already mapped and cache-warm
    (no page faults, unlike XLA's fresh outputs), on one thread or split over every core,
    the MINIMUM over `reps` tries (not the median: noise only makes a try slower). Reads, the
    launch of the program and any synchronisation are not counted, so the bound is loose at
    small sizes (there the program's launch dominates). Measured once per byte count per run."""
    nbytes = max(1, int(nbytes))
    if nbytes in _WRITE_FLOOR:
        return _WRITE_FLOOR[nbytes]
    if nbytes > WRITE_FLOOR_MAX_BYTES:
        us = write_floor_us(WRITE_FLOOR_MAX_BYTES, threads, reps, min_seconds) * \
            (nbytes / WRITE_FLOOR_MAX_BYTES)
        _WRITE_FLOOR[nbytes] = us
        return us
    buf = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults left
    threads = max(1, threads or os.cpu_count() or 1)

    def tries(fill) -> float:
        best, spent, k = float("inf"), 0.0, 0
        while k < reps or spent < min_seconds:
            t0 = time.perf_counter()
            fill(k & 0xFF)
            dt = time.perf_counter() - t0
            best, spent, k = min(best, dt), spent + dt, k + 1
            if k >= 10 * reps:
                break
        return best

    best = tries(buf.fill)
    if threads > 1 and nbytes >= (1 << 20):
        from concurrent.futures import ThreadPoolExecutor

        step = -(-nbytes // threads)
        parts = [buf[o:o + step] for o in range(0, nbytes, step)]
        with ThreadPoolExecutor(threads) as ex:
            best = min(best, tries(lambda v: list(ex.map(lambda a: a.fill(v), parts))))
    del buf
    _WRITE_FLOOR[nbytes] = best * 1e6
    return best * 1e6


# ----------------------------------------------------------------------------------------------
# Tables


@dataclass
class Col:
    key: str
    head: str
    unit: str = ""
    fmt: str = ""  # python format spec, or "" for str()
    width: int = 10


def _cell(v: Any, c: Col) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "N/A"
    if c.fmt and isinstance(v, (int, float, np.integer, np.floating)):
        return format(v, c.fmt)
    return str(v)


def render_table(cols: Sequence[Col], rows: Sequence[dict], *, title: str = "",
                 groups: Sequence[tuple[str, int]] = (), footer: Sequence[str] = ()) -> str:
    """nccl-tests-like fixed-width text: '#' header lines (group, name, unit), rows, footer.
    A row's `_note` (why it was skipped) is printed after its cells."""
    widths = [max(c.width, len(c.head), len(c.unit)) for c in cols]
    lines = []
    if title:
        lines.append(f"# {title}")
    if groups:
        parts, i = [], 0
        for name, span in groups:
            w = sum(widths[i:i + span]) + span - 1
            parts.append(name.center(w) if name else " " * w)
            i += span
        lines.append("#" + " ".join(parts).rstrip())
    lines.append("#" + " ".join(c.head.rjust(w) for c, w in zip(cols, widths)))
    lines.append("#" + " ".join(c.unit.rjust(w) for c, w in zip(cols, widths)).rstrip())
    for r in rows:
        line = " " + " ".join(_cell(r.get(c.key), c).rjust(w) for c, w in zip(cols, widths))
        lines.append(line + (f"   {r['_note']}" if r.get("_note") else ""))
    lines.extend(f"# {f}" for f in footer)
    return "\n".join(lines)


DEFAULT_WIDTH = 120


def fit_width(text: str, width: int = DEFAULT_WIDTH) -> str:
    """Every line of a table within `width` characters: '#' comment lines wrap (continued with
    '#   '), a data row's trailing note is cut with '...'."""
    import textwrap

    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
        elif line.startswith("#"):
            body = line[1:].strip()
            out.extend(textwrap.wrap(body, width - 2, initial_indent="# ",
                                     subsequent_indent="#   ", break_on_hyphens=False)
                       or ["#"])
        else:
            out.append(line[: width - 3] + "...")
    return "\n".join(out)


def fmt_time(t: float | None, noise: float | None = None) -> str:
    """A measured time with its spread: '294.6 ±12.3', '2472 ±120'; 'N/A' when missing."""
    if t is None or not math.isfinite(t):
        return "N/A"
    d = 0 if t >= 1000 else 1
    if noise is None or not math.isfinite(noise) or noise <= 0:
        return f"{t:.{d}f}"
    return f"{t:.{d}f} ±{noise:.{d if noise < 1000 else 0}f}"


def fmt_speedup(peer: float | None, mine: float | None, peer_noise: float = 0.0,
                mine_noise: float = 0.0) -> tuple[str, float | None, bool]:
    """(cell, speedup, within_noise): peer/mine, or '≈1' when the two times differ by no more
    than the sum of their spreads (then the ratio is a number the noise made)."""
    if not peer or not mine or peer <= 0 or mine <= 0:
        return "N/A", None, False
    sp = peer / mine
    within = abs(peer - mine) <= (peer_noise or 0.0) + (mine_noise or 0.0)
    return ("≈1" if within else f"{sp:.2f}"), sp, within


def log_plot(ax, xs, ys, *, key: str, marker: str = "o", **kw) -> int:
    """Plot a series on a log y axis without dropping values silently: points whose value is
    missing or <= 0 are drawn as hollow 'v' markers at the axis bottom; returns how many."""
    from . import style

    st = style.series(key)
    st.update(kw)
    good = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y) and y > 0]
    bad = [x for x, y in zip(xs, ys) if not (y is not None and math.isfinite(y) and y > 0)]
    if good:
        ax.plot(*zip(*good), marker=marker, **st)
    if bad:
        lbl = f"{st['label']}: no value (≤ 0 or missing)"
        ax.plot(bad, [0] * len(bad), ls="none", marker="v", mfc="none", mec=st.get("color"),
                color=st.get("color"), label=lbl, clip_on=False,
                transform=ax.get_xaxis_transform())
    return len(bad)


# ----------------------------------------------------------------------------------------------
# Results and outputs


def environment() -> dict:
    import jax

    strata, reason = load_strata()
    env = {
        "time": _dt.datetime.now().isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "host": platform.machine(),
        "cpu_count": os.cpu_count(),
        "devices": len(jax.devices()),
        "PJRT_NPROC": os.environ.get("PJRT_NPROC"),
        "device_setup": _DEVICE_SETUP.get("device_setup"),
        "stratacl_jax": getattr(strata, "__version__", "present") if strata else None,
        "stratacl_jax_reason": reason or None,
    }
    return env


@dataclass
class Report:
    """What one subcommand produced: machine-readable rows plus the printed tables."""
    name: str
    params: dict
    rows: list[dict] = field(default_factory=list)
    tables: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    top: dict = field(default_factory=dict)  # results a benchmark puts at the JSON's top level

    def emit(self, text: str) -> None:
        """Print a table now (stdout, flushed: it interleaves with the stderr progress bar)."""
        self.tables.append(text)
        print(text, flush=True)
        print(flush=True)

    def to_json(self) -> dict:
        return {**jsonable(self.top), "benchmark": self.name, "params": jsonable(self.params), "env": self.env,
                "rows": [jsonable(r) for r in self.rows]}


def jsonable(v):
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items() if not str(k).startswith("_")}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        f = float(v)
        return None if math.isnan(f) or math.isinf(f) else f
    return v


def write_json(path: str, data) -> None:
    _mkparent(path)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def write_csv(path: str, rows: Sequence[dict]) -> None:
    _mkparent(path)
    rows = [jsonable(r) for r in rows]
    keys: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in keys and not isinstance(v, (dict, list)):
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in keys})


def _mkparent(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)


def pyplot():
    """matplotlib with the file-only Agg backend (no display on CI machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def add_timing_args(p, repeats: int = 1, repeats_help: str = "") -> None:
    p.add_argument("--repeats", type=int_at_least(1), default=repeats,
                   help=repeats_help or f"timed blocks of -n calls; the median block is "
                                        f"reported ({repeats})")
    p.add_argument("--sync-every", type=int_at_least(1), default=SYNC_EVERY,
                   help=f"block on the result every K timed calls ({SYNC_EVERY}; 1 = each)")
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="cap one measurement near this many seconds by lowering -n (0: off)")


def add_mode_impl_args(p) -> None:
    """--mode and --impl, as collectives, moe and train take them."""
    p.add_argument("--mode", default="strata",
                   type=list_arg(("strata", "buffer_centric"), "--mode"),
                   help="strata, buffer_centric, or all")
    p.add_argument("--impl", default="all", type=list_arg(("strata", "lax"), "--impl"),
                   help="strata, lax, or all")


def add_output_args(p) -> None:
    p.add_argument("--out", metavar="DIR", help="write <name>.json, .csv, .png into DIR")
    p.add_argument("--json", metavar="PATH", help="write all rows and the environment as JSON")
    p.add_argument("--csv", metavar="PATH", help="write all rows as CSV")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def write_outputs(report: Report, args, plot_fn: Callable[[Report, str], None] | None) -> list[str]:
    """Honour --out/--json/--csv/--plot; returns the paths written."""
    paths = {"json": args.json, "csv": args.csv, "plot": args.plot}
    if args.out:
        for kind, ext in (("json", "json"), ("csv", "csv"), ("plot", "png")):
            paths[kind] = paths[kind] or os.path.join(args.out, f"{report.name}.{ext}")
    written = []
    if paths["json"]:
        write_json(paths["json"], report.to_json())
        written.append(paths["json"])
    if paths["csv"]:
        write_csv(paths["csv"], report.rows)
        written.append(paths["csv"])
    if paths["plot"] and plot_fn is not None:
        try:
            plot_fn(report, paths["plot"])
            if os.path.exists(paths["plot"]):  # some reports have no plot (--processes)
                written.append(paths["plot"])
        except Exception as e:  # a plot must never cost the measurements
            print(f"# warning: plot failed: {one_line(e)}", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
    return written


def progress(items: Iterable, *, total: int | None = None, desc: str = "", disable: bool = False):
    """tqdm on stderr; off when stderr is not a terminal (disable=None) or when asked."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, total=total, desc=desc, file=sys.stderr, disable=True if disable else None,
                leave=False, dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------
# Collectives backends: one program, two sets of collectives (MoE reference, training step)


class LaxCollectives:
    """jax.lax's own collectives, spelled like strata's."""

    name = "lax"

    def all_reduce(self, x, axis_name):
        from jax import lax

        return lax.psum(x, axis_name)

    def all_gather(self, x, axis_name, *, axis=0, tiled=False):
        from jax import lax

        return lax.all_gather(x, axis_name, axis=axis, tiled=tiled)

    def all_to_all(self, x, axis_name, split_axis, concat_axis, *, tiled=False):
        from jax import lax

        return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)


class StrataCollectives:
    """stratacl_jax's collectives (mode as in force when the program is traced)."""

    name = "strata"

    def __init__(self, strata):
        if strata is None:
            raise Skip(load_strata()[1])
        missing = [f for f in ("all_reduce", "all_gather", "all_to_all") if not hasattr(strata, f)]
        if missing:
            raise Skip(f"stratacl_jax lacks {', '.join(missing)}")
        self.strata = strata

    def all_reduce(self, x, axis_name):
        return self.strata.all_reduce(x, axis_name)

    def all_gather(self, x, axis_name, *, axis=0, tiled=False):
        return self.strata.all_gather(x, axis_name, axis=axis, tiled=tiled)

    def all_to_all(self, x, axis_name, split_axis, concat_axis, *, tiled=False):
        return self.strata.all_to_all(x, axis_name, split_axis, concat_axis, tiled=tiled)
