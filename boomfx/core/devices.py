"""The one registry of device specs: datasheet peaks, memory, SMs, and the source of every figure.

Peaks are *dense* tensor-core figures (no "with sparsity" numbers). For GeForce cards the fp16/bf16
figure is the rate with fp32 accumulation (half of the marketing fp16-accumulate figure). Efficiency
factors (the achieved fraction of peak, per op class) are named data here, never literals inside a
formula; they are defaults that a measured kernel database supersedes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

TFLOPS = 1e12
GBPS = 1e9
GiB = 1024 ** 3
GB = 1000 ** 3
MiB = 1024 ** 2

# Default achieved fractions of peak by op class, used only by the analytic (roofline) model.
DEFAULT_EFFICIENCY: Mapping[str, float] = {
    "matmul": 0.70,      # large cuBLAS GEMMs reach 70-80% of dense peak
    "conv": 0.55,        # cuDNN convolutions, implicit GEMM
    "attention": 0.50,   # flash/efficient attention kernels
    "memory": 0.80,      # streaming elementwise / reductions vs. datasheet bandwidth
}


class UnknownDeviceError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


@dataclass(frozen=True)
class DeviceSpec:
    """One device. Units are in the names: ``_flops_per_s``, ``_bytes_per_s``, ``_bytes``, ``_ns``."""

    name: str
    kind: str                                   # "cuda" or "cpu"
    description: str
    peak_flops_per_s: Mapping[torch.dtype, float]   # dense; float32 entry = non-tensor-core FP32
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    sm_count: int = 0
    l2_bytes: int = 0
    tf32_flops_per_s: float = 0.0               # used for fp32 matmuls when TF32 is enabled
    kernel_launch_ns: float = 2_500.0           # GPU-side minimum time of one kernel
    host_issue_ns: float = 6_000.0              # CPU time eager PyTorch spends issuing one op
    efficiency: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    compute_capability: tuple[int, int] = (0, 0)
    memory_type: str = ""                       # datasheet DRAM technology, e.g. "HBM2e", "GDDR6"
    aliases: tuple[str, ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict)

    def peak_for(self, dtype: torch.dtype, tensor_op: bool = True) -> float:
        """Dense peak FLOP/s for ``dtype``; low-precision dtypes without a figure fall back to fp32."""
        if tensor_op and dtype in self.peak_flops_per_s:
            return self.peak_flops_per_s[dtype]
        return self.peak_flops_per_s[torch.float32]

    @property
    def supports_flash_attention(self) -> bool:
        """PyTorch's flash SDPA kernel needs sm80+ (and fp16/bf16 inputs)."""
        return self.kind == "cuda" and self.compute_capability >= (8, 0)

    @property
    def memory_class(self) -> str:
        """"hbm" or "gddr": stacked HBM reaches a larger share of its datasheet bandwidth than GDDR on
        streaming kernels (the public measurements: 1.08-1.16x datasheet time on V100/A100, 1.28-1.33x on
        T4/L4/P4), so a GPU without measurements borrows the efficiency of its class."""
        kind = self.memory_type.lower()
        return "hbm" if kind.startswith("hbm") else "gddr" if kind.startswith("gddr") else ""

    @property
    def supports_mem_efficient_attention(self) -> bool:
        return self.kind == "cuda" and self.compute_capability >= (5, 0)


def _gpu(name: str, desc: str, *, fp32: float, fp16: float, bf16: Optional[float], tf32: float,
         bw_gbps: float, mem: int, sms: int, l2_mib: float, cc: tuple[int, int], memory_type: str,
         aliases: tuple[str, ...], source: str) -> DeviceSpec:
    peaks: dict[torch.dtype, float] = {torch.float32: fp32 * TFLOPS, torch.float16: fp16 * TFLOPS}
    if bf16 is not None:
        peaks[torch.bfloat16] = bf16 * TFLOPS
    return DeviceSpec(
        name=name, kind="cuda", description=desc, peak_flops_per_s=peaks,
        memory_bandwidth_bytes_per_s=bw_gbps * GBPS, memory_bytes=mem, sm_count=sms,
        l2_bytes=int(l2_mib * MiB), tf32_flops_per_s=tf32 * TFLOPS, compute_capability=cc,
        memory_type=memory_type, aliases=aliases,
        sources={"all": source},
    )


_NV = "NVIDIA datasheet"
GPUS: tuple[DeviceSpec, ...] = (
    _gpu("v100-32gb", "NVIDIA V100 SXM2 32 GB", fp32=15.7, fp16=125, bf16=None, tf32=0, bw_gbps=900,
         mem=32 * GiB, sms=80, l2_mib=6, cc=(7, 0), memory_type="HBM2", aliases=("v100", "v100-sxm2"),
         source=f"{_NV} Tesla V100 (SXM2): 15.7 TF fp32, 125 TF tensor, 900 GB/s; Volta whitepaper: 80 SMs, 6 MB L2"),
    _gpu("v100-pcie-32gb", "NVIDIA V100 PCIe 32 GB", fp32=14, fp16=112, bf16=None, tf32=0, bw_gbps=900,
         mem=32 * GiB, sms=80, l2_mib=6, cc=(7, 0), memory_type="HBM2", aliases=("v100-pcie",),
         source=f"{_NV} Tesla V100 (PCIe): 14 TF fp32, 112 TF tensor, 900 GB/s"),
    _gpu("p100", "NVIDIA P100 PCIe 16 GB", fp32=9.3, fp16=18.7, bf16=None, tf32=0, bw_gbps=732,
         mem=16 * GiB, sms=56, l2_mib=4, cc=(6, 0), memory_type="HBM2", aliases=("p100-pcie",),
         source=f"{_NV} Tesla P100 PCIe: 9.3 TF fp32, 18.7 TF fp16, 732 GB/s; 56 SMs, 4 MB L2"),
    _gpu("p4", "NVIDIA P4 8 GB", fp32=5.5, fp16=5.5, bf16=None, tf32=0, bw_gbps=192, mem=8 * GiB, sms=20,
         l2_mib=2, cc=(6, 1), memory_type="GDDR5", aliases=(),
         source=f"{_NV} Tesla P4: 5.5 TF fp32, 192 GB/s; 20 SMs, 2 MB L2"),
    _gpu("t4", "NVIDIA T4 16 GB", fp32=8.1, fp16=65, bf16=None, tf32=0, bw_gbps=320, mem=16 * GiB, sms=40,
         l2_mib=4, cc=(7, 5), memory_type="GDDR6", aliases=(),
         source=f"{_NV} T4: 8.1 TF fp32, 65 TF fp16 tensor, 320 GB/s; Turing whitepaper: 40 SMs, 4 MB L2"),
    _gpu("a10", "NVIDIA A10 24 GB", fp32=31.2, fp16=125, bf16=125, tf32=62.5, bw_gbps=600, mem=24 * GiB,
         sms=72, l2_mib=6, cc=(8, 6), memory_type="GDDR6", aliases=("a10g",),
         source=f"{_NV} A10: 31.2 TF fp32, 62.5 TF tf32, 125 TF bf16/fp16 dense, 600 GB/s; GA102: 72 SMs, 6 MB L2"),
    _gpu("l4", "NVIDIA L4 24 GB", fp32=30.3, fp16=121, bf16=121, tf32=60, bw_gbps=300, mem=24 * GiB, sms=58,
         l2_mib=48, cc=(8, 9), memory_type="GDDR6", aliases=(),
         source=f"{_NV} L4: 30.3 TF fp32, 120 TF tf32 / 242 TF bf16 *with sparsity* (halved here), 300 GB/s; "
                "58 SMs, 48 MB L2"),
    _gpu("a100-40gb", "NVIDIA A100 SXM4 40 GB", fp32=19.5, fp16=312, bf16=312, tf32=156, bw_gbps=1555,
         mem=40 * GiB, sms=108, l2_mib=40, cc=(8, 0), memory_type="HBM2", aliases=("a100", "a100-sxm4-40gb"),
         source=f"{_NV} A100: 19.5 TF fp32, 156 TF tf32, 312 TF bf16 dense, 1555 GB/s (40 GB); 108 SMs, 40 MB L2"),
    _gpu("a100-80gb", "NVIDIA A100 SXM4 80 GB", fp32=19.5, fp16=312, bf16=312, tf32=156, bw_gbps=2039,
         mem=80 * GiB, sms=108, l2_mib=40, cc=(8, 0), memory_type="HBM2e", aliases=("a100-sxm4-80gb",),
         source=f"{_NV} A100 80GB SXM: 2039 GB/s; compute as A100 40 GB"),
    _gpu("a100-pcie-40gb", "NVIDIA A100 PCIe 40 GB", fp32=19.5, fp16=312, bf16=312, tf32=156, bw_gbps=1555,
         mem=40 * GiB, sms=108, l2_mib=40, cc=(8, 0), memory_type="HBM2", aliases=(),
         source=f"{_NV} A100 PCIe 40 GB: 1555 GB/s"),
    _gpu("a100-pcie-80gb", "NVIDIA A100 PCIe 80 GB", fp32=19.5, fp16=312, bf16=312, tf32=156, bw_gbps=1935,
         mem=80 * GiB, sms=108, l2_mib=40, cc=(8, 0), memory_type="HBM2e", aliases=(),
         source=f"{_NV} A100 80GB PCIe: 1935 GB/s"),
    _gpu("h100-sxm", "NVIDIA H100 SXM5 80 GB", fp32=66.9, fp16=989.4, bf16=989.4, tf32=494.7, bw_gbps=3350,
         mem=80 * GiB, sms=132, l2_mib=50, cc=(9, 0), memory_type="HBM3",
         aliases=("h100", "h100-80gb", "h100-sxm5"),
         source=f"{_NV} H100 SXM: 67 TF fp32, 989 TF tf32/1979 TF bf16 *with sparsity* (halved here), 3.35 TB/s; "
                "Hopper whitepaper: 132 SMs, 50 MB L2"),
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80 GB", fp32=51.2, fp16=756.5, bf16=756.5, tf32=378, bw_gbps=2000,
         mem=80 * GiB, sms=114, l2_mib=50, cc=(9, 0), memory_type="HBM2e", aliases=(),
         source=f"{_NV} H100 PCIe: 51 TF fp32, 756 TF bf16 dense, 2.0 TB/s; 114 SMs, 50 MB L2"),
    _gpu("h200", "NVIDIA H200 SXM 141 GB", fp32=66.9, fp16=989.4, bf16=989.4, tf32=494.7, bw_gbps=4800,
         mem=141 * GB, sms=132, l2_mib=50, cc=(9, 0), memory_type="HBM3e", aliases=("h200-sxm",),
         source=f"{_NV} H200: 141 GB HBM3e, 4.8 TB/s; compute as H100 SXM"),
    _gpu("rtx-3090", "NVIDIA GeForce RTX 3090 24 GB", fp32=35.6, fp16=71, bf16=71, tf32=35.6, bw_gbps=936,
         mem=24 * GiB, sms=82, l2_mib=6, cc=(8, 6), memory_type="GDDR6X", aliases=("3090", "rtx3090"),
         source="NVIDIA Ampere GA102 whitepaper: 35.6 TF fp32, 71 TF fp16/bf16 tensor with fp32 accumulate "
                "(142 with fp16 accumulate), 35.6 TF tf32, 936 GB/s, 82 SMs, 6 MB L2"),
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24 GB", fp32=82.6, fp16=165.2, bf16=165.2, tf32=82.6,
         bw_gbps=1008, mem=24 * GiB, sms=128, l2_mib=72, cc=(8, 9), memory_type="GDDR6X",
         aliases=("4090", "rtx4090"),
         source="NVIDIA Ada AD102 whitepaper: 82.6 TF fp32, 165.2 TF fp16/bf16 tensor with fp32 accumulate "
                "(330 with fp16 accumulate), 1008 GB/s, 128 SMs, 72 MB L2"),
)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def cpu_spec() -> DeviceSpec:
    """This host as a device. Its analytic peaks are rough; a measured database should price CPU runs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # NB: 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOPs x ~2.5 GHz per core; bandwidth a typical DDR4 channel pair.
    fp32 = cores * 2 * 8 * 2 * 2.5e9
    return DeviceSpec(
        name="cpu", kind="cpu", description=f"this host's CPU ({cores} cores)",
        peak_flops_per_s={torch.float32: fp32, torch.bfloat16: fp32 / 2, torch.float16: fp32 / 4},
        memory_bandwidth_bytes_per_s=20 * GBPS, memory_bytes=_host_memory_bytes(),
        kernel_launch_ns=0.0, host_issue_ns=4_000.0,
        efficiency={"matmul": 0.5, "conv": 0.3, "attention": 0.3, "memory": 0.5},
        sources={"all": "nominal AVX2 FMA rate x cores; 20 GB/s assumed DRAM bandwidth; memory from sysconf"},
    )


def list_devices() -> list[DeviceSpec]:
    return list(GPUS) + [cpu_spec()]


def get_device(name: str) -> DeviceSpec:
    """Look a device up by name or alias (case-insensitive; '_' and ' ' read as '-')."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key == "cpu":
        return cpu_spec()
    for spec in GPUS:
        if key == spec.name or key in spec.aliases:
            return spec
    known = ", ".join(s.name for s in list_devices())
    raise UnknownDeviceError(f"unknown device '{name}' (known: {known})")
