"""Issue 27: why the data-parallel step as users write it (strata averages the loss, XLA's own
all-reduce, inserted by autodiff, reduces the gradients) is slower than the all-lax step.

Variants of benchmarks/lax_routing.py's step, timed in blocks of --block calls, the order rotating
every round; a variant's ratio is the median over rounds of (its block / lax's block in the same
round), with a bootstrap 95% interval:

- lax: every collective on XLA. XLA's combiner merges the loss's all-reduce into the gradients'
  one: a single barrier.
- written: the loss on strata, the gradients on XLA: two barriers.
- lax, loss on its own all-reduce: the loss's reduction kept apart from the gradients' (a max,
  which the combiner does not merge with sums; the gradient passes through): two XLA barriers,
  what the written step would cost if strata's barrier were as cheap as XLA's.
- lax + unused strata: the lax step plus a strata all_reduce of the loss multiplied by 0.
- routed: the lax step traced with lax_collectives="strata": every barrier on strata.

The last column is the CPU time strata's resumer threads spend per call (/proc, Linux).

Why written costs more (found with XLA_FLAGS=--xla_dump_to, buffer-assignment.txt): XLA:CPU
assigns buffers along its sequential schedule, where strata's custom call comes before the
all-reduce, so the all-reduce's output may reuse the custom call's operand and result slots;
XLA's thunk executor then makes the all-reduce wait for the strata op (which is asynchronous) to
complete. The barriers run one after the other, and each rank's XLA all-reduce runs in the strata
op's continuation, on a resumer thread woken for it (a rank blocked in XLA's rendezvous needs a
thread of its own). Run: python scripts/ab_mixed_sync_points.py [--rounds 150 --block 3]."""
import argparse
import collections
import os
import time

import stratacl_jax as strata

strata.emulator.ensure_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from benchmarks.lax_routing import Lax, Strata, compile_variant, dp_step  # noqa: E402


@jax.custom_vjp
def _loss_max(x):
    return lax.pmax(x, "x")


_loss_max.defvjp(lambda x: (lax.pmax(x, "x"), None), lambda _, g: (lax.pcast(g, "x", to="varying"),))


class LaxLossApart(Lax):
    pmean = staticmethod(lambda x, a: _loss_max(x))


class LaxPlusUnusedStrata(Lax):
    pmean = staticmethod(lambda x, a: lax.pmean(x, a) + 0 * strata.all_reduce(x, a))


def resumer_cpu_seconds() -> float:
    """CPU time of this process's strata-resume threads so far (threads that exited are lost)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "strata-resume":
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--block", type=int, default=3, help="calls per timed block")
    args = ap.parse_args(argv)
    mesh = strata.emulator.make_mesh((8,), ("x",))
    variants = {"lax": compile_variant(dp_step, mesh, Lax, False),
                "written": compile_variant(dp_step, mesh, Strata, False),
                "lax, loss on its own all-reduce": compile_variant(dp_step, mesh, LaxLossApart, False),
                "lax + unused strata": compile_variant(dp_step, mesh, LaxPlusUnusedStrata, False),
                "routed": compile_variant(dp_step, mesh, Lax, True)}
    names = list(variants)
    for compiled, call_args, _ in variants.values():
        for _ in range(5):
            jax.block_until_ready(compiled(*call_args))
    times, cpu = collections.defaultdict(list), collections.defaultdict(float)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            compiled, call_args, _ = variants[name]
            c0, t0 = resumer_cpu_seconds(), time.perf_counter()
            for _ in range(args.block):
                jax.block_until_ready(compiled(*call_args))
            times[name].append((time.perf_counter() - t0) / args.block)
            cpu[name] += resumer_cpu_seconds() - c0
    rng = np.random.default_rng(0)
    calls = args.rounds * args.block
    print(f"# {args.rounds} rounds x {args.block} calls per variant, order rotating; 8 emulated NPUs; "
          f"jax {jax.__version__}")
    print("| variant | median (µs) | / lax, median of rounds | 95% interval | XLA collectives left "
          "| strata-resume CPU per call (µs) |")
    print("|---|---:|---:|---|---|---:|")
    for name in names:
        ratio = np.array(times[name]) / np.array(times["lax"])
        boot = np.median(rng.choice(ratio, (2000, len(ratio))), axis=1)
        left = ", ".join(variants[name][2]) or "none"
        print(f"| {name} | {np.median(times[name]) * 1e6:,.0f} | {np.median(ratio):.3f} "
              f"| {np.percentile(boot, 2.5):.3f}-{np.percentile(boot, 97.5):.3f} | {left} "
              f"| {cpu[name] / calls * 1e6:,.0f} |")


if __name__ == "__main__":
    main()
