"""The names by which frameworks' traces show input loading, host-device synchronisation and
collective communication."""

from __future__ import annotations

import re

from gpuscope.analysis.kernel_taxonomy import COLLECTIVE_KERNEL
from gpuscope.analysis.remedies import REMEDIES

# Kept here for the modules that read them with the other patterns.
__all__ = ["COLLECTIVE_KERNEL", "REMEDIES"]

# Host spans during which a step waits for its input, wherever in the step they run: the framework's
# input pipeline, and a model's own preprocessing (Hugging Face pipelines, processors and
# tokenizers, torchvision transforms, video decoding) when it runs in the step's thread.
INPUT_OP = re.compile(
    r"DataLoader.*__next__"  # PyTorch: enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__
    r"|Iterator::GetNext|IteratorGetNext|MultiDeviceIteratorGetNext"  # tf.data
    r"|Infeed|TransferToInfeed"  # TPU/XLA infeed
    r"|^(?:Pipeline\.)?preprocess\b|[Tt]okeniz|ImageProcessor|VideoProcessor|FeatureExtractor",
)
# Python frames of the same: a generator or iterator advanced by ``next`` (a Python loop that feeds
# jitted calls), a Dataset's ``__getitem__`` and the collate function, Hugging Face pipelines'
# ``preprocess``, processors and tokenizers, torchvision's transforms and video readers.
INPUT_PYTHON = re.compile(
    r"^builtins next$|dataloader\.py\(\d+\): __next__|\b__next__$"
    r"|^(?!.*\b(?:torch|numpy|jax|tensorflow|pandas)/(?!utils/data/)).*\): __getitem__$"
    r"|collate\.py\(\d+\)|\): \w*collate\w*$"
    r"|pipelines/\w+\.py\(\d+\): (?:preprocess|_preprocess|_sanitize_parameters)$"
    r"|(?:image|video)_process\w*\.py\(\d+\)|feature_extraction\w*\.py\(\d+\)"
    r"|processing_\w+\.py\(\d+\): __call__$"
    r"|tokenization\w*\.py\(\d+\)|tokenizers/"
    r"|torchvision/(?:transforms|io)/|decord|torchcodec|\bav/"
)

# Host operations that wait for the device: reading a value back (``.item()``, ``print``), or an
# operation whose output size depends on the data (``nonzero``, ``unique``, boolean masks).
SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::nonzero_static", "aten::unique", "aten::_unique",
    "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::masked_select",
    "aten::repeat_interleave", "aten::equal", "aten::is_nonzero",
})
# CUDA API calls that block the host until the device (or a stream, or an event) is done.
SYNC_RUNTIME = re.compile(
    r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|cudaMemcpy2D"
    r"|cuStreamSynchronize|cuCtxSynchronize|cuEventSynchronize|cuMemcpyDtoH(_v2)?"
    r"|hipStreamSynchronize|hipDeviceSynchronize|hipMemcpy)$")
LAUNCH_RUNTIME = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cuLaunchKernelEx"
                            r"|cudaGraphLaunch|hipLaunchKernel|hipExtModuleLaunchKernel)")
# The framework's own host work around each compiled call: JAX's dispatch and the wait for its
# result, TensorFlow's function calls. Device idle time under them is dispatch overhead (launch-bound),
# not work between steps.
DISPATCH_OP = re.compile(r"^(PjitFunction\(|PmapFunction\(|ExecuteShardedOnLocalDevices|PjRt|"
                         r"CommonPjRtBuffer::|ThunkExecutor|TfrtCpuExecutable|__inference_|EagerExecute|"
                         r"EagerKernelExecute|FunctionRun)")
# Operations that move or select data rather than compute the model: indexing and its backward,
# scatter/gather, sorting, unique, nonzero, boolean masks. One of them taking a large share of the
# device is almost always a data-dependent shape operation that has a dense replacement.
NON_COMPUTE_OP = re.compile(r"index|scatter|gather|sort|unique|nonzero|masked_select|masked_scatter|"
                            r"bincount|repeat_interleave|histc|\btake\b|\bput_", re.IGNORECASE)
# Library frames: a Python call site names the first frame outside these.
LIBRARY_FRAME = re.compile(r"(^|/)(torch|jax|jaxlib|tensorflow|keras|numpy|flax|optax|threading|"
                           r"contextlib|importlib|site-packages|dist-packages|lib/python3)[/.(]|^builtins |"
                           r"^<built-in|^\$?<unknown>")
