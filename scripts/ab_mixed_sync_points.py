"""Issue 27's open part: why one mixed program (strata ops beside XLA's own collectives) is slower
than all-lax. The data-parallel step of benchmarks/lax_routing.py four ways, interleaved:

- lax: every collective on XLA;
- written: the loss's pmean on strata, autodiff's gradient all-reduce on XLA;
- lax + unused strata: the lax step plus one strata all_reduce of the loss whose result is
  multiplied by 0 (a strata sync point forward and its transpose backward, nothing else);
- routed: the lax step traced with lax_collectives="strata".

Run: python scripts/ab_mixed_sync_points.py [--repeats 40]. On 2 cores, two runs (2026-12-04):
written 1.11x / 1.05x, lax + unused strata 1.19x / 1.13x, routed 1.05x / 0.89x lax: some 200-300
us per strata sync point that has compute after it, against ~20 us per op in back-to-back chains."""
import argparse

import stratacl_jax as strata

strata.emulator.ensure_devices(8)

from jax import lax  # noqa: E402

from benchmarks.lax_routing import Lax, Strata, compile_variant, dp_step, time_interleaved  # noqa: E402


class LaxPlusUnusedStrata(Lax):
    pmean = staticmethod(lambda x, a: lax.pmean(x, a) + 0 * strata.all_reduce(x, a))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args(argv)
    mesh = strata.emulator.make_mesh((8,), ("x",))
    variants = {"lax": compile_variant(dp_step, mesh, Lax, False),
                "written": compile_variant(dp_step, mesh, Strata, False),
                "lax + unused strata": compile_variant(dp_step, mesh, LaxPlusUnusedStrata, False),
                "routed": compile_variant(dp_step, mesh, Lax, True)}
    r = time_interleaved(variants, args.repeats)
    base = r["lax"][0]
    for name, (us, blocked) in r.items():
        print(f"{name:22s} {us:8.0f} us  {us / base:.2f}x lax  resumers blocked per call {blocked:.1f}")


if __name__ == "__main__":
    main()
