# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Round-to-dtype helper shared by the elementwise Triton kernels.

Invariants: ``round_to(x, dt)`` returns, in float32, the value torch gets by casting float32 x to dt (round to
nearest, ties to even). For bfloat16 the rounding is done on the float32 bit pattern (add 0x7FFF plus the lowest
kept bit, clear the low 16 bits), because the Triton interpreter's float32->bfloat16 cast truncates while the GPU
rounds; the bit form is exact on both, so the later narrowing store is exact. Inputs are finite (no NaN handling).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dt: tl.constexpr):
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)
