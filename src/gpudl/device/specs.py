"""Datasheet figures that no runtime API reports: FP32 lanes per SM, dense peak FLOP/s, and the
GPUs `gpudl plan --target` plans for (memory, links).

Peaks are the vendors' dense (not 2:4 sparse) tensor-core figures in TFLOP/s for the
SXM/OAM parts unless the name says otherwise. gpudl always prints them beside the peak it
measures itself, and quotes MFU against both: the datasheet's first, as the field does.
"""

from __future__ import annotations

from dataclasses import dataclass

# FP32 "CUDA cores" per SM by compute capability (NVIDIA architecture whitepapers).
CUDA_CORES_PER_SM = {
    (6, 0): 64, (6, 1): 128, (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128,
    (8, 7): 128, (8, 9): 128, (9, 0): 128, (10, 0): 128, (10, 3): 128, (11, 0): 128,
    (12, 0): 128, (12, 1): 128,
}

# Stream processors per compute unit on AMD GCN/CDNA/RDNA parts.
AMD_SP_PER_CU = 64

# (substring of the device name, {precision: dense TFLOP/s}); the first match wins, so
# more specific names come first.
DATASHEET_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GB200", {"fp32": 80.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0}),
    ("B200", {"fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0}),
    ("H200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0}),
    ("H100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("H800", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("GH200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("A800", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.1, "fp16": 362.1}),
    ("L40", {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0}),
    ("L4", {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0}),
    ("A10G", {"fp32": 31.2, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0}),
    ("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("RTX 6000 Ada", {"fp32": 91.1, "tf32": 182.1, "bf16": 364.2, "fp16": 364.2}),
    ("RTX 5090", {"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp16": 209.5}),
    ("RTX 4090", {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2}),
    ("RTX 3090", {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0}),
    ("V100", {"fp32": 15.7, "fp16": 125.0}),
    ("T4", {"fp32": 8.1, "fp16": 65.0}),
    ("MI355X", {"fp32": 157.3, "tf32": 1258.0, "bf16": 2516.0, "fp16": 2516.0}),
    ("MI325X", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4}),
    ("MI300X", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4}),
    ("MI250X", {"fp32": 95.7, "bf16": 383.0, "fp16": 383.0}),
    ("MI250", {"fp32": 90.5, "bf16": 362.1, "fp16": 362.1}),
    ("MI210", {"fp32": 45.3, "bf16": 181.0, "fp16": 181.0}),
]


def datasheet_tflops(name: str) -> dict[str, float]:
    """Dense datasheet peaks for a device name, or {} when the part is not in the table."""
    for key, peaks in DATASHEET_TFLOPS:
        if key.lower() in name.lower():
            return dict(peaks)
    return {}


def cuda_cores_per_sm(major: int, minor: int) -> int | None:
    return CUDA_CORES_PER_SM.get((major, minor))


@dataclass(frozen=True)
class Target:
    """A GPU one can rent, for `gpudl plan --target`: what the planner needs to know of it."""

    name: str             # how a user names it: "a100-40gb"
    device: str           # the name its driver reports (for the datasheet peaks above)
    memory_gib: float     # memory as torch reports it (a "40 GB" A100 has 39.4 GiB)
    link_gb_s: float      # GB/s between two GPUs of one node, each way (NVLink, Infinity Fabric or PCIe)
    host_gb_s: float = 25  # GB/s between the GPU and host memory, each way (its PCIe link): FSDP's CPU offload


# Node-internal links: NVLink 4 (H100/H200) 450 GB/s each way, NVLink 3 (A100) 300, NVLink 2 (V100) 150,
# Infinity Fabric (MI300X) 448; PCIe 4 x16 about 25 GB/s in practice, PCIe 5 about 50, PCIe 3 about 12.
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("h200", "H200", 140.4, 450, 50), Target("h100-80gb", "H100 SXM", 79.1, 450, 50),
    Target("h100-pcie", "H100 PCIe", 79.1, 50, 50), Target("a100-80gb", "A100-SXM4-80GB", 79.2, 300),
    Target("a100-40gb", "A100-SXM4-40GB", 39.4, 300), Target("l40s", "L40S", 44.4, 25),
    Target("l4", "L4", 22.0, 25), Target("a10g", "A10G", 22.0, 25), Target("rtx-4090", "RTX 4090", 23.6, 25),
    Target("rtx-3090", "RTX 3090", 23.6, 25), Target("v100-32gb", "V100-SXM2-32GB", 31.7, 150, 12),
    Target("t4", "T4", 14.6, 12, 12), Target("mi300x", "MI300X", 192.0, 448, 50),
)}
