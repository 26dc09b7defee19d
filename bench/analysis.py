"""Time and peak memory of `gpuscope explain` on large traces (not a test: run by hand).

Run: python bench/analysis.py [--sizes 10,100,300] [--format kineto|xspace|both] [--keep DIR]
                              [--memory-limit BYTES] [--profile] [--json]

Writes a synthetic PyTorch training trace of each size (MB: 10^6 bytes of uncompressed Kineto JSON)
into a temporary directory (``--keep DIR``: into DIR, kept), a step at a time, never as one string:
one GPU (pid 0, stream 7) and two host threads (the main one, and the autograd engine's, which runs
the backward pass). Each step (``ProfilerStep#N``) is, as torch.profiler records it with
record_shapes and with_stack:

* the DataLoader's ``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__`` for 30% of the
  step (``--input-share``), with Python frames and a few CPU ops (``__getitem__``, ``default_collate``),
  while the GPU idles;
* two host-to-device copies (``aten::to`` ... ``cudaMemcpyAsync`` -> ``gpu_memcpy``);
* the forward pass of an MLP (``aten::linear``, ``aten::addmm``, ``aten::relu`` ...), the loss, the
  backward pass on the autograd thread and an SGD step, every kernel launched by a ``cudaLaunchKernel``
  with its ``ac2g`` flow and run on stream 7 back to back (the host runs ahead of the GPU);
* ``loss.item()``: ``aten::_local_scalar_dense``, a device-to-host copy and a ``cudaStreamSynchronize``
  that waits for the GPU to drain;
* ``python_function`` events for the frames of all this (the trace's ``<module>`` frame holds them all).

``--format xspace`` (or ``both``) writes the same steps as an XSpace ``.xplane.pb`` (a ``/host:CPU``
plane with a line per thread, events in the order TraceMe records them (by end), and a
``/device:GPU:0`` plane with a ``Stream #7(compute)`` line): as many steps as the JSON of that size
holds, so about as many events (less the flows and metadata, which XSpace has not), in a twelfth
of the bytes.

Each trace is then analysed in a fresh child process, ``python -m gpuscope explain FILE --json`` with
its output to a pipe, and measured: wall time (the interpreter's start and imports included: see the
``startup`` row, a trace of 3 steps), CPU time (user + system, ``os.wait4``), peak RSS (VmHWM) and
peak address space (VmPeak, what RLIMIT_AS bounds) as the child reports them at exit (see PEAKS for
why not wait4's ru_maxrss), events and bytes per second of wall time, and the verdict. The largest
trace is analysed once more the way the agent's capture analysis runs it: the child program of
agent/capture/analysis_worker.py, with RLIMIT_AS = capture.analysis.memory_bytes (2 GiB by default;
``--memory-limit`` tries another) and RLIMIT_CPU = capture.analysis.cpu_seconds, to show whether it
stays within them. The text report of the smallest trace is printed in full. ``--profile``: the
read/diagnose split per size (in-process timers) and a cProfile of the smallest trace.

Sizes are about right: a trace ends at the first step boundary past its size.

``--trace FILE`` (repeatable) measures a real trace too, a recorded capture of a real job: once with
`gpuscope explain`, once as the agent's analysis child runs it (with ``--sizes ""``, only those).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pstats
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO

from gpuscope.capture.analysis_worker import _CHILD as AGENT_CHILD
from gpuscope.capture.config import AnalysisConfig
from gpuscope.common.sizes import format_size, parse_size
from gpuscope.generated.tsl import xplane_pb2

MB = 10**6
MIB = 2**20

# ------------------------------------------------------------------ the training loop's events

HOST_PID, MAIN_TID, AUTOGRAD_TID = 31881, 31881, 31934
DEVICE, STREAM = 0, 7
BASE_US = 4_758_647_833_816.734  # Kineto's timestamps: microseconds of the host's clock
BASE_NS = 1_790_857_026_000_000_000  # the XSpace's lines start here (nanoseconds since the epoch)
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
LAUNCH_LATENCY_US = 5.0
ROOT_PYTHON_ID = 1
BATCH_ITEMS = 8  # __getitem__ calls per batch
HIDDEN = 1024
BATCH = 256

DATALOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
GEMM = (
    "sm90_xmma_gemm_f32f32_tf32f32_f32_{}_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_k"
    "ernel__5x_cublas"
)
CLAMP = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_sc"
    "alar(at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)::{lambda()#"
    "1}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, at::detail::Array<char*"
    ", 2> >(int, at::native::(anonymous namespace)::launch_clamp_scalar(at::TensorIteratorBase&, c10::Sca"
    "lar, c10::Scalar, at::native::detail::ClampLimits)::{lambda()#1}::operator()() const::{lambda()#7}::"
    "operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2>)"
)
THRESHOLD = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::threshold_kerne"
    "l_impl<float>(at::TensorIteratorBase&, float, float)::{lambda(float, float)#1}, at::detail::Array<ch"
    "ar*, 3> >(int, at::native::(anonymous namespace)::threshold_kernel_impl<float>(at::TensorIteratorBas"
    "e&, float, float)::{lambda(float, float)#1}, at::detail::Array<char*, 3>)"
)
REDUCE_SUM = (
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float,"
    " at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float"
    ")#1}>, unsigned int, float, 4> >(at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::n"
    "ative::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>,"
    " unsigned int, float, 4>)"
)
SOFTMAX = (
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(ano"
    "nymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)"
)
SOFTMAX_BACKWARD = (
    "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<4, float, float, float, at::native::(an"
    "onymous namespace)::LogSoftMaxBackwardEpilogue>(float*, float const*, float const*, int)"
)
NLL = (
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(f"
    "loat*, float*, float const*, long const*, float const*, bool, long, long, long, long)"
)
NLL_BACKWARD = (
    "void at::native::(anonymous namespace)::nll_loss_backward_reduce_cuda_kernel_2d<float, long>(float*,"
    " float const*, long const*, float const*, float const*, bool, int, int, long, long)"
)
FILL = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<"
    "char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)"
)
FOREACH_ADD = (
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace):"
    ":TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>,"
    " std::plus<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<2>, at::native::(ano"
    "nymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>, std::plus<float>, float)"
)
# A kernel's share of the step's GPU time, relative to the others (scaled to the busy time wanted).
WEIGHTS = {"gemm": 3.0, "clamp": 0.25, "softmax": 0.3, "nll": 0.1, "fill": 0.05, "nll_backward": 0.15,
           "softmax_backward": 0.3, "threshold": 0.3, "sum": 0.3, "foreach": 1.5}


@dataclass(slots=True)
class Event:
    """One complete event ("ph": "X"): times in microseconds from the trace's start."""

    cat: str
    name: str
    ts: float
    dur: float
    tid: int  # the host thread, or the stream of a device event
    args: dict[str, Any]

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass(slots=True)
class StepEvents:
    host: list[Event] = field(default_factory=list)
    device: list[Event] = field(default_factory=list)
    flows: list[tuple[int, float, int, float]] = field(default_factory=list)  # id, host ts and tid, GPU ts
    end: float = 0.0


class TrainingLoop:
    """The events of an MLP's training steps (``layers`` Linear+ReLU), each ``step_ms`` long, waiting
    for its input ``input_share`` of it while the GPU idles, and keeping the GPU busy for the rest."""

    def __init__(self, *, layers: int = 12, step_ms: float = 30.0, input_share: float = 0.3,
                 seed: int = 0) -> None:
        self.layers = layers
        self.step_us = step_ms * 1e3
        self.input_share = input_share
        self.rng = random.Random(seed)
        self.external = 0  # "External id": a CPU op, its runtime calls and its kernels share it
        self.correlation = 0  # a runtime call and its kernel
        self.python_id = ROOT_PYTHON_ID
        self.index = 0  # "Ev Idx"
        self.gpu = 0.0  # when the stream is free
        self.unit = 0.0  # microseconds of GPU time per kernel weight, this step

    # ------------------------------------------------------------ event builders

    def _op(self, out: StepEvents, name: str, ts: float, dur: float, *, tid: int = MAIN_TID,
            cat: str = "cpu_op", dims: list[list[int]] | None = None) -> int:
        self.external += 1
        self.index += 1
        args: dict[str, Any] = {"External id": self.external, "Record function id": 0, "Ev Idx": self.index}
        if dims is not None:
            args["Input Dims"] = dims
            args["Input type"] = ["float"] * len(dims)
        out.host.append(Event(cat, name, ts, dur, tid, args))
        return self.external

    def _py(self, out: StepEvents, name: str, ts: float, dur: float, parent: int, *,
            tid: int = MAIN_TID) -> int:
        self.python_id += 1
        self.index += 1
        out.host.append(Event("python_function", name, ts, dur, tid, {
            "Python parent id": parent, "Python id": self.python_id, "Ev Idx": self.index}))
        return self.python_id

    def _launch(self, out: StepEvents, ts: float, external: int, kernel: str, weight: float, *,
                tid: int = MAIN_TID) -> None:
        """A cudaLaunchKernel at ``ts`` and its kernel, queued behind the stream's work."""
        dur = self.unit * weight * self.rng.uniform(0.9, 1.1)
        grid = max(1, round(dur * 4))
        self._device_call(out, ts, external, api="cudaLaunchKernel", cbid=211, tid=tid, work=Event(
            "kernel", kernel, 0.0, dur, STREAM, {
                "External id": external, "queued": 0, "device": DEVICE, "context": 1, "stream": STREAM,
                "correlation": 0, "registers per thread": 90, "shared memory": 16384,
                "blocks per SM": round(grid / 132, 6), "warps per SM": round(grid * 4 / 132, 6),
                "grid": [grid, 1, 1], "block": [128, 1, 1], "est. achieved occupancy %": 6}))

    def _memcpy(self, out: StepEvents, ts: float, external: int, kind: str, size: int, *,
                tid: int = MAIN_TID) -> None:
        bandwidth = 12.0 if kind.startswith("Memcpy HtoD") else 8.0  # GB/s: pageable memory
        dur = max(1.2, size / (bandwidth * 1e3))
        self._device_call(out, ts, external, api="cudaMemcpyAsync", cbid=41, tid=tid, work=Event(
            "gpu_memcpy", kind, 0.0, dur, STREAM, {
                "External id": external, "device": DEVICE, "context": 1, "stream": STREAM,
                "correlation": 0, "bytes": size, "memory bandwidth (GB/s)": round(size / dur / 1e3, 6)}))

    def _device_call(self, out: StepEvents, ts: float, external: int, *, api: str, cbid: int, tid: int,
                     work: Event) -> None:
        self.correlation += 1
        self.index += 1
        out.host.append(Event("cuda_runtime", api, ts, self.rng.uniform(4.0, 9.0), tid, {
            "External id": external, "cbid": cbid, "correlation": self.correlation, "Ev Idx": self.index}))
        work.ts = max(ts + LAUNCH_LATENCY_US, self.gpu + self.rng.uniform(1.0, 3.0))
        work.args["correlation"] = self.correlation
        self.gpu = work.end
        out.device.append(work)
        out.flows.append((self.correlation, ts, tid, work.ts))

    # ------------------------------------------------------------ one step

    def step(self, number: int, t0: float) -> StepEvents:
        """Step ``number``, starting at ``t0``; its events, and its end in ``end``."""
        out = StepEvents()
        rng = self.rng
        period = self.step_us * rng.uniform(0.97, 1.03)
        wait = period * self.input_share
        w = WEIGHTS
        per_layer = 3 * w["gemm"] + w["clamp"] + w["threshold"] + w["sum"]  # forward and backward
        loss = w["softmax"] + w["nll"] + w["fill"] + w["nll_backward"] + w["softmax_backward"]
        busy = period * (1 - self.input_share - 0.02)
        self.unit = busy / (self.layers * per_layer + loss + 2 * w["foreach"])
        self._op(out, f"ProfilerStep#{number}", t0, 0.0, cat="user_annotation")
        step_event = out.host[-1]
        self._py(out, "torch/profiler/profiler.py(1227): step", t0 + 1, 14, ROOT_PYTHON_ID)
        h = t0 + 20
        h = self._input(out, h, wait)
        h = self._to_device(out, h)
        train = self._py(out, "train.py(30): train_step", h, 0.0, ROOT_PYTHON_ID)
        train_event = out.host[-1]
        h += 3
        self._op(out, "Optimizer.zero_grad#SGD.zero_grad", h, 24, cat="user_annotation")
        self._py(out, "torch/optim/optimizer.py(914): zero_grad", h + 1, 22, train)
        h = self._forward(out, h + 30, train)
        h = self._backward(out, h, train)
        h = self._optimizer(out, h, train)
        h = self._item(out, h, train)
        train_event.dur = h + 2 - train_event.ts
        end = h + 10
        step_event.dur = end - t0
        first = out.device[0].ts
        out.device.append(Event("gpu_user_annotation", f"ProfilerStep#{number}", first, self.gpu - first,
                                STREAM, {"External id": step_event.args["External id"]}))
        out.end = end
        return out

    def _input(self, out: StepEvents, h: float, wait: float) -> float:
        """``next(loader)``: the batch loaded and collated on the main thread."""
        frame = self._py(out, "torch/utils/data/dataloader.py(628): __next__", h, wait + 6, ROOT_PYTHON_ID)
        self._op(out, DATALOADER, h + 2, wait, cat="user_annotation")
        frame = self._py(out, "torch/utils/data/dataloader.py(671): _next_data", h + 4, wait - 1, frame)
        fetch = self._py(out, "torch/utils/data/_utils/fetch.py(49): fetch", h + 5, wait - 3, frame)
        slot = (wait - 200) / BATCH_ITEMS
        s = h + 8
        for _ in range(BATCH_ITEMS):
            item = self._py(out, "train.py(18): __getitem__", s, slot - 6, fetch)
            self._py(out, "<built-in method randn of type object at 0x7f3c2a8e1f40>", s + 2, 32, item)
            self._op(out, "aten::randn", s + 3, 28, dims=[[], [], [], [], []])
            self._op(out, "aten::empty", s + 4, 3, dims=[[], [], [], [], [], []])
            self._op(out, "aten::normal_", s + 9, 20, dims=[[HIDDEN // 8, 8], [], [], []])
            augment = self._py(out, "train.py(22): augment", s + 40, slot - 60, item)
            self._py(out, "<built-in method tolist of Tensor object at 0x7f3b1e2d4a90>", s + 42, slot - 70,
                     augment)
            s += slot
        collate = self._py(out, "torch/utils/data/_utils/collate.py(270): default_collate", s, 150, fetch)
        self._py(out, "<built-in method stack of type object at 0x7f3c2a8e1f40>", s + 3, 143, collate)
        self._op(out, "aten::stack", s + 5, 140, dims=[[HIDDEN]] * BATCH_ITEMS)
        self._op(out, "aten::cat", s + 20, 120, dims=[[HIDDEN]] * BATCH_ITEMS)
        return h + wait + 12

    def _to_device(self, out: StepEvents, h: float) -> float:
        """``x.cuda(), y.cuda()``: two pageable host-to-device copies."""
        for dims, size in (([BATCH, HIDDEN], BATCH * HIDDEN * 4), ([BATCH], BATCH * 8)):
            self._py(out, "<built-in method cuda of Tensor object at 0x7f3b1e2d4b30>", h, 46, ROOT_PYTHON_ID)
            self._op(out, "aten::to", h + 1, 42, dims=[dims, [], [], [], []])
            self._op(out, "aten::_to_copy", h + 3, 38, dims=[dims, [], [], [], [], []])
            self._op(out, "aten::empty_strided", h + 5, 4, dims=[[len(dims)], [len(dims)], [], [], [], []])
            copy = self._op(out, "aten::copy_", h + 10, 30, dims=[dims, dims, []])
            self._memcpy(out, h + 13, copy, "Memcpy HtoD (Pageable -> Device)", size)
            h += 50
        return h

    def _forward(self, out: StepEvents, h: float, train: int) -> float:
        for i in range(self.layers):
            module = self._py(out, f"nn.Module: Linear_{i}", h, 52, train)
            frame = self._py(out, "torch/nn/modules/linear.py(116): forward", h + 1, 50, module)
            self._py(out, "<built-in function linear>", h + 3, 46, frame)
            self._op(out, "aten::linear", h + 4, 44, dims=[[BATCH, HIDDEN], [HIDDEN, HIDDEN], [HIDDEN]])
            self._op(out, "aten::t", h + 5, 6, dims=[[HIDDEN, HIDDEN]])
            self._op(out, "aten::transpose", h + 6, 4, dims=[[HIDDEN, HIDDEN], [], []])
            self._op(out, "aten::as_strided", h + 7, 1.5, dims=[[HIDDEN, HIDDEN], [], [], []])
            addmm = self._op(out, "aten::addmm", h + 14, 32,
                             dims=[[HIDDEN], [BATCH, HIDDEN], [HIDDEN, HIDDEN], [], []])
            self._launch(out, h + 20, addmm, GEMM.format("tn"), WEIGHTS["gemm"])
            h += 54
            module = self._py(out, f"nn.Module: ReLU_{i}", h, 32, train)
            frame = self._py(out, "torch/nn/modules/activation.py(103): forward", h + 1, 30, module)
            self._py(out, "<built-in method relu of type object at 0x7f3c2a8e1f40>", h + 3, 27, frame)
            self._op(out, "aten::relu", h + 4, 24, dims=[[BATCH, HIDDEN]])
            clamp = self._op(out, "aten::clamp_min", h + 7, 18, dims=[[BATCH, HIDDEN], []])
            self._launch(out, h + 12, clamp, CLAMP, WEIGHTS["clamp"])
            h += 34
        frame = self._py(out, "torch/nn/modules/loss.py(1188): forward", h, 66, train)
        self._py(out, "<built-in function cross_entropy>", h + 2, 62, frame)
        self._op(out, "aten::cross_entropy_loss", h + 3, 60, dims=[[BATCH, HIDDEN], [BATCH], [], [], [], []])
        self._op(out, "aten::log_softmax", h + 5, 24, dims=[[BATCH, HIDDEN], [], []])
        softmax = self._op(out, "aten::_log_softmax", h + 7, 20, dims=[[BATCH, HIDDEN], [], []])
        self._launch(out, h + 12, softmax, SOFTMAX, WEIGHTS["softmax"])
        self._op(out, "aten::nll_loss_nd", h + 32, 29, dims=[[BATCH, HIDDEN], [BATCH], [], [], []])
        self._op(out, "aten::nll_loss", h + 33, 27, dims=[[BATCH, HIDDEN], [BATCH], [], [], []])
        nll = self._op(out, "aten::nll_loss_forward", h + 35, 24, dims=[[BATCH, HIDDEN], [BATCH], [], [], []])
        self._launch(out, h + 40, nll, NLL, WEIGHTS["nll"])
        return h + 68

    def _backward(self, out: StepEvents, h: float, train: int) -> float:
        """``loss.backward()``: the main thread waits in run_backward while the autograd engine's
        thread runs the backward functions."""
        frame = self._py(out, "torch/_tensor.py(522): backward", h, 0.0, train)
        outer = out.host[-1]
        frame = self._py(out, "torch/autograd/__init__.py(267): backward", h + 2, 0.0, frame)
        middle = out.host[-1]
        self._py(out, "<built-in method run_backward of torch._C._EngineBase object at 0x7f3c1d0e2f80>",
                 h + 6, 0.0, frame)
        inner = out.host[-1]
        b = h + 15
        tid = AUTOGRAD_TID

        def function(name: str, ts: float, dur: float) -> None:
            self._op(out, f"autograd::engine::evaluate_function: {name}", ts, dur, tid=tid)
            self._op(out, name, ts + 1, dur - 2, tid=tid)

        function("NllLossBackward0", b, 40)
        fill = self._op(out, "aten::nll_loss_backward", b + 3, 34, tid=tid,
                        dims=[[], [BATCH, HIDDEN], [BATCH], [], [], [], []])
        self._launch(out, b + 8, fill, FILL, WEIGHTS["fill"], tid=tid)
        self._launch(out, b + 22, fill, NLL_BACKWARD, WEIGHTS["nll_backward"], tid=tid)
        b += 42
        function("LogSoftmaxBackward0", b, 30)
        grad = self._op(out, "aten::_log_softmax_backward_data", b + 3, 24, tid=tid,
                        dims=[[BATCH, HIDDEN], [BATCH, HIDDEN], [], []])
        self._launch(out, b + 9, grad, SOFTMAX_BACKWARD, WEIGHTS["softmax_backward"], tid=tid)
        b += 32
        for _ in range(self.layers):
            function("ReluBackward0", b, 30)
            threshold = self._op(out, "aten::threshold_backward", b + 3, 24, tid=tid,
                                 dims=[[BATCH, HIDDEN], [BATCH, HIDDEN], []])
            self._launch(out, b + 9, threshold, THRESHOLD, WEIGHTS["threshold"], tid=tid)
            b += 32
            function("AddmmBackward0", b, 96)
            self._op(out, "aten::t", b + 3, 5, tid=tid, dims=[[HIDDEN, HIDDEN]])
            mm = self._op(out, "aten::mm", b + 10, 26, tid=tid, dims=[[BATCH, HIDDEN], [HIDDEN, HIDDEN]])
            self._launch(out, b + 16, mm, GEMM.format("nn"), WEIGHTS["gemm"], tid=tid)
            self._op(out, "aten::t", b + 38, 5, tid=tid, dims=[[BATCH, HIDDEN]])
            mm = self._op(out, "aten::mm", b + 44, 26, tid=tid, dims=[[HIDDEN, BATCH], [BATCH, HIDDEN]])
            self._launch(out, b + 50, mm, GEMM.format("nt"), WEIGHTS["gemm"], tid=tid)
            total = self._op(out, "aten::sum", b + 72, 20, tid=tid, dims=[[BATCH, HIDDEN], [], [], []])
            self._launch(out, b + 78, total, REDUCE_SUM, WEIGHTS["sum"], tid=tid)
            b += 98
            for _ in range(2):  # weight and bias
                function("torch::autograd::AccumulateGrad", b, 12)
                self._op(out, "aten::detach", b + 3, 6, tid=tid, dims=[[HIDDEN, HIDDEN]])
                self._op(out, "detach", b + 5, 2, tid=tid, dims=[[HIDDEN, HIDDEN]])
                b += 14
        inner.dur, middle.dur, outer.dur = b + 4 - inner.ts, b + 6 - middle.ts, b + 8 - outer.ts
        return b + 10

    def _optimizer(self, out: StepEvents, h: float, train: int) -> float:
        frame = self._py(out, "torch/optim/optimizer.py(373): wrapper", h, 140, train)
        self._op(out, "Optimizer.step#SGD.step", h + 3, 134, cat="user_annotation")
        frame = self._py(out, "torch/optim/sgd.py(63): step", h + 8, 126, frame)
        frame = self._py(out, "torch/optim/sgd.py(240): _multi_tensor_sgd", h + 14, 116, frame)
        self._py(out, "<built-in method _foreach_add_ of type object at 0x7f3c2a8e1f40>", h + 30, 96, frame)
        add = self._op(out, "aten::_foreach_add_", h + 32, 92,
                       dims=[[HIDDEN, HIDDEN]] * self.layers + [[HIDDEN]] * self.layers)
        self._launch(out, h + 44, add, FOREACH_ADD, WEIGHTS["foreach"])
        self._launch(out, h + 80, add, FOREACH_ADD, WEIGHTS["foreach"])
        return h + 144

    def _item(self, out: StepEvents, h: float, train: int) -> float:
        """``loss.item()``: a device-to-host copy, then a cudaStreamSynchronize until the GPU drains."""
        self._py(out, "<built-in method item of Tensor object at 0x7f3b1e2d4c70>", h, 0.0, train)
        frame = out.host[-1]
        self._op(out, "aten::item", h + 1, 0.0, dims=[[]])
        item = out.host[-1]
        dense = self._op(out, "aten::_local_scalar_dense", h + 2, 0.0, dims=[[]])
        local = out.host[-1]
        self._memcpy(out, h + 4, dense, "Memcpy DtoH (Device -> Pageable)", 4)
        self.correlation += 1
        self.index += 1
        done = self.gpu + 4
        out.host.append(Event("cuda_runtime", "cudaStreamSynchronize", h + 12, done - h - 12, MAIN_TID, {
            "External id": dense, "cbid": 131, "correlation": self.correlation, "Ev Idx": self.index}))
        local.dur, item.dur, frame.dur = done + 2 - local.ts, done + 3 - item.ts, done + 4 - frame.ts
        return done + 5


def steps_of(loop: TrainingLoop, first: int = 1, start: float = 100.0) -> Iterator[StepEvents]:
    """The loop's steps, one after another, without end."""
    number, t = first, start
    while True:
        step = loop.step(number, t)
        yield step
        number, t = number + 1, step.end + 2


# ------------------------------------------------------------------ Kineto JSON


@lru_cache(maxsize=4096)
def quote(text: str) -> str:
    return json.dumps(text)


def kineto_event(event: Event) -> str:
    pid = DEVICE if event.cat in DEVICE_CATEGORIES else HOST_PID
    args = ", ".join(f"{quote(key)}: {json.dumps(value)}" for key, value in event.args.items())
    return (f'  {{\n    "ph": "X",\n    "cat": "{event.cat}",\n    "name": {quote(event.name)},\n'
            f'    "pid": {pid},\n    "tid": {event.tid},\n    "ts": {BASE_US + event.ts:.3f},\n'
            f'    "dur": {event.dur:.3f}\n    ,\n    "args": {{\n      {args}\n    }}\n  }}')


def kineto_flows(flow: tuple[int, float, int, float]) -> str:
    correlation, host_ts, tid, device_ts = flow
    return (f'  {{\n    "ph": "s", "id": {correlation}, "pid": {HOST_PID}, "tid": {tid}, '
            f'"ts": {BASE_US + host_ts:.3f},\n    "cat": "ac2g", "name": "ac2g"\n  }},\n'
            f'  {{\n    "ph": "f", "id": {correlation}, "pid": {DEVICE}, "tid": {STREAM}, '
            f'"ts": {BASE_US + device_ts:.3f},\n    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }}')


def kineto_step(step: StepEvents) -> tuple[str, int]:
    """A step's text (its events, comma-separated) and how many events it holds."""
    parts = [kineto_event(e) for e in sorted(step.host, key=lambda e: e.ts)]
    parts += [kineto_event(e) for e in step.device]
    parts += [kineto_flows(f) for f in step.flows]
    return ",\n".join(parts), len(step.host) + len(step.device) + 2 * len(step.flows)


def metadata(name: str, pid: int, tid: int, args: dict[str, Any]) -> str:
    return (f'  {{\n    "ph": "M",\n    "name": "{name}",\n    "ts": {BASE_US:.3f},\n    "pid": {pid},\n'
            f'    "tid": {tid},\n    "args": {json.dumps(args)}\n  }}')


KINETO_HEADER = """{
  "schemaVersion": 1,
  "deviceProperties": [
    {
      "id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 84929347584,
      "computeMajor": 9, "computeMinor": 0,
      "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,
      "regsPerBlock": 65536, "warpSize": 32,
      "sharedMemPerBlock": 49152, "numSms": 132
    , "regsPerMultiprocessor": 65536, "sharedMemPerBlockOptin": 232448, "sharedMemPerMultiprocessor": 233472
    }
  ],
  "cupti_version": 24,
  "cuda_runtime_version": 12040,
  "cuda_driver_version": 12040,
  "trace_id": "5C8F3A1E0B9D4E27A6F1C2D3B4E5F607",
  "with_stack": 1,
  "host_name": "gpu-node-3",
  "displayTimeUnit": "ms",
  "baseTimeNanoseconds": 1790857026000000000,
  "traceEvents": [
"""
KINETO_METADATA = [
    metadata("process_name", HOST_PID, 0, {"name": "python"}),
    metadata("process_labels", HOST_PID, 0, {"labels": "CPU"}),
    metadata("thread_name", HOST_PID, MAIN_TID, {"name": f"thread {MAIN_TID} (python)"}),
    metadata("thread_name", HOST_PID, AUTOGRAD_TID, {"name": f"thread {AUTOGRAD_TID} (pt_autograd_0)"}),
    metadata("process_name", DEVICE, 0, {"name": "python"}),
    metadata("process_labels", DEVICE, 0, {"labels": "GPU 0"}),
    metadata("thread_name", DEVICE, STREAM, {"name": f"stream {STREAM} "}),
]
ROOT_FRAME = "train.py(52): <module>"
DUR_WIDTH = 24  # characters kept for the root frame's duration, written once the steps are


@dataclass(frozen=True, slots=True)
class Written:
    path: Path
    bytes: int
    events: int  # in the file, metadata and flows included
    steps: int


def write_kineto(path: Path, target: int, loop: TrainingLoop, steps: int | None = None) -> Written:
    """A Kineto trace of about ``target`` bytes (or of ``steps`` steps), written a step at a time."""
    start = 100.0
    root = (f'  {{\n    "ph": "X",\n    "cat": "python_function",\n    "name": {quote(ROOT_FRAME)},\n'
            f'    "pid": {HOST_PID},\n    "tid": {MAIN_TID},\n    "ts": {BASE_US + start - 50:.3f},\n'
            '    "dur": ')
    trailer = (f',\n  {{\n    "ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", '
               f'"tid": "PyTorch Profiler", "ts": {BASE_US:.3f}, "dur": 0, "args": {{"Op count": 0}}\n  }}'
               f'\n  ],\n  "traceName": {quote(path.name)}\n}}\n')
    with path.open("wb", buffering=1 << 20) as out:
        out.write((KINETO_HEADER + ",\n".join(KINETO_METADATA) + ",\n" + root).encode())
        dur_at = out.tell()
        out.write(b" " * DUR_WIDTH + b'\n    ,\n    "args": {\n      "Python parent id": null, '
                  b'"Python id": 1, "Ev Idx": 0\n    }\n  }')
        events, written, end = len(KINETO_METADATA) + 2, 0, start
        for written, step in enumerate(steps_of(loop, start=start), start=1):
            text, count = kineto_step(step)
            out.write(b",\n" + text.encode())
            events += count
            end = step.end
            if written >= steps if steps is not None else out.tell() + len(trailer) >= target:
                break
        out.write(trailer.encode())
        size = out.tell()
        out.seek(dur_at)
        out.write(f"{end + 50 - (start - 50):.3f}".ljust(DUR_WIDTH).encode())
    return Written(path, size, events, written)


def steps_for(target: int) -> int:
    """How many steps a Kineto trace of ``target`` bytes holds (from its first 20)."""
    sample = steps_of(TrainingLoop())
    size = sum(len(kineto_step(next(sample))[0]) + 2 for _ in range(20))
    return max(3, math.ceil((target - 3000) / (size / 20)))


# ------------------------------------------------------------------ XSpace


def _key(number: int, length: int) -> bytes:
    """A length-delimited field's tag and length."""
    out = bytearray()
    for field_value in ((number << 3) | 2, length):
        value = field_value
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


class XPlaneWriter:
    """A plane whose lines' events are serialized a run at a time (an XLine's serialized runs of
    events, concatenated, are the line's events), so the whole XSpace is never one message."""

    RUN = 20_000

    def __init__(self, plane_id: int, name: str, stats: tuple[str, ...] = ()) -> None:
        self.plane_id, self.name = plane_id, name
        self.metadata: dict[str, int] = {}
        self.stats = {stat: i for i, stat in enumerate(stats, start=1)}
        self.lines: dict[int, tuple[str, list[bytes], list[xplane_pb2.XEvent]]] = {}

    def add(self, line: tuple[int, str], name: str, ts: float, dur: float, *,
            stats: dict[str, int] | None = None, details: str = "") -> None:
        """An event on ``line`` (its id and name), with integer ``stats`` and ``kernel_details``."""
        metadata_id = self.metadata.setdefault(name, len(self.metadata) + 1)
        _, runs, pending = self.lines.setdefault(line[0], (line[1], [], []))
        event = xplane_pb2.XEvent(metadata_id=metadata_id, offset_ps=round(ts * 1e6),
                                  duration_ps=round(dur * 1e6))
        for stat, value in (stats or {}).items():
            event.stats.add(metadata_id=self.stats[stat], int64_value=value)
        if details:
            event.stats.add(metadata_id=self.stats["kernel_details"], str_value=details)
        pending.append(event)
        if len(pending) >= self.RUN:
            runs.append(xplane_pb2.XLine(events=pending).SerializeToString())
            pending.clear()

    def write(self, out: BinaryIO) -> None:
        header = xplane_pb2.XPlane(
            id=self.plane_id, name=self.name,
            event_metadata={i: xplane_pb2.XEventMetadata(id=i, name=name)
                            for name, i in self.metadata.items()},
            stat_metadata={i: xplane_pb2.XStatMetadata(id=i, name=name) for name, i in self.stats.items()},
        ).SerializeToString()
        lines = []
        for line_id, (line_name, runs, pending) in self.lines.items():
            runs.append(xplane_pb2.XLine(events=pending).SerializeToString())
            line_header = xplane_pb2.XLine(id=line_id, display_id=line_id, name=line_name,
                                           timestamp_ns=BASE_NS).SerializeToString()
            lines.append((line_header, runs, len(line_header) + sum(map(len, runs))))
        size = len(header) + sum(len(_key(3, length)) + length for _, _, length in lines)
        out.write(_key(1, size) + header)
        for line_header, runs, length in lines:
            out.write(_key(3, length) + line_header)
            for run in runs:
                out.write(run)


def kernel_details(event: Event) -> str:
    """A kernel's launch parameters as CUPTI's XSpace writer puts them in a string stat."""
    if event.cat != "kernel":
        return ""
    a = event.args
    return (f"regs:{a['registers per thread']} static_shared:0 dynamic_shared:{a['shared memory']} "
            f"grid:{','.join(map(str, a['grid']))} block:{','.join(map(str, a['block']))} "
            f"occ_pct:{a['est. achieved occupancy %']}")


def write_xspace(path: Path, steps: int, loop: TrainingLoop) -> Written:
    """The same steps as an XSpace: host events on their thread's line, in the order they end."""
    host = XPlaneWriter(1, "/host:CPU", ("step_num", "_r", "correlation_id"))
    device = XPlaneWriter(2, "/device:GPU:0", ("correlation_id", "device_id", "context_id", "kernel_details"))
    thread_names = {MAIN_TID: "python3", AUTOGRAD_TID: "pt_autograd_0"}
    events, end, start = 0, 0.0, 100.0
    for _, step in zip(range(steps), steps_of(loop, start=start), strict=False):
        for e in sorted(step.host, key=lambda e: e.end):
            stats: dict[str, int] | None = None
            name = e.name
            if e.name.startswith("ProfilerStep#"):
                name, stats = "train", {"step_num": int(e.name.partition("#")[2]), "_r": 1}
            elif e.cat == "python_function":
                name = "$" + e.name
            elif e.cat == "cuda_runtime":
                stats = {"correlation_id": e.args["correlation"]}
            host.add((e.tid, thread_names[e.tid]), name, e.ts, e.dur, stats=stats)
        for e in step.device:
            if e.cat in ("kernel", "gpu_memcpy"):
                device.add((STREAM, f"Stream #{STREAM}(compute)"), e.name, e.ts, e.dur,
                           stats={"correlation_id": e.args["correlation"], "device_id": DEVICE,
                                  "context_id": 1}, details=kernel_details(e))
                events += 1
        events += len(step.host)
        end = step.end
    host.add((MAIN_TID, thread_names[MAIN_TID]), "$" + ROOT_FRAME, start - 50, end + 100 - start)
    with path.open("wb", buffering=1 << 20) as out:
        host.write(out)
        device.write(out)
        out.write(xplane_pb2.XSpace(hostnames=["gpu-node-3"]).SerializeToString())
        size = out.tell()
    return Written(path, size, events + 1, steps)


# ------------------------------------------------------------------ measuring


# Put before a child's program: at exit, the child reports its peak RSS (VmHWM) and peak address
# space (VmPeak, what RLIMIT_AS bounds) on stderr. wait4's ru_maxrss cannot be used for the RSS: Linux
# carries the high-water mark of the image replaced by exec into it, and a child forked (or vforked)
# from this process starts as this process, which holds hundreds of MiB after writing a large trace.
PEAKS = """\
import atexit as _bench_atexit
def _bench_peaks():
    import sys
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    sys.stderr.write("bench: " + " ".join(f"{k} {fields[k].split()[0]}" for k in ("VmHWM", "VmPeak")) + "\\n")
_bench_atexit.register(_bench_peaks)
"""
# `python -m gpuscope ARGS`, with PEAKS.
MEASURED = PEAKS + """\
import runpy, sys
sys.argv = ["gpuscope", *sys.argv[1:]]
runpy.run_module("gpuscope", run_name="__main__")
"""
# Times the phases in one child: imports, reading, diagnosing.
PHASES = """\
import json, sys, time
from pathlib import Path
started = time.perf_counter()
from gpuscope.analysis.diagnose import diagnose
from gpuscope.analysis.sources import read_trace
imported = time.perf_counter()
trace = read_trace(Path(sys.argv[1]))
read = time.perf_counter()
diagnosis = diagnose(trace)
done = time.perf_counter()
print(json.dumps({"import": imported - started, "read": read - imported, "diagnose": done - read,
                  "verdict": diagnosis.verdict}))
"""


@dataclass(frozen=True, slots=True)
class Run:
    returncode: int
    wall: float
    cpu: float  # user + system, from wait4
    rss: int | None  # peak RSS (VmHWM), bytes, where the child reported it
    vm_peak: int | None  # peak address space (VmPeak), bytes
    stdout: bytes
    stderr: str


def run_child(argv: list[str]) -> Run:
    """Run ``argv`` with its output to a pipe: its wall time, its CPU time (wait4) and the peaks it
    reports (PEAKS)."""
    with tempfile.TemporaryFile() as errors:
        started = time.perf_counter()
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors)
        if child.stdout is None:
            raise RuntimeError("no pipe")
        stdout = child.stdout.read()
        child.stdout.close()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        errors.seek(0)
        stderr = errors.read().decode(errors="replace")
    peaks: dict[str, int] = {}
    for line in stderr.splitlines():
        if line.startswith("bench: "):
            words = line.split()[1:]
            peaks = {key: int(value) * 1024 for key, value in zip(words[::2], words[1::2], strict=True)}
    return Run(child.returncode, wall, usage.ru_utime + usage.ru_stime, peaks.get("VmHWM"),
               peaks.get("VmPeak"), stdout, stderr)


def explain(path: Path, *, as_json: bool = True) -> Run:
    return run_child([sys.executable, "-c", MEASURED, "explain", str(path), *(["--json"] if as_json else [])])


def verdict_of(run: Run) -> tuple[str, int]:
    """The verdict and the events the analysis kept, or what went wrong."""
    if run.returncode != 0:
        last = [line for line in run.stderr.splitlines() if not line.startswith("bench: ")]
        return f"failed ({run.returncode}): {(last or [''])[-1][-80:]}", 0
    report = json.loads(run.stdout)
    return str(report["verdict"]), sum(int(t["events"]) for t in report["traces"])


def measure(written: Written, fmt: str) -> dict[str, Any]:
    run = explain(written.path)
    verdict, kept = verdict_of(run)
    return {"format": fmt, "file": str(written.path), "bytes": written.bytes, "events": written.events,
            "kept": kept, "steps": written.steps, "wall_s": run.wall, "cpu_s": run.cpu, "rss": run.rss,
            "vm_peak": run.vm_peak, "events_per_s": written.events / run.wall,
            "bytes_per_s": written.bytes / run.wall, "verdict": verdict}


def under_limit(written: Written, memory: int, cpu_seconds: int) -> dict[str, Any]:
    """The analysis as the agent runs it (its own child program, rlimits and nice)."""
    run = run_child([sys.executable, "-c", PEAKS + AGENT_CHILD, str(cpu_seconds), str(memory),
                     str(written.path)])
    verdict, _ = verdict_of(run)
    return {"file": str(written.path), "bytes": written.bytes, "memory_limit": memory,
            "cpu_limit_s": cpu_seconds, "wall_s": run.wall, "cpu_s": run.cpu, "rss": run.rss,
            "vm_peak": run.vm_peak,
            "verdict": verdict, "within": run.returncode == 0}


def phases(path: Path) -> dict[str, Any]:
    run = run_child([sys.executable, "-c", PHASES, str(path)])
    if run.returncode != 0:
        return {"error": run.stderr.strip()[-200:]}
    return dict(json.loads(run.stdout))


def profile(path: Path, folder: Path, top: int) -> str:
    """cProfile of `gpuscope explain` on ``path``: the ``top`` functions by own time, and by total."""
    output = folder / "explain.prof"
    run = run_child([sys.executable, "-m", "cProfile", "-o", str(output), "-m", "gpuscope", "explain",
                     str(path), "--json"])
    if run.returncode != 0:
        return run.stderr
    lines = []
    for key in ("tottime", "cumulative"):
        with tempfile.TemporaryFile("w+") as text:
            stats = pstats.Stats(str(output), stream=text)
            stats.strip_dirs().sort_stats(key).print_stats(top)
            text.seek(0)
            body = text.read()
        lines.append(f"--- by {key}\n" + body[body.find("   ncalls"):].rstrip())
    output.unlink()
    return "\n".join(lines)


# ------------------------------------------------------------------ the whole


def generate(folder: Path, size: int, fmt: str, args: argparse.Namespace,
             steps: int | None = None) -> list[tuple[str, Written]]:
    """The trace(s) of ``size`` bytes of JSON (or of ``steps`` steps) in ``folder``."""
    out: list[tuple[str, Written]] = []
    label = f"{size / MB:g}MB" if steps is None else f"{steps}steps"
    started = time.perf_counter()
    if fmt in ("kineto", "both"):
        written = write_kineto(folder / f"bench_{label}.pt.trace.json", size, new_loop(args), steps)
        out.append(("kineto", written))
    if fmt in ("xspace", "both"):
        steps = out[0][1].steps if out else steps or steps_for(size)
        out.append(("xspace", write_xspace(folder / f"bench_{label}.xplane.pb", steps, new_loop(args))))
    print(f"  generated {label}: " + ", ".join(
        f"{w.path.name} ({format_size(w.bytes)}, {w.events} events, {w.steps} steps)" for _, w in out)
        + f" in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return out


def new_loop(args: argparse.Namespace) -> TrainingLoop:
    return TrainingLoop(layers=args.layers, step_ms=args.step_ms, input_share=args.input_share)


def given_trace(path: Path) -> Written:
    """A trace the user named, as the rows count it: its bytes on disk (compressed, for a .gz)."""
    return Written(path, path.stat().st_size, 0, 0)


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    config = AnalysisConfig()
    memory = args.memory_limit if args.memory_limit is not None else int(config.memory_bytes)
    results: dict[str, Any] = {"rows": [], "limit": [], "phases": []}
    for path in args.trace:
        written = given_trace(path)
        print(f"  analysing {path.name}", file=sys.stderr)
        row = measure(written, "given") | {"size": "given"}
        results["rows"].append(row | {"events": row["kept"]})
        results["limit"].append(under_limit(written, memory, int(config.cpu_seconds)))
    if not args.sizes:
        return results
    startup = generate(folder, 0, args.format, args, steps=3)  # the interpreter's start and imports
    results["rows"] += [measure(w, fmt) | {"size": "startup"} for fmt, w in startup]
    largest: list[tuple[str, Written]] = []
    for size in args.sizes:
        files = generate(folder, size, args.format, args)
        for fmt, written in files:
            print(f"  analysing {written.path.name}", file=sys.stderr)
            results["rows"].append(measure(written, fmt) | {"size": f"{size / MB:g} MB"})
            if args.profile:
                results["phases"].append({"file": written.path.name, **phases(written.path)})
        if size == min(args.sizes):
            kineto = [w for fmt, w in files if fmt == "kineto"] or [w for _, w in files]
            results["report"] = explain(kineto[0].path, as_json=False).stdout.decode()
            if args.profile:
                results["profile"] = profile(kineto[0].path, folder, args.top)
        if size == max(args.sizes):
            largest = files
        else:
            for _, written in files:
                if args.keep is None:
                    written.path.unlink()
    for _, written in largest:
        print(f"  analysing {written.path.name} under RLIMIT_AS {format_size(memory)}", file=sys.stderr)
        results["limit"].append(under_limit(written, memory, int(config.cpu_seconds)))
    return results


def print_results(results: dict[str, Any]) -> None:
    print(f"{'trace':<8} {'format':<7} {'MB':>7} {'events':>9} {'kept':>9} {'wall s':>7} {'CPU s':>7} "
          f"{'RSS MiB':>8} {'VmPeak':>7} {'events/s':>9} {'MB/s':>6}  verdict")
    for r in results["rows"]:
        rss, vm_peak = (r["rss"] or 0) / MIB, (r["vm_peak"] or 0) / MIB
        print(f"{r['size']:<8} {r['format']:<7} {r['bytes'] / MB:>7.1f} {r['events']:>9} {r['kept']:>9} "
              f"{r['wall_s']:>7.2f} {r['cpu_s']:>7.2f} {rss:>8.0f} {vm_peak:>7.0f} "
              f"{r['events_per_s']:>9.0f} {r['bytes_per_s'] / MB:>6.1f}  {r['verdict']}")
    for r in results["limit"]:
        print(f"\nthe agent's analysis child (RLIMIT_AS {format_size(r['memory_limit'])}, RLIMIT_CPU "
              f"{r['cpu_limit_s']} s, nice 10) on {Path(r['file']).name} ({r['bytes'] / MB:.0f} MB): "
              f"{'within its limits' if r['within'] else 'NOT within its limits'}: wall {r['wall_s']:.1f} s, "
              f"CPU {r['cpu_s']:.1f} s, peak RSS {(r['rss'] or 0) / MIB:.0f} MiB, peak address space "
              f"{(r['vm_peak'] or 0) / MIB:.0f} MiB, verdict {r['verdict']}")
    if results["phases"]:
        print("\nphases (one child each, seconds):")
        for p in results["phases"]:
            if "error" in p:
                print(f"  {p['file']}: {p['error']}")
            else:
                print(f"  {p['file']:<32} import {p['import']:.2f}  read {p['read']:.2f}  "
                      f"diagnose {p['diagnose']:.2f}  {p['verdict']}")
    if "report" in results:
        print("\nthe report of the smallest trace:\n" + results["report"].rstrip())
    if "profile" in results:
        print("\ncProfile of the smallest trace:\n" + results["profile"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,300", help="trace sizes, MB of uncompressed JSON")
    parser.add_argument("--format", choices=("kineto", "xspace", "both"), default="kineto")
    parser.add_argument("--keep", type=Path, help="write the traces into this folder and keep them")
    parser.add_argument("--memory-limit", type=parse_size,
                        help="RLIMIT_AS for the largest trace's run as the agent's (default: "
                             "capture.analysis.memory_bytes)")
    parser.add_argument("--input-share", type=float, default=0.3, help="of each step, in the DataLoader")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--profile", action="store_true",
                        help="time reading and diagnosing apart, and cProfile the smallest trace")
    parser.add_argument("--top", type=int, default=25, help="functions shown by --profile")
    parser.add_argument("--trace", type=Path, action="append", default=[],
                        help="also measure this trace file (repeatable)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.sizes = sorted(round(float(s) * MB) for s in args.sizes.split(",") if s.strip())
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        results = run(args, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="gpuscope-bench-") as tmp:
            results = run(args, Path(tmp))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_results(results)


if __name__ == "__main__":
    main()
