"""Helpers shared by the Pallas kernels (Triton lowering on GPU, `interpret=True` on CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

INT32_MAX = 2**31 - 1


def pow2_factor(n: int) -> int:
    """The largest power of two dividing n (n > 0)."""
    return n & -n


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def compiler_params(interpret: bool, num_warps: int):
    """Triton compiler parameters (None in interpret mode, where they would be ignored)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=num_warps, num_stages=1)


def pallas_call(kernel, *, out_shape, grid, aliases, interpret: bool, num_warps: int, name: str):
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, input_output_aliases=aliases,
                          interpret=interpret, compiler_params=compiler_params(interpret, num_warps), name=name)


def _fma_f32_gpu(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """round(a * b + c), one rounding (PTX fma.rn.f32), elementwise on f32 blocks."""
    from jax.experimental.pallas import triton as plt

    (out,) = plt.elementwise_inline_asm("fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                        pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def conv_combine(x_tok: jax.Array, taps: list[jax.Array], weights: list[jax.Array], interpret: bool) -> jax.Array:
    """y = x + sum_i w[i] * tap[i] in fp32, cast to x's dtype: `conv_from_taps` for one token block.

    Bit-exactness: XLA (CPU) evaluates the reference's einsum as a forward chain of fused
    multiply-adds from zero, acc = fma(tap_i, w_i, acc). On GPU the kernel issues exactly that
    chain (`fma.rn.f32`, so it does not depend on Triton's contraction settings); in interpret
    mode it calls the reference's own einsum on the block, which XLA lowers the same way."""
    if interpret:
        from inkling_jax.model.layers import conv_from_taps

        shape = x_tok.shape
        flat = lambda a: a.reshape(-1)
        y = conv_from_taps(flat(x_tok), jnp.stack([flat(t) for t in taps]), jnp.stack([flat(w) for w in weights]))
        return y.reshape(shape)
    acc = jnp.zeros(x_tok.shape, jnp.float32)
    for tap, w in zip(taps, weights):
        acc = _fma_f32_gpu(tap.astype(jnp.float32), w.astype(jnp.float32), acc)
    return (x_tok.astype(jnp.float32) + acc).astype(x_tok.dtype)


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
