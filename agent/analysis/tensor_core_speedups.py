"""How much faster an fp32 matrix kernel runs on the tensor cores, per GPU architecture: data for the
``tensor_cores_idle`` fix, with the figures each factor comes from.

The basis is the remedy's first step, mixed precision (bf16 or fp16 operands, fp32 accumulation):
the ratio of a GPU's published dense 16-bit tensor-core throughput with fp32 accumulation to its fp32
throughput on the SIMT cores, without structured sparsity. Where one compute capability covers
datacenter and consumer parts whose ratios differ (GeForce cards run 16-bit tensor-core math with fp32
accumulation at half rate), the lower ratio is kept. TF32 (fp32 operands rounded on the tensor cores)
runs at half the 16-bit rate on the datacenter parts and at the fp32 rate on GeForce Ampere and Ada,
so it buys less: the factors are what autocast buys, not TF32.

The ratio is then halved (``EFFICIENCY``): a SIMT sgemm runs close to the fp32 peak on the shapes
where it takes time, while tensor-core GEMMs and convolutions reach about half of their far higher
peak on typical training shapes (small batch or channel counts, the fp32 epilogue, the casts around
them). The factor is the kernel's speed-up where arithmetic bounds it: a kernel bound by memory (few
channels, thin matrices) gains less, about the 2x of halving its operands' bytes, and the trace does
not say which kernels those are, so for them the estimate is an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

EFFICIENCY = 0.5  # achieved tensor-core efficiency relative to the SIMT kernel's (see above)


@dataclass(frozen=True, slots=True)
class Speedup:
    """One architecture's factor: the published ratio it rests on, and where that comes from."""

    architecture: str
    ratio: float  # dense 16-bit tensor-core (fp32 accumulate) over fp32 SIMT throughput
    source: str

    @property
    def factor(self) -> float:
        """The speed-up of an fp32 matrix kernel moved to the tensor cores (at least 1)."""
        return max(1.0, self.ratio * EFFICIENCY)


# Keyed by compute capability (major, minor); a major alone (minor -1) covers its other minors.
SPEEDUPS: dict[tuple[int, int], Speedup] = {
    (7, 0): Speedup("Volta", 8.0, "V100 SXM2: 125 TFLOPS fp16 tensor, 15.7 fp32"),
    (7, 2): Speedup("Volta (Xavier)", 8.0, "the same SM as V100: 8 tensor cores and 64 fp32 lanes each"),
    (7, 5): Speedup("Turing", 4.0, "T4: 65 TFLOPS fp16 tensor, 8.1 fp32 (8x); RTX 2080 Ti: 53.8 with "
                    "fp32 accumulation, 13.4 fp32 (4x): the lower"),
    (8, 0): Speedup("Ampere", 16.0, "A100: 312 TFLOPS bf16 dense, 19.5 fp32 (TF32: 156, 8x)"),
    (8, 6): Speedup("Ampere (GA10x)", 2.0, "A10: 125 TFLOPS bf16 dense, 31.2 fp32 (4x); RTX 3090: 71 with "
                    "fp32 accumulation, 35.6 fp32 (2x): the lower"),
    (8, 7): Speedup("Ampere (Orin)", 2.0, "the GA10x SM (two fp32 lanes per tensor-core slot): as 8.6"),
    (8, 9): Speedup("Ada", 2.0, "L40S: 362 TFLOPS bf16 dense, 91.6 fp32 (4x); RTX 4090: 165 with fp32 "
                    "accumulation, 82.6 fp32 (2x): the lower"),
    (9, 0): Speedup("Hopper", 14.8, "H100 SXM: 989 TFLOPS bf16 dense, 67 fp32; H100 PCIe: 756 and 51 "
                    "(TF32: half the bf16 rate)"),
    (10, -1): Speedup("Blackwell", 28.0, "B200: 2.25 PFLOPS bf16 dense, 80 TFLOPS fp32"),
    (12, -1): Speedup("Blackwell (GeForce, RTX PRO)", 2.0, "RTX 5090: 209.5 TFLOPS fp16 with fp32 "
                      "accumulation dense, 104.8 fp32 (2x); RTX PRO 6000: about 4x: the lower"),
}


def speedup_for(capability: tuple[int, int] | None) -> Speedup | None:
    """The factor of a compute capability, or None where the table has none (an architecture it does
    not know, or a GPU without tensor cores: before 7.0)."""
    if capability is None:
        return None
    return SPEEDUPS.get(capability) or SPEEDUPS.get((capability[0], -1))
