"""PyTorch training jobs with a known bottleneck, for bench/gpu_scenarios.py (not run by themselves).

    python bench/gpu_jobs/torch_jobs.py JOB [--tiny] [--max-seconds S]

Each runs forever on ``cuda:0`` (``--tiny``: small sizes on the CPU) and prints its step time and
"ready" as bench/gpu_jobs/job_loop.py describes. Started with ``KINETO_USE_DAEMON=1`` (and
``KINETO_IPC_SOCKET_DIR``) in its environment, it checks in with the agent's Kineto daemon, so the
agent can capture it. There is no ``torch.profiler`` in them: the agent's capture is the only one.

* ``healthy_mlp_bf16``: 8 x Linear(4096)+GELU, batch 8192, bf16 autocast, AdamW (foreach), data on
  the device, nothing that waits for the device in the step: the device never waits.
* ``seg_masked_loss``: a segmentation toy (12 Conv2d of 10 channels, batch 64 of 3x256x256) whose loss
  drops the "background" class with torch.nonzero and an index assignment, checks torch.unique,
  and masks logits and targets with a boolean mask: each of these reads a size back from the device
  (a host-device synchronisation). The convolutions are fp32 with 10 channels.
* ``seg_fixed_loss``: the same model, with the loss written without read-backs: torch.where, a sort
  and count_nonzero for the number of classes, cross_entropy with ignore_index.
* ``resnet50_dataloader_no_workers``: torchvision's ResNet-50 (a small CNN when torchvision is not
  installed), batch 64, fed by a DataLoader with num_workers=0 whose per-sample NumPy work (crop,
  flip, blur, normalise) takes longer than the device's step.
* ``deep_narrow_mlp``: 96 x Linear(128)+ReLU, batch 16, SGD: some 580 tiny kernels a step, each
  shorter than its launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from job_loop import CudaEventClock, WallClock, exit_with_parent, info, job_arguments, run_forever

JOBS = ("healthy_mlp_bf16", "seg_masked_loss", "seg_fixed_loss", "resnet50_dataloader_no_workers",
        "deep_narrow_mlp")
NUM_CLASSES = 10  # segmentation classes; the last one is "background"
IGNORE = -1


def amp_dtype(torch: Any, device: Any) -> Any:
    """bf16 where the device computes in it (CPUs, NVIDIA GPUs from Ampere on), else fp16."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0):
        return torch.bfloat16
    return torch.float16


# ----------------------------------------------------------------- healthy_mlp_bf16


def healthy_mlp_bf16(torch: Any, device: Any, tiny: bool) -> Callable[[], None]:
    width, batch = (64, 64) if tiny else (4096, 8192)
    layers: list[Any] = []
    for _ in range(8):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    inputs = torch.randn(batch, width, device=device)
    targets = torch.randn(batch, width, device=device)
    dtype = amp_dtype(torch, device)
    info("precision", f"autocast {str(dtype).removeprefix('torch.')}")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            out = model(inputs)
        loss = torch.nn.functional.mse_loss(out.float(), targets)
        loss.backward()
        optimizer.step()  # the loss is never read back: nothing here waits for the device

    return step


# ----------------------------------------------------------------- the segmentation toy


def seg_net(torch: Any) -> Any:
    """12 convolutions of 10 channels; in-place ReLUs keep batch 64 of 256x256 within a few GiB."""
    nn = torch.nn
    hidden: list[Any] = []
    for _ in range(10):
        hidden += [nn.Conv2d(10, 10, 3, padding="same"), nn.ReLU(inplace=True)]
    return nn.Sequential(nn.Conv2d(3, 10, 3, padding="same"), nn.ReLU(inplace=True), *hidden,
                         nn.Conv2d(10, NUM_CLASSES, 3, padding="same"))


def masked_loss(torch: Any, logits: Any, labels: Any) -> Any:
    """Background pixels ignored with the operations whose output size depends on the data."""
    target = labels.clone()
    background = torch.nonzero(target == NUM_CLASSES - 1, as_tuple=True)  # reads the count back
    target[background] = IGNORE
    classes = torch.unique(target)  # reads the count back
    mask = target != IGNORE
    per_pixel = logits.permute(0, 2, 3, 1)
    masked_target = target[mask]  # boolean mask: a nonzero, which reads the count back
    masked_logits = per_pixel[mask.unsqueeze(-1).expand(-1, -1, -1, NUM_CLASSES)]  # and again
    loss = torch.nn.functional.cross_entropy(masked_logits.reshape(-1, NUM_CLASSES), masked_target)
    if classes.numel() < 2:  # a host-side size, known since unique returned
        loss = loss * 0.0
    return loss


def fixed_loss(torch: Any, logits: Any, labels: Any) -> Any:
    """The same loss with every size fixed in advance: nothing is read back."""
    target = torch.where(labels == NUM_CLASSES - 1, torch.full_like(labels, IGNORE), labels)
    ordered, _ = torch.sort(target.flatten())
    classes = torch.count_nonzero(ordered[1:] != ordered[:-1]) + 1
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE)
    return torch.where(classes < 2, loss * 0.0, loss)


def segmentation(torch: Any, device: Any, tiny: bool, fixed: bool) -> Callable[[], None]:
    batch, size = (2, 64) if tiny else (64, 256)
    model = seg_net(torch).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    images = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, NUM_CLASSES, (batch, size, size), device=device)
    loss_of = fixed_loss if fixed else masked_loss

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(torch, model(images), labels)
        loss.backward()
        optimizer.step()

    return step


# ----------------------------------------------------------------- resnet50_dataloader_no_workers


def image_model(torch: Any, tiny: bool) -> Any:
    """torchvision's ResNet-50; a small CNN for a tiny run or without torchvision."""
    if not tiny:
        try:
            import torchvision
        except ImportError:
            pass
        else:
            info("model", f"torchvision {torchvision.__version__} resnet50")
            return torchvision.models.resnet50(num_classes=1000)
    info("model", "small CNN" if tiny else "small CNN (torchvision is not importable)")
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.BatchNorm2d(128), nn.ReLU(),
                         nn.Conv2d(128, 256, 3, stride=2, padding=1), nn.BatchNorm2d(256), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 1000))


def resnet50_dataloader_no_workers(torch: Any, device: Any, tiny: bool) -> Callable[[], None]:
    from torch.utils.data import DataLoader, Dataset

    batch, size = (8, 32) if tiny else (64, 224)
    model = image_model(torch, tiny).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dtype = amp_dtype(torch, device)
    info("precision", f"autocast {str(dtype).removeprefix('torch.')}")
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)

    class Images(Dataset[tuple[Any, int]]):
        """Decoding and augmenting one image in NumPy, as a simple image pipeline does per sample."""

        def __len__(self) -> int:
            return 1 << 40  # endless: the sampler walks it lazily

        def __getitem__(self, index: int) -> tuple[Any, int]:
            rng = np.random.default_rng(index)
            image = rng.integers(0, 256, (size + 32, size + 32, 3), dtype=np.uint8)  # "decoded"
            top, left = rng.integers(0, 32, 2)
            crop = image[top:top + size, left:left + size].astype(np.float32) / 255.0
            if rng.random() < 0.5:
                crop = crop[:, ::-1]
            for _ in range(3):  # a box blur, three passes: the pipeline's expensive augmentation
                crop = (crop + np.roll(crop, 1, 0) + np.roll(crop, -1, 0) + np.roll(crop, 1, 1)
                        + np.roll(crop, -1, 1)) / 5.0
            chw = np.ascontiguousarray(((crop - mean) / std).transpose(2, 0, 1))
            return torch.from_numpy(chw), int(index % 1000)

    batches = iter(DataLoader(Images(), batch_size=batch, num_workers=0))

    def step() -> None:
        images, labels = next(batches)  # the DataLoader's __next__: the whole batch made here
        images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
        labels = labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    return step


# ----------------------------------------------------------------- deep_narrow_mlp


def deep_narrow_mlp(torch: Any, device: Any, tiny: bool) -> Callable[[], None]:
    depth = 24 if tiny else 96  # a tiny run keeps the CPU trace small
    layers: list[Any] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(128, 128), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(16, 128, device=device)
    targets = torch.randn(16, 128, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()

    return step


def main() -> None:
    args = job_arguments(__doc__.splitlines()[0], JOBS)
    exit_with_parent(args.max_seconds)
    import torch

    torch.manual_seed(0)
    if args.tiny:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # the dry run shares a small machine with the agent
    else:
        if not torch.cuda.is_available():
            raise SystemExit(f"torch {torch.__version__} sees no CUDA device (torch.version.cuda: "
                             f"{torch.version.cuda})")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        info("device", torch.cuda.get_device_name(device))
    info("torch", torch.__version__)
    if args.job in ("seg_masked_loss", "seg_fixed_loss"):
        step = segmentation(torch, device, args.tiny, fixed=args.job == "seg_fixed_loss")
    else:
        step = globals()[args.job](torch, device, args.tiny)
    run_forever(step, lambda: CudaEventClock(torch) if device.type == "cuda" else WallClock())


if __name__ == "__main__":
    main()
