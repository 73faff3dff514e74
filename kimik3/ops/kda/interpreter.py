"""Make Triton's interpreter (TRITON_INTERPRET=1, how the tests run the kernels on a CPU) compute with bf16 as the
GPU does. A test and benchmark helper: nothing on the model's path calls it."""

from __future__ import annotations

import torch


def interpreter_bf16_fix() -> None:
    """Make the Triton interpreter compute with bf16 as the GPU does (test helper, idempotent). Triton 3.6's
    interpreter stores bf16 as uint16, and
    - np.matmul's the raw integers in tl.dot: such operands are converted to fp32 first (exact: bf16 -> fp32 is
      lossless);
    - rounds fp32 -> bf16 toward zero in ``.to(tl.bfloat16)``, where the GPU rounds to nearest even (1 + 3 * 2^-9
      becomes 1, not 1 + 2^-7): the cast goes through torch's round-to-nearest-even conversion instead;
    - flushes (or garbles) bf16 subnormals in ``.to(tl.float32)``: the cast widens the bits instead (exact).
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder_cls = interp.InterpreterBuilder
    if getattr(builder_cls, "_kimik3_bf16_fixed", False):
        return
    orig_dot, orig_cast = builder_cls.create_dot, builder_cls.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def fix(x):
            if x.dtype.scalar == tl.bfloat16:
                data = interp._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interp.TensorHandle(data, tl.float32)
            return x

        return orig_dot(self, fix(a), fix(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interp.TensorHandle(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            bits = np.ascontiguousarray(src.data).view(np.uint16).astype(np.uint32) << 16
            return interp.TensorHandle(bits.view(np.float32), tl.float32)
        return orig_cast(self, src, dst_type)

    builder_cls.create_dot, builder_cls.cast_impl = create_dot, cast_impl
    builder_cls._kimik3_bf16_fixed = True
