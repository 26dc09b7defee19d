"""The names by which frameworks' traces show input loading, host-device synchronisation and
collective communication, and the remedies their own guides give."""

from __future__ import annotations

import re

from gpuscope.analysis.kernel_taxonomy import COLLECTIVE_KERNEL

__all__ = ["COLLECTIVE_KERNEL"]  # kept here for the modules that read it with the other patterns

# Host spans during which a step waits for its input.
INPUT_OP = re.compile(
    r"DataLoader.*__next__"  # PyTorch: enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__
    r"|Iterator::GetNext|IteratorGetNext|MultiDeviceIteratorGetNext"  # tf.data
    r"|Infeed|TransferToInfeed",  # TPU/XLA infeed
)
# Python frames of the same: a generator or iterator advanced by ``next`` (a Python loop that feeds
# jitted calls), PyTorch's DataLoader.
INPUT_PYTHON = re.compile(r"^builtins next$|dataloader\.py\(\d+\): __next__|\b__next__$")

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

REMEDIES = {
    "input_bound": (
        "Load and preprocess input in parallel with the step: DataLoader(num_workers>0, pin_memory=True, "
        "persistent_workers=True, prefetch_factor); tf.data .prefetch(tf.data.AUTOTUNE), parallel "
        "map/interleave, .cache(); in JAX, prefetch batches to the device from a background thread."),
    "host_sync": (
        "Keep values on the device inside the step: log .item() every N steps, not every step; avoid "
        "torch.nonzero/unique and boolean-mask indexing in the loop (use torch.where or fixed-size "
        "masks); remove torch.cuda.synchronize() and .cpu() calls from the step."),
    "launch_bound": (
        "Launch fewer, larger kernels: a larger batch, torch.compile or CUDA graphs "
        "(torch.cuda.graphs, mode=\"reduce-overhead\"), fused optimizers (foreach=True or fused=True), "
        "jax.jit over the whole step."),
    "communication_wait": (
        "Overlap communication with computation: DDP bucket_cap_mb and gradient accumulation "
        "(no_sync), FSDP prefetching, fewer and larger collectives; check the interconnect "
        "(NCCL_DEBUG=INFO) and stragglers on other ranks."),
    "host_bound": (
        "Prefetch the next batch to the device from a background thread, so that the dispatching "
        "thread never waits for it (flax.jax_utils.prefetch_to_device, or a thread that calls "
        "jax.device_put into a queue; tf.data .prefetch(tf.data.AUTOTUNE); DataLoader(num_workers>0, "
        "pin_memory=True)). To see which Python runs between the steps, capture with the Python tracer "
        "(python_tracer_level=1 for JAX and TensorFlow, with_stack=True for PyTorch)."),
    "shared_gpu": (
        "Run one process per GPU: give the other process its own GPU (CUDA_VISIBLE_DEVICES, the device "
        "plugin's allocation), or partition the GPU (MIG, MPS) when sharing is intended; time-sliced, "
        "each process gets only a slice of the GPU's time."),
    "tensor_cores_idle": (
        "Run the matrix work on the tensor cores: torch.autocast(device_type=\"cuda\", "
        "dtype=torch.bfloat16) (or float16 with a GradScaler), Keras "
        "mixed_precision.set_global_policy(\"mixed_float16\"), bfloat16 parameters and inputs in JAX; "
        "or TF32 for an fp32 model (torch.backends.cuda.matmul.allow_tf32 = True, "
        "torch.backends.cudnn.allow_tf32 = True, jax_default_matmul_precision=\"tensorfloat32\"). Keep "
        "channel counts and matrix dimensions multiples of 8."),
    "layout_conversion": (
        "Keep activations in the layout the convolution kernels use: "
        "model.to(memory_format=torch.channels_last) and inputs in channels_last in PyTorch (with "
        "autocast), data_format=\"channels_last\" (NHWC) in TensorFlow; channel counts that are "
        "multiples of 8 let cuDNN choose NHWC tensor-core kernels."),
    "costly_op": (
        "Replace the data-dependent operation in the step: boolean-mask indexing (x[mask]) and its "
        "backward with torch.where or a multiplication by the mask; torch.unique, sort and nonzero with "
        "fixed-size alternatives (bincount with minlength, count_nonzero, a loss with ignore_index); "
        "scatter and index_put with a dense formulation where the sizes allow."),
    "small_grids": (
        "Give each kernel enough work to fill the GPU's multiprocessors: a larger batch or larger "
        "matrix dimensions, fused operations (torch.compile, XLA), no single-block reductions or "
        "spin-waits in the step. The agent's gpu_sm_active_ratio far below the GPU's utilization shows "
        "the same from NVML."),
    "optimizer_heavy": (
        "Use a fused optimizer: torch.optim.AdamW(..., fused=True) (or foreach=True where fused is not "
        "available), optax's or apex's fused updates; fewer, larger parameter tensors."),
    "idle_between_steps": (
        "The evidence names what the host ran while the device idled: move that work off the step's "
        "critical path (logging, metrics and checkpointing every N steps or on another thread; "
        "preprocessing or data redistribution overlapped with the previous step), or, when the host "
        "was waiting too, look at the other streams and ranks the step depends on."),
}
