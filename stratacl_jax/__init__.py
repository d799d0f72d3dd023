"""stratacl_jax: fabric-native collectives for JAX on an emulated NPU supernode.

    import stratacl_jax as strata
    y = strata.all_reduce(x, "npu")   # inside jax.shard_map, under jax.jit
"""
from . import _runtime_setup

# Before anything can start JAX's CPU backend: size its thread pool so
# multi-device programs cannot deadlock XLA:CPU (FACTS.md §1b).
_runtime_setup.install()

from . import _lifecycle  # noqa: E402

# Exit and Ctrl-C abort ops still waiting for peers instead of waiting them out.
_lifecycle.install()

from . import emulator  # noqa: E402
from . import memory  # noqa: E402
from . import moe  # noqa: E402
from ._stats import reset_stats, stats  # noqa: E402
from .all_gather import all_gather  # noqa: E402
from .all_reduce import all_reduce  # noqa: E402
from .all_to_all import all_to_all  # noqa: E402
from .broadcast import broadcast  # noqa: E402
from .ppermute import ppermute  # noqa: E402
from .ragged_all_to_all import ragged_all_to_all  # noqa: E402
from .reduce_scatter import reduce_scatter  # noqa: E402
from . import _lax_routing  # noqa: E402

# strata.config(lax_collectives="strata") routes jax.lax's collectives here
# (strata.config is _config.config that also tells jax's trace caches).
_lax_routing.install()
config = _lax_routing.config

__version__ = "0.1.0"

__all__ = [
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ppermute", "ragged_all_to_all",
    "config", "stats", "reset_stats", "emulator", "memory", "moe",
]
