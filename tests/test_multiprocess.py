"""strata on meshes that span processes (jax.distributed, gloo between them).

A fixture starts N worker processes on localhost (tests/mp_worker.py: a free
port, short init and heartbeat timeouts, a wall bound per launch); each runs
every case of tests/mp_cases.py on a mesh over all processes' devices and
process 0 saves the global results. Here, in one process, the same cases run
on a mesh of the same shape, and both are checked against numpy. A killed or
stalled peer must end the waiting process within a bound, with an error that
names the op and the missing process.
"""
import json
import os
import pickle
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import P  # noqa: F401  (conftest sets up 8 devices and x64)

import stratacl_jax as strata

sys.path.insert(0, os.path.dirname(__file__))
import mp_cases  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("STRATA_SANITIZER"):
    pytest.skip("multi-process tests start fresh jax processes and exercise jax.distributed/gloo plumbing "
                "(XLA, not instrumented); the strata code they reach is the single-process runtime the "
                "sanitized suite already covers", allow_module_level=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc, n_local, mode, out, *, meshes=(), bound_s=150.0, env=None, kill_after_first=False, **extra):
    """Starts the workers; returns [(returncode, stdout, stderr, seconds)],
    killing every worker that outlives `bound_s` (or process 0, with
    kill_after_first)."""
    port = free_port()
    child_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
                     PYTHONUNBUFFERED="1", **(env or {}))
    child_env.pop("XLA_FLAGS", None)
    procs, start = [], time.monotonic()
    for pid in range(nproc):
        cfg = dict(process_id=pid, num_processes=nproc, port=port, n_local=n_local, mode=mode,
                   meshes=[list(m) for m in meshes], out=str(out), **extra)
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "mp_worker.py"), json.dumps(cfg)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env))
    results = [None] * nproc
    deadline = start + bound_s
    for i, p in enumerate(procs):
        try:
            so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results[i] = (p.returncode, so, se, time.monotonic() - start)
            if i == 0 and kill_after_first:
                for q in procs[1:]:
                    if q.poll() is None:
                        q.kill()
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            so, se = p.communicate()
            results[i] = (None, so, se, time.monotonic() - start)
    return results


def _assert_close(got, want, name, dtype):
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    if np.issubdtype(got.dtype, np.inexact) or got.dtype == jnp.bfloat16:
        eps = {2: 2e-2, 4: 1e-5, 8: 1e-12}[np.dtype(got.dtype).itemsize]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=eps * 8, atol=eps * 8,
                                   err_msg=name)
    else:
        np.testing.assert_array_equal(got, want, err_msg=name)


def check_mesh(saved, shape, names, per_set, sets):
    """Multi-process results vs numpy and vs the same mesh in one process."""
    results, errors = saved["results"], saved["errors"]
    assert not errors, "cases failed across processes:\n" + "\n".join(f"{k}: {v}" for k, v in errors.items())
    mesh = strata.emulator.make_mesh(shape, names)
    checked = 0
    for case in mp_cases.cases(shape, names, per_set, sets):
        assert case.name in results, f"{case.name}: no result from the processes"
        multi = results[case.name]
        single = [np.asarray(o) for o in jax.tree.leaves(mp_cases.run(mesh, case, jax.device_put))]
        assert len(multi) == len(single), case.name
        if case.ref is not None:
            for i, want in enumerate(case.ref(*case.inputs)):
                if want is not None:
                    _assert_close(multi[i], np.asarray(want).astype(multi[i].dtype), f"{case.name}[{i}] (vs numpy)",
                                  multi[i].dtype)
        for i, (m, s) in enumerate(zip(multi, single)):
            _assert_close(m, s, f"{case.name}[{i}] (vs one process)", m.dtype)
        for i in case.same_on_group:
            blocks = multi[i].reshape((int(np.prod(shape)), -1))
            for d in range(len(blocks)):
                _, members = mp_cases.members(shape, names, case.axes, d)
                assert blocks[members[0]].tobytes() == blocks[d].tobytes(), \
                    f"{case.name}[{i}]: device {d} differs from device {members[0]} of its group"
        checked += 1
    return checked


def _run_cases(tmp_path, nproc, n_local, meshes):
    res = launch(nproc, n_local, "cases", tmp_path, meshes=meshes)
    for pid, (rc, so, se, secs) in enumerate(res):
        assert rc == 0, f"process {pid} exit {rc} after {secs:.0f} s\n--- stdout\n{so[-3000:]}\n--- stderr\n{se[-6000:]}"
    # Every process named the op's call sites alike (process 1 traced another program first).
    sites = [next(line for line in so.splitlines() if "site ids" in line).split("site ids ")[1] for _, so, _, _ in res]
    assert len(set(sites)) == 1 and sites[0] != "[]", sites
    total = 0
    for shape, names, per_set, sets in meshes:
        with open(tmp_path / f"{'x'.join(map(str, shape))}-{'-'.join(names)}.pkl", "rb") as f:
            total += check_mesh(pickle.load(f), shape, names, per_set, sets)
    return total


def test_two_processes(tmp_path):
    """2 processes x 4 devices: (proc, npu) with every op over proc, npu,
    (proc, npu) and (npu, proc), 3 dtypes each; (proc, a, b) over two local
    axes and over all three; a 1-D mesh whose only axis straddles the
    processes. (mesh shape, axis names, dtypes per axis set, which axis sets)"""
    meshes = [((2, 4), ("proc", "npu"), 3, None), ((2, 2, 2), ("proc", "a", "b"), 2, [1, 3]),
              ((8,), ("x",), 3, None)]
    assert _run_cases(tmp_path, 2, 4, meshes) > 30
    # The supernode trace names ranks by process (process 1 holds NPUs 4-7).
    with open(tmp_path / "trace1.json") as f:
        names = [e["args"]["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "M"]
    assert any("NPU 5 (process 1, device 1)" in n for n in names), names


def test_four_processes(tmp_path):
    """4 processes x 2 devices: (proc, npu), ops over proc and (proc, npu)."""
    assert _run_cases(tmp_path, 4, 2, [((4, 2), ("proc", "npu"), 2, [0, 2])]) > 8


def _failure(tmp_path, mode, **kw):
    res = launch(2, 2, mode, tmp_path, bound_s=60.0, env={"STRATA_PEER_TIMEOUT_S": "3"}, **kw)
    rc, so, se, secs = res[0]
    waited = [float(line.split()[-1]) for line in so.splitlines() if "waiting at" in line]
    assert waited, f"process 0 never reached the op\n{so}\n{se[-4000:]}"
    return rc, se, time.time() - waited[0], so


def test_killed_peer_is_an_error_naming_the_op(tmp_path):
    rc, err, after_s, so = _failure(tmp_path, "kill")
    assert rc == 75, f"exit {rc}\n{so}\n{err[-4000:]}"
    assert "strata.all_reduce over ('proc',)" in err and "process 1" in err, err[-4000:]
    assert "process 1: ranks 1" in err and "is gone" in err, err[-4000:]
    assert after_s < 15, f"took {after_s:.1f} s to report"


def test_stalled_peer_times_out_naming_the_op(tmp_path):
    rc, err, after_s, so = _failure(tmp_path, "stall", timeout_s=3.0)
    assert rc == 75, f"exit {rc}\n{so}\n{err[-4000:]}"
    assert "strata.all_reduce over ('proc',)" in err and "did not complete it within" in err, err[-4000:]
    assert after_s < 20, f"took {after_s:.1f} s to report"


def test_paused_peer_is_named_before_jax_aborts(tmp_path):
    """A peer stopped (SIGSTOP) under jax.distributed's 10 s heartbeat, and no
    STRATA_PEER_TIMEOUT_S: JAX's coordination service used to abort process 0
    (SIGABRT) before strata's watchdog (10 s as well) named the op."""
    assert "STRATA_PEER_TIMEOUT_S" not in os.environ
    res = launch(2, 2, "pause", tmp_path, bound_s=60.0, kill_after_first=True)
    rc, so, se, _ = res[0]
    assert rc == 75, f"exit {rc}\n{so}\n{se[-4000:]}"
    assert "strata.all_reduce over ('proc',)" in se and "process 1 (no heartbeat for" in se, se[-4000:]


def test_processes_that_disagree_on_the_op_raise_and_recover(tmp_path):
    """Process 0 all_reduces with op="sum", process 1 with "max" over "proc":
    both used to exit 0 with process 1 holding the sum."""
    results = launch(2, 2, "diverge", tmp_path, bound_s=120)
    for pid, (rc, so, se, _) in enumerate(results):
        assert rc == 0, (pid, so, se[-3000:])
        raised = next((line for line in so.splitlines() if line.startswith(f"[{pid}] raised:")), None)
        assert raised is not None, (pid, so, se[-2000:])
        assert "strata.all_reduce: processes disagree on this cross-process collective" in raised, raised
        assert ("op=sum" if pid == 0 else "op=max") in raised and f"process {1 - pid} (op hash" in raised, raised
        assert f"[{pid}] recovered True" in so, so


def test_benchmark_cli_across_processes(tmp_path):
    """python -m benchmarks collectives --processes 2: the sweep across processes runs."""
    root = os.path.dirname(HERE)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PJRT_NPROC", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "collectives", "--processes", "2", "--sizes", "4K",
                           "--op", "all_reduce,all_to_all", "-n", "1", "-w", "1", "--repeats", "1", "--out",
                           str(tmp_path)], cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "2 procs x 4 strata (us)" in proc.stdout and "| all_to_all | 4096 |" in proc.stdout, proc.stdout
    rows = json.load(open(tmp_path / "collectives.json"))["rows"]
    assert len(rows) == 2 and all(r["2 procs x 4 strata"] > 0 for r in rows)
