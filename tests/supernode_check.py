"""Every strata collective on a whole emulated CloudMatrix384 (384 NPUs), small
sizes, checked against numpy. Run as a script in its own process (the device
count is fixed when JAX starts):  python tests/supernode_check.py [--npus 384]"""
import argparse
import sys

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--npus", type=int, default=384)
    args = p.parse_args()
    n = args.npus

    import stratacl_jax as strata

    strata.emulator.ensure_devices(n)
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = strata.emulator.make_mesh((n // 8, 8), ("node", "npu"))
    axes = ("node", "npu")
    rng = np.random.default_rng(0)
    x = rng.integers(-50, 50, size=(n * n, 3)).astype(np.int32)  # n rows per rank
    xs = jax.device_put(x, NamedSharding(mesh, P(axes)))
    blocks = x.reshape(n, n, 3)
    shift = [(i, (i + 1) % n) for i in range(n)]

    def run(fn):
        return np.asarray(jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))(xs))

    checks = {
        "all_reduce": (lambda v: strata.all_reduce(v, axes), np.tile(blocks.sum(0), (n, 1))),
        "all_gather": (lambda v: strata.all_gather(v[:1], axes, tiled=True), np.tile(blocks[:, 0], (n, 1))),
        "reduce_scatter": (lambda v: strata.reduce_scatter(v, axes, tiled=True), blocks.sum(0)),
        "all_to_all": (lambda v: strata.all_to_all(v, axes, 0, 0, tiled=True),
                       blocks.transpose(1, 0, 2).reshape(n * n, 3)),
        "broadcast": (lambda v: strata.broadcast(v, axes, root=n - 1), np.tile(blocks[n - 1], (n, 1))),
        "ppermute": (lambda v: strata.ppermute(v, axes, shift), np.roll(blocks, 1, axis=0).reshape(n * n, 3)),
        "all_reduce npu": (lambda v: strata.all_reduce(v, "npu"),
                           np.repeat(blocks.reshape(n // 8, 8, n, 3).sum(1), 8, axis=0).reshape(n * n, 3)),
    }
    failures = 0
    for name, (fn, want) in checks.items():
        got = run(fn)
        ok = got.shape == want.shape and np.array_equal(got, want)
        failures += not ok
        print(f"{name}: {'ok' if ok else 'WRONG'}", flush=True)
    print(f"{len(checks) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
