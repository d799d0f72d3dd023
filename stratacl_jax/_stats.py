"""Counters from the C++ runtime."""
from __future__ import annotations

from . import _core
from . import _lax_routing


def stats() -> dict:
    """bytes_direct, bytes_staged, registrations, registry hits/misses,
    core_bytes[npu][core] and sdma_bytes[npu][engine], among others;
    lax_routed / lax_left_to_xla: jax.lax collectives traced under
    config(lax_collectives="strata"), by primitive, that went to strata or
    stayed on XLA (with the reason)."""
    return {**_core.stats(), **_lax_routing.counters()}


def reset_stats() -> None:
    _core.reset_stats()
    _lax_routing.reset()
