"""What a GPU kernel does, read from its name: the classes of device time a diagnosis weighs.

Kernel names are the libraries' own (cuBLAS, cuBLASLt, cuDNN, CUTLASS, PyTorch's ATen, XLA), and they
say the precision and the instructions a matrix kernel uses:

- tensor cores: ``hmma``/``wgmma``/``imma``/``gmma``, CUTLASS's ``tensorop`` and ``s1688``/``h16816``
  shapes (Volta's ``h884gemm``), a ``tf32``/``bf16``/``f16`` operand type in an ``xmma`` name,
  cuBLASLt's ``nvjet`` kernels, flash attention;
- fp32 on the SIMT cores: ``sgemm``, ``f32f32_f32f32`` operands, ``ffma``, cuDNN's ``<float`` engines
  (``wgrad_alg0_engine<float, ...>``, ``implicit_convolve_sgemm``), cuBLAS's small ``gemmSN<float>``.

A matrix kernel that names neither (FP64, Triton's generated names) is a matrix kernel of unknown kind:
it is not counted as the tensor cores' or as fp32's.
"""

from __future__ import annotations

import re
from typing import Literal

from gpuscope.analysis.model import Kind
from gpuscope.analysis.patterns import COLLECTIVE_KERNEL

KernelClass = Literal["tensor_core", "fp32_matmul", "other_matmul", "layout", "collective", "memcpy",
                      "memset", "other"]
KERNEL_CLASSES: tuple[KernelClass, ...] = ("tensor_core", "fp32_matmul", "other_matmul", "layout",
                                           "collective", "memcpy", "memset", "other")

# cuDNN's conversions between NCHW and NHWC around a convolution that wants the other layout.
LAYOUT_KERNEL = re.compile(r"nchwToNhwc|nhwcToNchw|tensorTransformGeneric|nchwToNchw|nhwcToNhwc")
# Anchored: "mma" is not LayerNorm's GammaBeta kernel, "conv" is not a dtype conversion.
MATMUL_KERNEL = re.compile(r"gemm|gemv|conv(?!ert)|fprop|dgrad|wgrad|xmma|cutlass|nvjet"
                           r"|(?<![a-z])(?:h|wg|i|g)?mma|flash|fmha", re.IGNORECASE)
TENSOR_CORE_KERNEL = re.compile(
    r"tf32|bf16|(?<![a-z])f16|fp16|(?<![a-z])(?:h|wg|i|g)mma|tensorop|tensor\d+x\d+|1688|16816|8816|884gemm|nvjet"
    r"|flash|fmha", re.IGNORECASE)
FP32_KERNEL = re.compile(r"sgemm|f32f32_f32f32|ffma|<float\b|_fp32_|gemmSN_\w+<float", re.IGNORECASE)
# Optimizer kernels outside an ``Optimizer.step`` annotation (a fused optimizer called directly).
OPTIMIZER_KERNEL = re.compile(r"multi_tensor_apply|fused_?adam|fused_?sgd|FusedAdam|FusedSGD|adam_kernel",
                              re.IGNORECASE)


def classify(kind: Kind, name: str) -> KernelClass:
    """The class of one device event's time."""
    if kind is Kind.MEMCPY:
        return "memcpy"
    if kind is Kind.MEMSET:
        return "memset"
    if COLLECTIVE_KERNEL.search(name):
        return "collective"
    if LAYOUT_KERNEL.search(name):
        return "layout"
    if MATMUL_KERNEL.search(name):
        if TENSOR_CORE_KERNEL.search(name):
            return "tensor_core"
        if FP32_KERNEL.search(name):
            return "fp32_matmul"
        return "other_matmul"
    return "other"
