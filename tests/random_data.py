"""Random test data, shared by the pytest suite (conftest) and the multi-process workers
(which must not import conftest: it starts JAX with 8 devices)."""
import jax.numpy as jnp
import numpy as np


def random_array(rng, shape, dtype):
    """Random values of `dtype`: normal floats, integers in [-100, 100] (clipped to the
    type), fair bools; never all zeros or ones."""
    dtype = jnp.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        lo, hi = max(info.min, -100), min(info.max, 100)
        return rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)
