"""One look for every benchmark's output: series colours and labels, size labels on axes, and
numbers that say when they are noise.

Every plot takes its colours and legend labels from SERIES, so lax is the same grey and strata
the same blue everywhere; every size axis reads 4K ... 4M, not 2^12 ... 2^22.
"""

from __future__ import annotations

import math
from typing import Sequence

# key -> (legend label, matplotlib colour). Keys are the rows' `impl` / `mode` values.
SERIES: dict[str, tuple[str, str]] = {
    "lax": ("lax (XLA)", "tab:gray"),
    "strata": ("strata", "tab:blue"),
    "buffer_centric": ("strata, buffer_centric mode", "tab:orange"),
    "strata+arena": ("strata, arena inputs", "tab:cyan"),
    "floor": ("floor (lower bound)", "black"),
    "reference": ("memory reference", "black"),
    "modeled": ("modeled on CloudMatrix384", "tab:purple"),
    "modeled_buffer_centric": ("modeled, buffer_centric", "tab:red"),
}


def series(key: str) -> dict:
    """`plot(..., **series("lax"))`: the label and colour of one series."""
    label, colour = SERIES.get(key, (key, None))
    return {"label": label, "color": colour}


def size_label(nbytes: float) -> str:
    """4096 -> '4K', 1572864 -> '1.5M', 100 -> '100' (binary units, as nccl-tests)."""
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= mult:
            v = nbytes / mult
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{nbytes:.0f}"


def size_axis(ax, sizes: Sequence[float], label: str = "bytes per rank") -> None:
    """A log2 x axis whose ticks are the measured sizes, labelled 4K, 16K, ..."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    if len(ticks) > 8:  # keep the labels apart
        step = math.ceil(len(ticks) / 8)
        ticks = ticks[::step]
    ax.set_xticks(ticks)
    ax.set_xticklabels([size_label(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(label)


def spread(samples: Sequence[float]) -> float:
    """Half the range of repeated measurements: the noise a single value carries. 0 with one."""
    vals = [v for v in samples if v is not None and math.isfinite(v)]
    return (max(vals) - min(vals)) / 2 if len(vals) > 1 else 0.0


def noisy_value(value: float | None, noise: float, unit: str = "us", digits: int = 1) -> str:
    """A measured value (often a difference of two timings) with its noise: '12.3 ±0.8 us', or
    '< noise (±8.0 us)' when the value is within the noise or negative. Never a negative number."""
    if value is None or not math.isfinite(value):
        return "n/a"
    noise = max(0.0, noise)
    if value <= noise:
        return f"< noise (±{noise:.{digits}f} {unit})"
    return f"{value:.{digits}f} ±{noise:.{digits}f} {unit}" if noise > 0 else f"{value:.{digits}f} {unit}"


def within_noise(value: float | None, noise: float) -> bool:
    return value is None or not math.isfinite(value) or value <= max(0.0, noise)
