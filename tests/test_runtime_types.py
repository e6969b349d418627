"""The jaxtyping import hook (tests/runtime_types.py) is live: the library's annotations are
checked when the tests call it. Each case fails if the hook is not installed."""

import jax.numpy as jnp
import pytest
from jaxtyping import TypeCheckError

from runtime_types import TYPECHECKED

from inkling_jax.model import layers as L

pytestmark = pytest.mark.skipif(not TYPECHECKED, reason="INKLING_TESTS_TYPECHECK=0")


def test_shape_that_contradicts_the_annotation_fails():
    # linear(x: Float[Array, "... i"], w: Float[Array, "i o"]): x's last dim is not w's first
    x, w = jnp.ones((2, 3)), jnp.ones((4, 5))
    with pytest.raises(TypeCheckError, match="linear"):
        L.linear(x, w)
    assert L.linear(x, jnp.ones((3, 5))).shape == (2, 5)  # consistent shapes pass


def test_dtype_that_contradicts_the_annotation_fails():
    with pytest.raises(TypeCheckError, match="linear"):
        L.linear(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 5)))  # Float[...] given int32


def test_plain_type_that_contradicts_the_annotation_fails():
    # log_scaling_tau(positions: Int[Array, "..."], cfg: InklingConfig): a dict is no config
    with pytest.raises(TypeCheckError, match="log_scaling_tau"):
        L.log_scaling_tau(jnp.arange(4), {"log_scaling_n_floor": 8})
