"""What to do about each finding, in the words of the frameworks' own guides: a generic text for every
kind, and where it matters, one for the framework that wrote the trace and the GPU it ran on.

The GPU's compute capability decides the precision to suggest: Volta and Turing (7.0, 7.5) have fp16
tensor cores but neither bf16 nor TF32, so fp16 with loss scaling is their only mixed precision;
Ampere (8.x) adds bf16 and TF32; Ada, Hopper and Blackwell (8.9 and newer) add FP8.
"""

from __future__ import annotations

REMEDIES: dict[str, str] = {
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
REMEDIES["dominant_op"] = (
    "Fuse the operation that dominates: for attention, one fused kernel instead of separate matmul, "
    "softmax and masking passes over the score matrix (torch.nn.functional.scaled_dot_product_attention, "
    "FlashAttention, attn_implementation=\"sdpa\" or \"flash_attention_2\" in Hugging Face); for "
    "elementwise and normalisation chains, torch.compile, XLA (jit_compile=True, jax.jit) or fused kernels.")

REMEDIES["host_work"] = (
    "Give the host less to do per step: fused or foreach optimizers (and optimizers whose state lives on "
    "the device), torch.compile or CUDA graphs to issue the step in fewer calls, no per-step Python over "
    "many small tensors; the evidence names the operations the host ran while the device waited.")

BF16_MIN = (8, 0)  # Ampere: bf16 and TF32 tensor cores
FP8_MIN = (8, 9)  # Ada, Hopper, Blackwell: FP8 tensor cores

_BY_FRAMEWORK: dict[str, dict[str, str]] = {
    "pytorch": {
        "input_bound": (
            "Load and preprocess input in parallel with the step: DataLoader(num_workers>0, "
            "pin_memory=True, persistent_workers=True, prefetch_factor), and "
            ".to(device, non_blocking=True)."),
        "launch_bound": (
            "Launch fewer, larger kernels: a larger batch, torch.compile (mode=\"reduce-overhead\" for CUDA "
            "graphs) or torch.cuda.graphs, fused optimizers (foreach=True or fused=True)."),
        "layout_conversion": (
            "Keep activations in the layout the convolution kernels use: model.to(memory_format="
            "torch.channels_last) and inputs in channels_last (with autocast); channel counts that are "
            "multiples of 8 let cuDNN choose NHWC tensor-core kernels."),
        "small_grids": (
            "Give each kernel enough work to fill the GPU's multiprocessors: a larger batch or larger matrix "
            "dimensions, torch.compile to fuse small operations, no single-block reductions or spin-waits "
            "in the step."),
        "optimizer_heavy": (
            "Use a fused optimizer: torch.optim.AdamW(..., fused=True) (or foreach=True where fused is not "
            "available); fewer, larger parameter tensors."),
        "dominant_op": (
            "Fuse the operation that dominates: for attention, "
            "torch.nn.functional.scaled_dot_product_attention (FlashAttention and memory-efficient "
            "kernels) instead of matmul + softmax, "
            "attn_implementation=\"sdpa\" (or \"flash_attention_2\") in Hugging Face from_pretrained; for "
            "elementwise and normalisation chains, torch.compile."),
    },
    "tensorflow": {
        "input_bound": (
            "Overlap the input pipeline with the step: tf.data .prefetch(tf.data.AUTOTUNE), "
            "map(num_parallel_calls=tf.data.AUTOTUNE), parallel interleave, .cache() after the expensive "
            "steps; TF_GPU_THREAD_MODE=gpu_private keeps the GPU's launches off the input threads."),
        "launch_bound": (
            "Launch fewer, larger kernels: compile the step with XLA (tf.function(jit_compile=True), "
            "model.compile(jit_compile=True)), a larger batch, steps_per_execution in Keras; "
            "TF_GPU_THREAD_MODE=gpu_private gives the GPU its own launch threads."),
        "layout_conversion": (
            "Keep activations in NHWC (data_format=\"channels_last\", Keras's default) and use mixed "
            "precision, so that cuDNN runs NHWC tensor-core kernels without transposes; channel counts that "
            "are multiples of 8."),
        "small_grids": (
            "Give each kernel enough work to fill the GPU's multiprocessors: a larger batch or larger matrix "
            "dimensions, XLA (jit_compile=True) to fuse small operations."),
        "optimizer_heavy": (
            "Fuse the optimizer's update: compile the step with XLA (jit_compile=True), fewer and larger "
            "variables."),
        "dominant_op": (
            "Fuse the operation that dominates: for attention, keras.layers.MultiHeadAttention with XLA "
            "(jit_compile=True) or a fused attention kernel; for elementwise and normalisation chains, "
            "XLA (jit_compile=True)."),
    },
    "jax": {
        "input_bound": (
            "Prefetch batches to the device from a background thread (flax.jax_utils.prefetch_to_device, "
            "or a thread that calls jax.device_put into a queue); with tf.data or Grain, "
            ".prefetch and parallel workers."),
        "launch_bound": (
            "Put the whole step under one jax.jit (and several steps under jax.lax.scan or fori_loop), so "
            "that the host dispatches one computation per step."),
        "small_grids": (
            "Give each kernel enough work to fill the GPU's multiprocessors: a larger batch or larger matrix "
            "dimensions; jit the whole step so XLA fuses the small operations."),
        "optimizer_heavy": (
            "Update the parameters inside the jitted step (optax under jax.jit), with donate_argnums so XLA "
            "updates them in place."),
        "dominant_op": (
            "Fuse the operation that dominates: for attention, jax.nn.dot_product_attention "
            "(implementation=\"cudnn\") or a FlashAttention kernel instead of einsum + softmax; jit the "
            "whole step so that XLA fuses the elementwise and normalisation chains."),
    },
}


def remedy_for(kind: str, *, framework: str = "", capability: tuple[int, int] | None = None) -> str:
    """The remedy for a finding: for the trace's framework and GPU where the guides differ, else the
    generic text."""
    if kind == "tensor_cores_idle":
        return _tensor_cores(framework, capability)
    return _BY_FRAMEWORK.get(framework, {}).get(kind) or REMEDIES.get(kind, "")


def _tensor_cores(framework: str, capability: tuple[int, int] | None) -> str:
    """Mixed precision the GPU has: fp16 with loss scaling on Volta and Turing, bf16 or TF32 from Ampere,
    FP8 as an option from Ada and Hopper."""
    if framework not in ("pytorch", "tensorflow", "jax"):
        if capability is None:
            return REMEDIES["tensor_cores_idle"] + (
                " bf16 and TF32 need compute capability 8.0 (Ampere) or newer: on Volta and Turing use "
                "float16 with loss scaling.")
        framework = ""
    fp16 = {
        "pytorch": ("torch.autocast(device_type=\"cuda\", dtype=torch.float16) with a torch.amp.GradScaler "
                    "(\"cuda\")"),
        "tensorflow": ("Keras mixed_precision.set_global_policy(\"mixed_float16\") (with its "
                       "LossScaleOptimizer)"),
        "jax": "float16 parameters and inputs with loss scaling (jmp)",
        "": "float16 mixed precision with loss scaling (torch.amp, Keras \"mixed_float16\")",
    }[framework]
    bf16 = {
        "pytorch": ("torch.autocast(device_type=\"cuda\", dtype=torch.bfloat16), or TF32 for an fp32 model "
                    "(torch.backends.cuda.matmul.allow_tf32 = True, torch.backends.cudnn.allow_tf32 = True)"),
        "tensorflow": ("Keras mixed_precision.set_global_policy(\"mixed_bfloat16\"), or TF32 "
                       "(tf.config.experimental.enable_tensor_float_32_execution(True))"),
        "jax": "bfloat16 parameters and inputs, or jax_default_matmul_precision=\"tensorfloat32\"",
        "": "bf16 autocast or TF32",
    }[framework]
    fp8 = " FP8 (NVIDIA Transformer Engine) is an option for large matrices on this GPU."
    multiple = " Keep channel counts and matrix dimensions multiples of 8."
    if capability is None:
        return (f"Run the matrix work on the tensor cores: on compute capability 8.0 or newer (Ampere, Ada, "
                f"Hopper, Blackwell) {bf16}; on 7.x (Volta, Turing), which lack bf16 and TF32, {fp16}."
                + multiple)
    if capability < BF16_MIN:
        return (f"Run the matrix work on the tensor cores: {fp16}. This GPU (compute capability "
                f"{capability[0]}.{capability[1]}) has fp16 tensor cores only." + multiple)
    return (f"Run the matrix work on the tensor cores: {bf16}." + (fp8 if capability >= FP8_MIN else "")
            + multiple)
