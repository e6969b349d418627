"""Helpers shared by the Pallas kernels (Triton lowering on GPU, `interpret=True` on CPU), their
jnp references and the library (`inkling_jax` imports this module; it imports nothing of it):

    pow2_ceil(n), pow2_floor(n), pow2_factor(n)   powers of two around n
    rms_norm(x, weight, eps)    the model's RMSNorm (the one copy: the layers, the references
                                and the kernels' interpret-mode bodies all call it)
    matmul(x, w)                x @ w with fp32 accumulation and result (the model's products;
                                a lone row padded to two on GPU backends: PAD_LONE_ROW)
    with_ref_vjp, pallas_call, compiler_params   kernel plumbing
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

INT32_MAX = 2**31 - 1

# MLIR's Python bindings look for a dialect's Python module under each of their search
# prefixes whenever an operation of that dialect is created, and remember only a module they
# found. jaxlib has none for Triton's "tt" dialect under the first prefix, so every Triton op
# the Pallas lowering builds tried three failing imports (jaxlib.mlir.dialects.tt,
# jaxlib.mosaic.python.tt, jax.jaxlib.mosaic.python.tt): 5459 of each for one bench-model
# extend step, about half of its lowering time (jax 0.10.2, this CPU host). An empty module
# under the first name ends the search at once; the op classes are registered by jaxlib's
# own Triton module either way, so the lowered program is the same (its text compared equal).
_TRITON_DIALECT_MODULE = "jaxlib.mlir.dialects.tt"


def _remember_missing_triton_dialect_module() -> None:
    if _TRITON_DIALECT_MODULE in sys.modules:
        return
    try:
        if importlib.util.find_spec(_TRITON_DIALECT_MODULE) is not None:
            return  # a jaxlib that has the module: nothing to do
    except ImportError:
        return
    sys.modules[_TRITON_DIALECT_MODULE] = types.ModuleType(
        _TRITON_DIALECT_MODULE, "placeholder (pallas_kernels._common): jaxlib has no such module")


_remember_missing_triton_dialect_module()


def pow2_factor(n: int) -> int:
    """The largest power of two dividing n (n > 0)."""
    return n & -n


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def pow2_ceil(n: float) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(math.ceil(n) - 1, 0).bit_length()


@jax.named_scope("norm")
def rms_norm(x: Float[Array, "... d"], weight: Float[Array, " d"], eps: float) -> Float[Array, "... d"]:
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype: the
    normalised value rounded to x's dtype, then times the weight (rounded to x's dtype) in x's
    dtype (the kernels that fuse a norm compute exactly this on their tiles)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(x.dtype) * xf.astype(x.dtype)).astype(x.dtype)


# Pad a lone token row to two before a weight product. XLA's GPU compiler rewrites a
# vector x matrix product below ~1e7 multiply-adds into multiply + reduce fusions, which read
# the weight at a quarter of the bandwidth a GEMM reaches (and, for per-expert slices, even
# materialise the f32 products): 1-token decode spent most of its time there. With two rows
# the product stays a GEMM. None: pad on GPU backends only (the CPU has no such rewrite).
PAD_LONE_ROW: bool | None = None


def pad_lone_row() -> bool:
    return jax.default_backend() == "gpu" if PAD_LONE_ROW is None else PAD_LONE_ROW


def matmul(x: Float[Array, "... i"], w: Float[Array, "i o"]) -> Float[Array, "... o"]:
    """x @ w in x's dtype with fp32 accumulation and an fp32 result (a single row of x is
    padded to two where PAD_LONE_ROW says, see above)."""
    w = w.astype(x.dtype)
    if w.ndim == 2 and math.prod(x.shape[:-1]) == 1 and pad_lone_row():
        x2 = jnp.pad(x.reshape(1, -1), ((0, 1), (0, 0)))
        y = jnp.matmul(x2, w, preferred_element_type=jnp.float32)[:1]
        return y.reshape(*x.shape[:-1], w.shape[-1])
    return jnp.matmul(x, w, preferred_element_type=jnp.float32)


def compiler_params(interpret: bool, num_warps: int, num_stages: int = 1):
    """Triton compiler parameters (None in interpret mode, where they would be ignored).
    num_stages > 1 software-pipelines the loads of a kernel's loops (GEMM-like kernels)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pallas_call(kernel, *, out_shape, grid, aliases, interpret: bool, num_warps: int, name: str,
                num_stages: int = 1):
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases,
                          interpret=interpret, compiler_params=compiler_params(interpret, num_warps, num_stages),
                          name=name)


def with_ref_vjp(kernel_fn, ref_fn):
    """kernel_fn in the forward pass, the reference's VJP in the backward pass."""

    @jax.custom_vjp
    def fn(*args):
        return kernel_fn(*args)

    def fwd(*args):
        return kernel_fn(*args), args

    def bwd(res, cot):
        _, vjp = jax.vjp(ref_fn, *res)
        return vjp(cot)

    fn.defvjp(fwd, bwd)
    return fn
