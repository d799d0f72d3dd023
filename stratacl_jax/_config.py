"""Runtime choices: global settings and a context manager to scope them.

Settings in force when an op is *traced* are baked into it (as FFI
attributes), so a jitted function keeps the mode it was traced with.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, fields, replace

MODES = ("strata", "buffer_centric")
PLANNERS = ("balanced", "naive")
LAX_COLLECTIVES = ("xla", "strata")


@dataclass(frozen=True)
class Settings:
    mode: str = "strata"
    # One die of an Ascend 910C has 48 vector (AIV) cores; a collective runs on them.
    cores_per_npu: int = 48
    # Public sources do not give the SDMA engine count per die: an assumption.
    sdma_engines_per_npu: int = 16
    # HCCL_BUFFSIZE's default: 200 MB per communication buffer, two per rank.
    comm_buffer_bytes: int = 200 * 1024 * 1024
    timeout_s: float = 60.0
    planner: str = "balanced"
    # "strata": jax.lax's own collectives traced under it lower to strata's
    # custom calls (stratacl_jax/_lax_routing.py); "xla": XLA's own.
    lax_collectives: str = "xla"

    def validated(self) -> "Settings":
        if self.mode not in MODES:
            raise ValueError(f"strata.config: mode must be one of {MODES}, got {self.mode!r}")
        if self.planner not in PLANNERS:
            raise ValueError(f"strata.config: planner must be one of {PLANNERS}, got {self.planner!r}")
        if self.lax_collectives not in LAX_COLLECTIVES:
            raise ValueError(
                f"strata.config: lax_collectives must be one of {LAX_COLLECTIVES}, got {self.lax_collectives!r}")
        for name in ("cores_per_npu", "sdma_engines_per_npu", "comm_buffer_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"strata.config: {name} must be a positive int, got {value!r}")
        if not (self.timeout_s > 0):
            raise ValueError(f"strata.config: timeout_s must be positive, got {self.timeout_s!r}")
        return self


_lock = threading.Lock()
_current = Settings()


def current() -> Settings:
    return _current


class config:
    """``strata.config(mode=..., cores_per_npu=..., ...)``.

    Called as a statement it changes the global settings; used as
    ``with strata.config(...):`` it restores the previous ones on exit.
    """

    _names = tuple(f.name for f in fields(Settings))

    def __init__(self, **changes):
        global _current
        unknown = set(changes) - set(self._names)
        if unknown:
            raise TypeError(f"strata.config: unknown setting(s) {sorted(unknown)}; known: {self._names}")
        with _lock:
            self._previous = _current
            _current = replace(_current, **changes).validated()

    def __enter__(self) -> Settings:
        return _current

    def __exit__(self, *exc) -> None:
        global _current
        with _lock:
            _current = self._previous

    def __repr__(self) -> str:
        return f"strata.config({_current})"
