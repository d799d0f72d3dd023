"""One process of a multi-process run (tests/test_multiprocess.py starts N of
them on localhost). argv[1]: JSON with process_id, num_processes, port,
n_local, mode ("cases", "kill", "stall"), meshes, out (a directory)."""
import json
import os
import pickle
import signal
import sys
import time
import traceback

cfg = json.loads(sys.argv[1])
pid, nproc = cfg["process_id"], cfg["num_processes"]

import stratacl_jax as strata  # noqa: E402

strata.emulator.ensure_devices(cfg["n_local"])

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)
t0 = time.time()
jax.distributed.initialize(f"127.0.0.1:{cfg['port']}", nproc, pid, initialization_timeout=30,
                           heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)
print(f"[{pid}] initialized in {time.time() - t0:.1f} s", flush=True)

from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import mp_cases  # noqa: E402


def place(a, sharding):
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def run_cases():
    for shape, names, per_set, sets in cfg["meshes"]:
        shape, names = tuple(shape), tuple(names)
        mesh = strata.emulator.make_mesh(shape, names)
        results, errors = {}, {}
        only = cfg.get("only")
        t = time.time()
        for case in mp_cases.cases(shape, names, per_set, sets):
            if only and not any(o in case.name for o in only):
                continue
            try:
                out = jax.tree.leaves(mp_cases.run(mesh, case, place))
                results[case.name] = [np.asarray(multihost_utils.process_allgather(o, tiled=True)) for o in out]
            except Exception as e:  # reported, and the next case still runs
                errors[case.name] = "".join(traceback.format_exception_only(type(e), e))[-3000:]
        print(f"[{pid}] mesh {shape} {names}: {len(results)} cases, {len(errors)} errors, "
              f"{time.time() - t:.1f} s", flush=True)
        if pid == 0:
            with open(os.path.join(cfg["out"], f"{'x'.join(map(str, shape))}-{'-'.join(names)}.pkl"), "wb") as f:
                pickle.dump({"results": results, "errors": errors}, f)


def run_failure(mode):
    mesh = strata.emulator.make_mesh((nproc, cfg["n_local"]), ("proc", "npu"))
    spec = P(("proc", "npu"))
    f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "proc"), mesh=mesh, in_specs=spec,
                              out_specs=spec))
    x = place(np.arange(nproc * cfg["n_local"] * 4, dtype=np.float32).reshape(-1, 4), NamedSharding(mesh, spec))
    f(x).block_until_ready()  # every process meets once
    # A barrier of the coordination service, not of XLA: sync_global_devices
    # is itself a cross-process XLA collective, which returns once this
    # process's first shard is in; process 1 could stop (SIGSTOP) with its
    # other device's gloo sends still pending, and process 0 then hung in
    # that gather (strata's watch begins at the next program) until JAX's
    # heartbeat abort (1 run in 4 of the "pause" case).
    from jax._src import distributed
    distributed.global_state.client.wait_at_barrier("strata_test_warm", 30_000)
    print(f"[{pid}] warm", flush=True)
    if pid == nproc - 1:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # a crash: no clean-up, no goodbye
        if mode == "pause":
            os.kill(os.getpid(), signal.SIGSTOP)  # alive, but neither heartbeats nor joins
        time.sleep(120)  # stall: alive, heartbeating, never joins
        os._exit(0)
    time.sleep(0.5)
    print(f"[{pid}] waiting at {time.time():.3f}", flush=True)
    with strata.config(timeout_s=cfg.get("timeout_s", 60.0)):
        g = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "proc") * 2, mesh=mesh, in_specs=spec,
                                  out_specs=spec))
        try:
            g(x).block_until_ready()
        except Exception as e:
            from stratacl_jax import _core
            print(f"[{pid}] raised at {time.time():.3f}: {type(e).__name__}: {str(e)[:800]}; in flight: "
                  f"{_core.xproc_inflight()}", flush=True)
            raise
    print(f"[{pid}] the op completed without its peer?!", flush=True)
    os._exit(3)


def run_trace():
    """A traced op over the local axis: its ranks are named by process."""
    mesh = strata.emulator.make_mesh((nproc, cfg["n_local"]), ("proc", "npu"))
    spec = P(("proc", "npu"))
    f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "npu"), mesh=mesh, in_specs=spec, out_specs=spec))
    x = place(np.ones((nproc * cfg["n_local"], 4), np.float32), NamedSharding(mesh, spec))
    f(x).block_until_ready()
    # Site ids do not depend on what else a process traced, or in which order.
    if pid == 1:
        jax.jit(jax.shard_map(lambda v: strata.all_gather(strata.all_reduce(v, "npu"), "proc", tiled=True),
                              mesh=mesh, in_specs=spec, out_specs=spec)).lower(x)
    h = jax.jit(jax.shard_map(lambda v: strata.reduce_scatter(strata.all_reduce(v * 2, ("npu", "proc")), "npu", scatter_dimension=1,
                                                              tiled=True), mesh=mesh, in_specs=spec, out_specs=spec))
    import re
    sites = re.findall(r"site_id = (\d+)", h.lower(x).as_text())
    print(f"[{pid}] site ids {sites}", flush=True)
    with strata.emulator.trace(os.path.join(cfg["out"], f"trace{pid}.json")) as tr:
        f(x).block_until_ready()
    print(f"[{pid}] traced {[(o.op, o.process, o.devices) for o in tr.ops]}", flush=True)


def run_diverge():
    """Process 0 sums over "proc", the others take the max: every process
    must raise naming the disagreement (it used to mix them silently), and
    run a correct program afterwards."""
    mesh = strata.emulator.make_mesh((nproc, cfg["n_local"]), ("proc", "npu"))
    spec = P(("proc", "npu"))
    x = place(np.arange(nproc * cfg["n_local"] * 4, dtype=np.float32).reshape(-1, 4), NamedSharding(mesh, spec))
    op = "sum" if pid == 0 else "max"
    f = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "proc", op=op), mesh=mesh, in_specs=spec,
                              out_specs=spec))
    try:
        f(x).block_until_ready()
        print(f"[{pid}] diverged silently", flush=True)
    except Exception as e:
        print(f"[{pid}] raised: {str(e)[:1500]}", flush=True)
    g = jax.jit(jax.shard_map(lambda v: strata.all_reduce(v, "proc"), mesh=mesh, in_specs=spec, out_specs=spec))
    got = np.asarray(multihost_utils.process_allgather(g(x), tiled=True))
    want = np.asarray(np.arange(nproc * cfg["n_local"] * 4, dtype=np.float32).reshape(nproc, cfg["n_local"], 4)
                      .sum(0))
    print(f"[{pid}] recovered {bool(np.allclose(got.reshape(nproc, cfg['n_local'], 4)[0], want))}", flush=True)
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


if cfg["mode"] == "diverge":
    run_diverge()
elif cfg["mode"] == "cases":
    run_cases()
    run_trace()
    multihost_utils.sync_global_devices("done")
    print(f"[{pid}] done", flush=True)
    jax.distributed.shutdown()
else:
    run_failure(cfg["mode"])
