"""What a GPU kernel does, read from its name: one table of name patterns, the first matching row wins.

Kernel names are the libraries' own (cuBLAS, cuBLASLt, cuDNN, CUTLASS, NCCL, PyTorch's ATen and
Inductor, TensorFlow's Eigen kernels, XLA's fusions), and they say what a kernel computes and, for a
matrix kernel, the precision and instructions it uses. A row is matched against the name without its
parameter list (``(float*, int, ...)``): argument types such as ``cublasTransposeParams`` say nothing of
the kernel, while the template arguments (``<float, ...>``) say its data type.

The order of the rows matters: collectives before reductions (``ReduceScatter``), fp32 matrix kernels
before the tensor-core ones (``cutlass_80_simt_sgemm`` is CUTLASS on the SIMT cores), fused attention
before softmax, the matrix kernels before the casts; and "conv" in a cast's name is no convolution
(Eigen's ``TensorConversionOp``, XLA's ``convert`` fusions).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Literal

from gpuscope.analysis.model import Kind

KernelClass = Literal["tensor_core", "fp32_matmul", "convolution", "other_matmul", "softmax", "elementwise",
                      "reduction", "layout", "collective", "memcpy", "memset", "other"]
KERNEL_CLASSES: tuple[KernelClass, ...] = (
    "tensor_core", "fp32_matmul", "convolution", "other_matmul", "softmax", "elementwise", "reduction",
    "layout", "collective", "memcpy", "memset", "other")
MATMUL_CLASSES: frozenset[str] = frozenset({"tensor_core", "fp32_matmul", "convolution", "other_matmul"})

# Collective communication, also the custom and symmetric-memory all-reduce kernels that inference
# engines launch instead of NCCL's. One block per channel by design: never a small grid to fix.
COLLECTIVE_PATTERN = (
    r"(?i:nccl|rccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter|all[-_]?to[-_]?all"
    r"|cross_device_reduce|lamport)")
# The data type a matrix kernel's name gives its operands, when it uses the tensor cores.
_TC_TYPE = r"(?:tf32|bf16|(?<![a-z0-9])f16|fp16|fp8|e4m3|e5m2|int8)"

TAXONOMY: tuple[tuple[str, KernelClass], ...] = (
    # NCCL/RCCL (ncclDevKernel_*, ncclKernel_*), XLA's all-reduce-start, PyTorch's symmetric memory
    # (multimem_all_reduce_kernel, one_shot/two_shot_all_reduce), vLLM/SGLang custom all-reduce
    # (cross_device_reduce_1stage/2stage), TensorRT-LLM/FlashInfer Lamport all-reduce.
    (COLLECTIVE_PATTERN, "collective"),
    # PyTorch's foreach kernels (the optimizer's and GradScaler's): elementwise over a list of tensors.
    # The optimizer's share is attributed apart from the class, by where the kernel was launched.
    (r"multi_tensor_apply", "elementwise"),
    # cuDNN's conversions between NCHW and NHWC around a convolution that wants the other layout.
    (r"nchwToNhwc|nhwcToNchw|nchwToNchw|nhwcToNhwc|tensorTransformGeneric", "layout"),
    # PyTorch's memory-efficient attention in fp32 runs on the SIMT cores (fmha_cutlassF_f32_...).
    (r"fmha_cutlass[FB]_f32", "fp32_matmul"),
    # Fused attention: FlashAttention (flash_fwd_kernel, pytorch_flash::), cuDNN/TensorRT fmha kernels.
    (r"(?i:(?<![a-z])flash_?(?:fwd|bwd|attn)|fmha)", "tensor_core"),
    # fp32 on the SIMT cores: cuBLAS/CUTLASS sgemm (volta_sgemm, cutlass_80_simt_sgemm, sgemm_largek),
    # xmma kernels with fp32 operands (f32f32_f32f32 ... ffma), cuDNN's fp32 engines (scudnn).
    (r"sgemm|f32f32_f32f32|scudnn", "fp32_matmul"),
    # Depthwise and grouped direct convolutions run on the CUDA cores in every precision: no tensor
    # cores to use (conv_depthwise2d_forward_kernel, cudnn::cnn::conv2d_grouped_direct_kernel<float, ...>).
    (r"conv_depthwise|DepthwiseConv|grouped_direct", "convolution"),
    # cuDNN's Winograd and direct fp32 convolutions (winogradForwardData4x4<float, ...>,
    # wgrad_alg0_engine<float, ...>, reduce_wgrad_nchw_helper<float>), cuBLAS's small fp32 GEMM and
    # GEMV kernels (gemmSN_TN_kernel<float, ...>, gemv2T_kernel_val<int, int, float, ...>), Eigen's
    # fp32 contraction (TensorFlow's MatMul without cuBLAS).
    # "conv" not in "convert" or "conversion": Eigen's casts (TensorConversionOp<float, ...>).
    (r"(?i:winograd|wgrad|dgrad|fprop|conv(?!ert|ersion)|engine)\w*<(?:\d+, )?float\b"
     r"|gem[mv]\w*<(?:int, int, )?float\b"
     r"|EigenFloatContractionKernel", "fp32_matmul"),
    # Tensor cores by generation: Volta's 884 shapes (volta_h884gemm, volta_s884gemm_fp16), Turing and
    # Ampere's 1688/16816 (turing_fp16_s1688gemm, ampere_bf16_s16816gemm), CUTLASS's tensorop kernels
    # (cutlass_80_tensorop_s1688gemm, MmaTensorOp in a mangled name), the mma instructions.
    (r"(?<![a-z0-9])[hsi](?:884|1688|16816|8816|16832)|(?i:tensorop)|(?<![a-z])(?:h|wg|i|g)mma|tcgen05",
     "tensor_core"),
    # cuBLASLt's nvjet kernels (Hopper and Blackwell), and TensorRT-LLM's block-scaled batched GEMMs
    # (bmm_E4m3_..., bmm_Bfloat16_MxE2m1MxE4m3_..., bmm_MxE4m3_...): MXFP4/FP8 on Blackwell.
    (r"nvjet|(?i:bmm)_(?:Bfloat16|Fp16|Mx|E4m3|E2m1|E5m2)", "tensor_core"),
    # Matrix kernels that say a tensor-core operand type (sm90_xmma_gemm_bf16bf16_bf16f32,
    # sm90_xmma_gemm_f32f32_tf32f32, sm80_xmma_fprop_implicit_gemm_tf32f32), or Hopper's sm90 xmma.
    (rf"(?i:(?:gemm|xmma|cudnn|fprop|dgrad|wgrad)\w*{_TC_TYPE}|{_TC_TYPE}\w*gemm)|sm90_xmma", "tensor_core"),
    # Convolution engines whose name gives no precision (convolve_common_engine_float_NHWC<__half, ...>
    # despite its name), cuDNN and CUTLASS convolution kernels.
    (r"(?i:convolution|convolve|conv[23]d)", "convolution"),
    # Matrix kernels of unknown kind: FP64 (ampere_dgemm), Triton's (triton_mm), cuBLAS's split-K
    # reduction (splitKreduce_kernel), CUTLASS and xmma helpers (init_device_workspace_kernel).
    (r"(?i:gemm|gemv|matmul|triton_mm|xmma|cutlass|splitKreduce|ReduceSplitK)|(?<![a-z])mma", "other_matmul"),
    # Casts: Eigen's TensorConversionOp (TensorFlow's Cast), XLA's convert fusions. After the matrix
    # rows, so that no matrix kernel is taken for a cast.
    (r"TensorConversionOp|(?i:convert)", "elementwise"),
    # Unfused attention's softmax and the loss's log-softmax: cunn_SoftMaxForward, softmax_warp_forward,
    # scaled_masked_softmax_warp_forward, cuDNN's softmax_fw_kernel, Inductor's triton_per_fused__softmax.
    (r"(?i:softmax)", "softmax"),
    # Transposes: TensorFlow's SwapDimension1And2InTensor3UsingTiles, XLA's transpose fusions.
    (r"(?i:transpose)|SwapDimension\d", "layout"),
    # Normalisation and reductions: LayerNorm/RMSNorm/BatchNorm (vectorized_layer_norm_kernel,
    # cudnn::bn_fw_tr_1C11_kernel_NCHW, GammaBetaBackward), ATen's reduce_kernel, CUB's DeviceReduce,
    # TensorFlow's RowReduceKernel, XLA's input_reduce_fusion, Inductor's triton_red_/triton_per_,
    # pooling (a window's max or mean), losses (a sum over the classes).
    (r"(?i:(?:layer|rms|batch|group|instance)_?norm|(?<![a-z])bn_|GammaBeta|RowwiseMoments|reduce"
     r"|pool|nll_loss|triton_red_|triton_per_)", "reduction"),
    # Elementwise: ATen's elementwise_kernel family (casts and copies too), Eigen's EigenMetaKernel of
    # TensorCwise ops, XLA's loop fusions and single wrapped ops, Inductor's pointwise triton_poi_.
    (r"elementwise|EigenMetaKernel|TensorCwise|scalar_\w+_op|(?<![a-z])(?:loop_\w+_fusion|wrapped_)"
     r"|triton_poi_|CatArrayBatchedCopy", "elementwise"),
)
_ROWS: tuple[tuple[re.Pattern[str], KernelClass], ...] = tuple(
    (re.compile(pattern), cls) for pattern, cls in TAXONOMY)
COLLECTIVE_KERNEL = re.compile(COLLECTIVE_PATTERN)
# Log-softmax is the loss's (cross-entropy), not attention's: its epilogue or its flag say so
# (softmax_warp_forward<input, output, acc, log2_elements, is_log_softmax, is_masked>).
LOG_SOFTMAX = re.compile(r"(?i:log_?softmax)|softmax_warp_(?:forward|backward)<[^<>]*?,\s*\d+,\s*true\b")


def classify(kind: Kind, name: str) -> KernelClass:
    """The class of one device event's time."""
    if kind is Kind.MEMCPY:
        return "memcpy"
    if kind is Kind.MEMSET:
        return "memset"
    return classify_name(name)


@lru_cache(maxsize=4096)
def classify_name(name: str) -> KernelClass:
    """The class of a kernel's name: the first row of the table that matches it, or ``other``."""
    signature = without_parameters(name)
    for pattern, cls in _ROWS:
        if pattern.search(signature):
            return cls
    return "other"


def without_parameters(name: str) -> str:
    """A kernel's name without ``void``, anonymous namespaces and its parameter list: the template
    arguments stay (they say the data type)."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    depth = 0
    for i, char in enumerate(name):  # cut at the parameter list's "(" outside any template brackets
        if char == "<":
            depth += 1
        elif char == ">":
            depth -= 1
        elif char == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def short_name(kernel: str, limit: int = 90) -> str:
    """A kernel's name as people read it: without its parameter list, clipped to ``limit``."""
    kernel = without_parameters(kernel)
    return kernel if len(kernel) <= limit else kernel[:limit - 1] + "…"
