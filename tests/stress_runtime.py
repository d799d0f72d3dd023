"""Back-to-back multi-device executions must never hang XLA:CPU.

Runs N executions of a jitted shard_map program on 8 emulated NPUs, chained
(x = f(x)) and independent (no blocking), with strata collectives and with
jax.lax.psum after `import stratacl_jax`; with --threads T, T Python threads
each dispatch N independent calls without waiting, then wait for them all.
Each run is a fresh process. Usage:

    python tests/stress_runtime.py --iterations 600 --runs 5
    python tests/stress_runtime.py --threads 2 --iterations 200 --runs 5
"""
import argparse
import os
import subprocess
import sys
import time


def one_run(iterations: int, impl: str, threads: int = 0) -> None:
    import stratacl_jax as strata

    strata.emulator.ensure_devices(8)
    if os.environ.get("STRATA_STRESS_TIMEOUT_S"):
        strata.config(timeout_s=float(os.environ["STRATA_STRESS_TIMEOUT_S"]))
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = strata.emulator.make_mesh((8,), ("x",))
    op = strata.all_reduce if impl == "strata" else lax.psum
    f = jax.jit(jax.shard_map(lambda v: op(v, "x") * 0.125, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x0 = jax.device_put(np.arange(8 * 256, dtype=np.float32), NamedSharding(mesh, P("x")))
    expect = np.asarray(x0).reshape(8, -1).sum(0) * 0.125
    if threads:
        import threading

        f(x0).block_until_ready()  # compiled once, before the threads race
        results, errors = [None] * threads, []

        def launch(t):
            try:
                results[t] = [f(x0) for _ in range(iterations)]  # nothing waits
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        workers = [threading.Thread(target=launch, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        jax.block_until_ready(results)
        for outs in results:
            assert np.allclose(np.asarray(outs[-1]).reshape(8, -1)[3], expect)
        return
    x = x0
    for _ in range(iterations):  # chained
        x = f(x)
    outs = [f(x0) for _ in range(iterations)]  # independent, nothing blocks
    jax.block_until_ready((x, outs))
    assert np.allclose(np.asarray(outs[-1]).reshape(8, -1)[3], expect)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=600)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--impl", choices=["strata", "lax", "both"], default="both")
    p.add_argument("--threads", type=int, default=0, help="launching threads (0: chained + independent in one)")
    p.add_argument("--nproc", type=int, default=0, help="set PJRT_NPROC in the runs (default: what strata sizes)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        one_run(args.iterations, args.impl, args.threads)
        return 0
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    if args.nproc:
        env["PJRT_NPROC"] = str(args.nproc)
    failures = 0
    impls = ["strata", "lax"] if args.impl == "both" else [args.impl]
    for impl in impls:
        for run in range(args.runs):
            start = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, __file__, "--child", "--impl", impl,
                                       "--iterations", str(args.iterations), "--threads", str(args.threads)],
                                      env=env,
                                      timeout=args.timeout, capture_output=True, text=True)
                ok = proc.returncode == 0
                detail = proc.stderr.strip().splitlines()[-1:] if not ok else ""
            except subprocess.TimeoutExpired:
                ok, detail = False, f"hung (> {args.timeout} s)"
            failures += not ok
            print(f"{impl} run {run + 1}/{args.runs}: {'ok' if ok else 'FAILED'} "
                  f"({time.perf_counter() - start:.1f} s) {detail or ''}", flush=True)
    print(f"{len(impls) * args.runs - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
