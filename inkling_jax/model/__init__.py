"""Pure model functions over a params pytree."""

from .forward import forward, forward_hidden, mtp_forward
from .params import cast_params, check_params, init_params, param_shapes

__all__ = ["forward", "forward_hidden", "mtp_forward", "init_params", "param_shapes", "check_params", "cast_params"]
