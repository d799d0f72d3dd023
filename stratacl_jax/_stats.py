"""Counters from the C++ runtime."""
from __future__ import annotations

from . import _core


def stats() -> dict:
    """bytes_direct, bytes_staged, registrations, registry hits/misses,
    core_bytes[npu][core] and sdma_bytes[npu][engine], among others."""
    return dict(_core.stats())


def reset_stats() -> None:
    _core.reset_stats()
