"""The exact functions that stand in for mamba_ssm's Mamba-3 PTX approximations in Triton's
interpreter (tests/triton_kernels.py, mamba3_kernels_on). Triton's interpreter needs
triton.language among a jit function's module globals, hence a module of their own, imported
only inside mamba3_kernels_on (after tests/conftest.py has set TRITON_INTERPRET)."""

import triton
import triton.language as tl


@triton.jit
def cos_approx(x):
    return tl.cos(x)


@triton.jit
def sin_approx(x):
    return tl.sin(x)


@triton.jit
def tanh_approx(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def sech2_approx(x):
    t = tanh_approx(x)
    return 1.0 - t * t
