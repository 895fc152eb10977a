"""Small, named compatibility shims between haliax and the JAX versions we support (0.6 to 0.11)."""

import operator
import warnings

import jax


def _is_constant_dim(d) -> bool:
    # Same contract as the removed jax.core.is_constant_dim: a dimension is constant if it is an integer.
    try:
        operator.index(d)
        return True
    except TypeError:
        return False


def install_jax_core_is_constant_dim(core=jax.core) -> bool:
    """haliax 1.4.dev453 calls jax.core.is_constant_dim, which JAX 0.11 removed. Returns True if installed."""
    with warnings.catch_warnings():  # JAX 0.10 still has it, behind a DeprecationWarning
        warnings.simplefilter("ignore")
        if getattr(core, "is_constant_dim", None) is not None:
            return False
    core.is_constant_dim = _is_constant_dim
    return True


install_jax_core_is_constant_dim()
