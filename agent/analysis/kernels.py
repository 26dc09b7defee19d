"""The classes of device time a diagnosis weighs: the kernel taxonomy (``kernel_taxonomy``), and the
optimizer's kernels, which are attributed apart from their class."""

from __future__ import annotations

import re

from gpuscope.analysis.kernel_taxonomy import (
    KERNEL_CLASSES,
    MATMUL_CLASSES,
    KernelClass,
    classify,
    short_name,
)

__all__ = ["KERNEL_CLASSES", "MATMUL_CLASSES", "OPTIMIZER_KERNEL", "KernelClass", "classify", "short_name"]

# Optimizer kernels outside an ``Optimizer.step`` annotation (a fused optimizer called directly).
OPTIMIZER_KERNEL = re.compile(r"multi_tensor_apply|fused_?adam|fused_?sgd|FusedAdam|FusedSGD|adam_kernel",
                              re.IGNORECASE)
