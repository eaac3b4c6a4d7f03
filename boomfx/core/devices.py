"""The one registry of device specs: datasheet peaks, memory, SMs, and the source of every figure.

Peaks are *dense* tensor-core figures (no "with sparsity" numbers). For GeForce cards the fp16/bf16
figure is the rate with fp32 accumulation (half of the marketing fp16-accumulate figure). Efficiency
factors (the achieved fraction of peak, per op class) are named data here, never literals inside a
formula; they are defaults that a measured kernel database supersedes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
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
    # Interconnect (collective time model, kernels_db/collective_model.py); sources["interconnect"] says where
    # each figure comes from. NVLink bandwidth is per GPU and per direction, all links together.
    nvlink_bytes_per_s: float = 0.0
    nvlink_generation: int = 0                  # 0: no NVLink
    nvswitch: bool = False                      # all GPUs of a node reach each other at full NVLink rate
    nvlink_bridge: bool = False                 # NVLink only joins pairs of boards (PCIe cards with a bridge);
                                                # neither flag: a mesh whose NVLink rings span the board (DGX-1)
    pcie_generation: int = 0                    # host link of the board (x16)
    gpus_per_node: int = 1                      # GPUs of the usual server / board this part sits in

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


FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def _gpu(name: str, desc: str, *, fp32: float, fp16: float, bf16: Optional[float], tf32: float,
         bw_gbps: float, mem: int, sms: int, l2_mib: float, cc: tuple[int, int], memory_type: str,
         aliases: tuple[str, ...], source: str, fp8: Optional[float] = None) -> DeviceSpec:
    peaks: dict[torch.dtype, float] = {torch.float32: fp32 * TFLOPS, torch.float16: fp16 * TFLOPS}
    if bf16 is not None:
        peaks[torch.bfloat16] = bf16 * TFLOPS
    if fp8 is not None:   # dense fp8 tensor-core rate with fp32 accumulation (what torch._scaled_mm runs)
        peaks.update({dtype: fp8 * TFLOPS for dtype in FP8_DTYPES})
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
         l2_mib=48, cc=(8, 9), memory_type="GDDR6", aliases=(), fp8=242.5,   # 485 TF fp8 with sparsity
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
         aliases=("h100", "h100-80gb", "h100-sxm5"), fp8=1978.9,   # datasheet 3958 TF fp8 with sparsity
         source=f"{_NV} H100 SXM: 67 TF fp32, 989 TF tf32/1979 TF bf16 *with sparsity* (halved here), 3.35 TB/s; "
                "Hopper whitepaper: 132 SMs, 50 MB L2"),
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80 GB", fp32=51.2, fp16=756.5, bf16=756.5, tf32=378, bw_gbps=2000,
         mem=80 * GiB, sms=114, l2_mib=50, cc=(9, 0), memory_type="HBM2e", aliases=(),
         fp8=1513,   # datasheet 3026 TF fp8 with sparsity
         source=f"{_NV} H100 PCIe: 51 TF fp32, 756 TF bf16 dense, 2.0 TB/s; 114 SMs, 50 MB L2"),
    _gpu("h200", "NVIDIA H200 SXM 141 GB", fp32=66.9, fp16=989.4, bf16=989.4, tf32=494.7, bw_gbps=4800,
         mem=141 * GB, sms=132, l2_mib=50, cc=(9, 0), memory_type="HBM3e", aliases=("h200-sxm",),
         fp8=1978.9,   # datasheet 3958 TF fp8 with sparsity
         source=f"{_NV} H200: 141 GB HBM3e, 4.8 TB/s; compute as H100 SXM"),
    _gpu("rtx-3090", "NVIDIA GeForce RTX 3090 24 GB", fp32=35.6, fp16=71, bf16=71, tf32=35.6, bw_gbps=936,
         mem=24 * GiB, sms=82, l2_mib=6, cc=(8, 6), memory_type="GDDR6X", aliases=("3090", "rtx3090"),
         source="NVIDIA Ampere GA102 whitepaper: 35.6 TF fp32, 71 TF fp16/bf16 tensor with fp32 accumulate "
                "(142 with fp16 accumulate), 35.6 TF tf32, 936 GB/s, 82 SMs, 6 MB L2"),
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24 GB", fp32=82.6, fp16=165.2, bf16=165.2, tf32=82.6,
         bw_gbps=1008, mem=24 * GiB, sms=128, l2_mib=72, cc=(8, 9), memory_type="GDDR6X",
         aliases=("4090", "rtx4090"), fp8=165.2,   # Ada whitepaper: fp8 with fp32 accumulate, dense
         source="NVIDIA Ada AD102 whitepaper: 82.6 TF fp32, 165.2 TF fp16/bf16 tensor with fp32 accumulate "
                "(330 with fp16 accumulate), 1008 GB/s, 128 SMs, 72 MB L2"),
    # ---- data-centre and workstation boards people rent (issue 16, item 6). Dense tensor-core peaks;
    # professional (non-GeForce) boards run fp16/bf16 with fp32 accumulation at the full rate.
    _gpu("l40s", "NVIDIA L40S 48 GB", fp32=91.6, fp16=362.05, bf16=362.05, tf32=183, bw_gbps=864,
         mem=48 * GB, sms=142, l2_mib=96, cc=(8, 9), memory_type="GDDR6", aliases=("l40s-48gb",), fp8=733,
         source="NVIDIA L40S datasheet: 91.6 TF fp32, 183 TF tf32 / 362.05 TF bf16 / 733 TF fp8 dense "
                "(366/733/1466 with sparsity), 864 GB/s GDDR6, 48 GB, 350 W; Ada whitepaper (AD102): 142 SMs, "
                "96 MB L2"),
    _gpu("l40", "NVIDIA L40 48 GB", fp32=90.5, fp16=181.05, bf16=181.05, tf32=90.5, bw_gbps=864,
         mem=48 * GB, sms=142, l2_mib=96, cc=(8, 9), memory_type="GDDR6", aliases=(), fp8=362,
         source="NVIDIA L40 datasheet: 90.5 TF fp32, 90.5 TF tf32 / 181.05 TF bf16 / 362 TF fp8 dense "
                "(181/362/724 with sparsity), 864 GB/s GDDR6, 48 GB, 300 W; AD102: 142 SMs, 96 MB L2"),
    _gpu("a40", "NVIDIA A40 48 GB", fp32=37.4, fp16=149.7, bf16=149.7, tf32=74.8, bw_gbps=696,
         mem=48 * GB, sms=84, l2_mib=6, cc=(8, 6), memory_type="GDDR6", aliases=(),
         source="NVIDIA A40 datasheet: 37.4 TF fp32, 74.8 TF tf32 / 149.7 TF bf16 dense (149.6/299.4 with "
                "sparsity), 696 GB/s GDDR6, 48 GB, 300 W; Ampere GA102 whitepaper: 84 SMs, 6 MB L2"),
    _gpu("a30", "NVIDIA A30 24 GB", fp32=10.3, fp16=165, bf16=165, tf32=82, bw_gbps=933,
         mem=24 * GB, sms=56, l2_mib=24, cc=(8, 0), memory_type="HBM2", aliases=(),
         source="NVIDIA A30 datasheet: 10.3 TF fp32, 82 TF tf32 / 165 TF bf16 dense (165/330 with sparsity), "
                "933 GB/s HBM2, 24 GB, 165 W; GA100: 56 SMs enabled, 24 MB L2"),
    _gpu("rtx-a6000", "NVIDIA RTX A6000 48 GB", fp32=38.7, fp16=154.8, bf16=154.8, tf32=77.4, bw_gbps=768,
         mem=48 * GB, sms=84, l2_mib=6, cc=(8, 6), memory_type="GDDR6", aliases=("a6000",),
         source="NVIDIA RTX A6000 datasheet: 38.7 TF fp32, 309.7 TF tensor with sparsity (154.8 dense bf16/fp16, "
                "77.4 dense tf32), 768 GB/s GDDR6, 48 GB, 300 W; GA102: 84 SMs, 6 MB L2"),
    _gpu("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation 48 GB", fp32=91.1, fp16=364.25, bf16=364.25,
         tf32=182.1, bw_gbps=960, mem=48 * GB, sms=142, l2_mib=96, cc=(8, 9), memory_type="GDDR6",
         aliases=("rtx6000-ada", "6000-ada"), fp8=728.5,
         source="NVIDIA RTX 6000 Ada datasheet: 91.1 TF fp32, 1457 TF fp8 tensor with sparsity (728.5 dense "
                "fp8, 364.25 dense bf16/fp16, 182.1 dense tf32), 960 GB/s GDDR6, 48 GB, 300 W; AD102: 142 SMs, "
                "96 MB L2"),
    _gpu("h20", "NVIDIA H20 96 GB", fp32=44, fp16=148, bf16=148, tf32=74, bw_gbps=4000, mem=96 * GB, sms=78,
         l2_mib=60, cc=(9, 0), memory_type="HBM3", aliases=(), fp8=296,
         source="NVIDIA H20 product brief: 44 TF fp32, 74 TF tf32 / 148 TF bf16 / 296 TF fp8 dense, 4.0 TB/s "
                "HBM3, 96 GB, 400 W; 78 SMs, 60 MB L2"),
    # NB: fp32 75 TF is the HGX B200 datasheet's 600 TF fp32 over 8 GPUs.
    _gpu("b200", "NVIDIA B200 SXM 180 GB", fp32=75, fp16=2250, bf16=2250, tf32=1100, bw_gbps=8000,
         mem=180 * GB, sms=148, l2_mib=126, cc=(10, 0), memory_type="HBM3e", aliases=("b200-sxm",), fp8=4500,
         source="NVIDIA HGX B200 datasheet (per GPU): 2.25 PF bf16 / 4.5 PF fp8 / 1.1 PF tf32 dense (half the "
                "'with sparsity' figures), 75 TF fp32, 180 GB HBM3e at 8 TB/s, 1000 W; Blackwell whitepaper: "
                "148 SMs, 126 MB L2"),
    # ---- GeForce: fp16/bf16 tensor rates with fp32 accumulation, half the marketing fp16-accumulate figure.
    _gpu("rtx-2080-ti", "NVIDIA GeForce RTX 2080 Ti 11 GB", fp32=13.4, fp16=53.8, bf16=None, tf32=0,
         bw_gbps=616, mem=11 * GiB, sms=68, l2_mib=5.5, cc=(7, 5), memory_type="GDDR6",
         aliases=("2080ti", "rtx2080ti"),
         source="NVIDIA Turing TU102 whitepaper (reference clocks): 13.4 TF fp32, 53.8 TF fp16 tensor with fp32 "
                "accumulate (107.6 with fp16 accumulate), 616 GB/s, 68 SMs, 5.5 MB L2; no bf16"),
    _gpu("rtx-3060", "NVIDIA GeForce RTX 3060 12 GB", fp32=12.7, fp16=25.4, bf16=25.4, tf32=12.7,
         bw_gbps=360, mem=12 * GiB, sms=28, l2_mib=3, cc=(8, 6), memory_type="GDDR6", aliases=("3060",),
         source="NVIDIA GeForce RTX 3060 specifications + Ampere GA10x whitepaper rates per SM: 28 SMs at "
                "1777 MHz boost: 12.7 TF fp32, 25.4 TF fp16 tensor with fp32 accumulate (50.8 with fp16 "
                "accumulate), 360 GB/s, 3 MB L2"),
    _gpu("rtx-3070", "NVIDIA GeForce RTX 3070 8 GB", fp32=20.3, fp16=40.6, bf16=40.6, tf32=20.3,
         bw_gbps=448, mem=8 * GiB, sms=46, l2_mib=4, cc=(8, 6), memory_type="GDDR6", aliases=("3070",),
         source="NVIDIA Ampere GA10x whitepaper (RTX 3070): 46 SMs, 20.3 TF fp32, 40.6 TF fp16 tensor with "
                "fp32 accumulate (81.3 with fp16 accumulate), 448 GB/s, 4 MB L2"),
    _gpu("rtx-3080", "NVIDIA GeForce RTX 3080 10 GB", fp32=29.8, fp16=59.5, bf16=59.5, tf32=29.8,
         bw_gbps=760, mem=10 * GiB, sms=68, l2_mib=5, cc=(8, 6), memory_type="GDDR6X", aliases=("3080",),
         source="NVIDIA Ampere GA102 whitepaper (RTX 3080): 68 SMs, 29.8 TF fp32, 59.5 TF fp16 tensor with "
                "fp32 accumulate (119 with fp16 accumulate), 760 GB/s, 5 MB L2"),
    _gpu("rtx-3080-ti", "NVIDIA GeForce RTX 3080 Ti 12 GB", fp32=34.1, fp16=68.2, bf16=68.2, tf32=34.1,
         bw_gbps=912, mem=12 * GiB, sms=80, l2_mib=6, cc=(8, 6), memory_type="GDDR6X", aliases=("3080ti",),
         source="NVIDIA GeForce RTX 3080 Ti specifications + GA102 rates per SM: 80 SMs at 1665 MHz: 34.1 TF "
                "fp32, 68.2 TF fp16 tensor with fp32 accumulate, 912 GB/s, 6 MB L2"),
    _gpu("rtx-4060", "NVIDIA GeForce RTX 4060 8 GB", fp32=15.1, fp16=30.2, bf16=30.2, tf32=15.1,
         bw_gbps=272, mem=8 * GiB, sms=24, l2_mib=24, cc=(8, 9), memory_type="GDDR6", aliases=("4060",),
         fp8=30.2,
         source="NVIDIA GeForce RTX 4060 specifications (242 AI TOPS = fp8 sparse, fp16 accumulate) + Ada "
                "rates per SM: 24 SMs at 2460 MHz: 15.1 TF fp32, 30.2 TF fp16/bf16 and fp8 tensor with fp32 "
                "accumulate, 272 GB/s, 24 MB L2"),
    _gpu("rtx-4070", "NVIDIA GeForce RTX 4070 12 GB", fp32=29.1, fp16=58.3, bf16=58.3, tf32=29.1,
         bw_gbps=504, mem=12 * GiB, sms=46, l2_mib=36, cc=(8, 9), memory_type="GDDR6X", aliases=("4070",),
         fp8=58.3,
         source="NVIDIA GeForce RTX 4070 specifications (466 AI TOPS) + Ada rates per SM: 46 SMs at 2475 MHz: "
                "29.1 TF fp32, 58.3 TF fp16/bf16 and fp8 tensor with fp32 accumulate, 504 GB/s, 36 MB L2"),
    _gpu("rtx-4080", "NVIDIA GeForce RTX 4080 16 GB", fp32=48.7, fp16=97.5, bf16=97.5, tf32=48.7,
         bw_gbps=716.8, mem=16 * GiB, sms=76, l2_mib=64, cc=(8, 9), memory_type="GDDR6X", aliases=("4080",),
         fp8=97.5,
         source="NVIDIA Ada AD103 whitepaper (RTX 4080): 76 SMs, 48.7 TF fp32, 97.5 TF fp16/bf16 tensor with "
                "fp32 accumulate (194.9 with fp16 accumulate), 716.8 GB/s, 64 MB L2"),
    # NB: fp8 419 TF = the GB202 whitepaper's dense fp8 rate (838 TF) halved for fp32 accumulation, as the
    # fp16 figure is; not checked against a measurement.
    _gpu("rtx-5090", "NVIDIA GeForce RTX 5090 32 GB", fp32=104.8, fp16=209.5, bf16=209.5, tf32=104.8,
         bw_gbps=1792, mem=32 * GiB, sms=170, l2_mib=96, cc=(12, 0), memory_type="GDDR7", aliases=("5090",),
         fp8=419,
         source="NVIDIA Blackwell GB202 whitepaper (RTX 5090): 170 SMs, 104.8 TF fp32, 209.5 TF fp16/bf16 "
                "tensor with fp32 accumulate (419 with fp16 accumulate), 1792 GB/s GDDR7, 96 MB L2, 575 W"),
)


_GBPS_DIR = "GB/s per direction"
# Interconnect per board: NVLink per GPU and direction = links x per-link rate; NVSwitch or not; PCIe host link.
# NCCL's topology model gives a link less (src/graph/topo.h: SM80 20.0, SM90 20.6, SM100 40.1 GB/s per link):
# the collective model applies that share (kernels_db/collective_model.py, NCCL_NVLINK_USABLE).
_INTERCONNECT: Mapping[str, tuple[dict, str]] = {
    "v100-32gb": (dict(nvlink_bytes_per_s=150 * GBPS, nvlink_generation=2, nvswitch=False, pcie_generation=3,
                       gpus_per_node=8),
                  f"{_NV} V100 SXM2: NVLink2 6 links, 300 GB/s bidirectional = 150 {_GBPS_DIR}; DGX-1: hybrid "
                  "cube mesh, no NVSwitch; PCIe Gen3"),
    "v100-pcie-32gb": (dict(pcie_generation=3, gpus_per_node=8), f"{_NV} V100 PCIe: PCIe Gen3 x16, no NVLink"),
    "p100": (dict(pcie_generation=3, gpus_per_node=8), f"{_NV} P100 PCIe: PCIe Gen3 x16"),
    "p4": (dict(pcie_generation=3, gpus_per_node=4), f"{_NV} P4: PCIe Gen3 x16"),
    "t4": (dict(pcie_generation=3, gpus_per_node=8), f"{_NV} T4: PCIe Gen3 x16, no NVLink"),
    "a10": (dict(pcie_generation=4, gpus_per_node=4), f"{_NV} A10: PCIe Gen4 x16, no NVLink"),
    "l4": (dict(pcie_generation=4, gpus_per_node=8), f"{_NV} L4: PCIe Gen4 x16, no NVLink"),
    "a100-40gb": (dict(nvlink_bytes_per_s=300 * GBPS, nvlink_generation=3, nvswitch=True, pcie_generation=4,
                       gpus_per_node=8),
                  f"{_NV} A100 SXM4: NVLink3 12 links, 600 GB/s bidirectional = 300 {_GBPS_DIR}; DGX/HGX A100: "
                  "6 NVSwitches; PCIe Gen4"),
    "a100-80gb": (dict(nvlink_bytes_per_s=300 * GBPS, nvlink_generation=3, nvswitch=True, pcie_generation=4,
                       gpus_per_node=8), f"as a100-40gb: NVLink3 300 {_GBPS_DIR}, NVSwitch, PCIe Gen4"),
    "a100-pcie-40gb": (dict(nvlink_bytes_per_s=300 * GBPS, nvlink_generation=3, nvlink_bridge=True, pcie_generation=4, gpus_per_node=8),
                       f"{_NV} A100 PCIe: NVLink bridge between pairs, 600 GB/s bidirectional; PCIe Gen4"),
    "a100-pcie-80gb": (dict(nvlink_bytes_per_s=300 * GBPS, nvlink_generation=3, nvlink_bridge=True, pcie_generation=4, gpus_per_node=8),
                       f"{_NV} A100 80GB PCIe: NVLink bridge between pairs, 600 GB/s bidirectional; PCIe Gen4"),
    "h100-sxm": (dict(nvlink_bytes_per_s=450 * GBPS, nvlink_generation=4, nvswitch=True, pcie_generation=5,
                      gpus_per_node=8),
                 f"{_NV} H100 SXM: NVLink4 18 links, 900 GB/s bidirectional = 450 {_GBPS_DIR}; HGX H100: 4 "
                 "third-generation NVSwitches; PCIe Gen5"),
    "h100-pcie": (dict(nvlink_bytes_per_s=300 * GBPS, nvlink_generation=4, nvlink_bridge=True, pcie_generation=5, gpus_per_node=8),
                  f"{_NV} H100 PCIe: NVLink bridge between pairs, 600 GB/s bidirectional; PCIe Gen5"),
    "h200": (dict(nvlink_bytes_per_s=450 * GBPS, nvlink_generation=4, nvswitch=True, pcie_generation=5,
                  gpus_per_node=8), f"{_NV} H200 SXM: NVLink4 900 GB/s bidirectional = 450 {_GBPS_DIR}; HGX "
                                    "H200 NVSwitch; PCIe Gen5"),
    "b200": (dict(nvlink_bytes_per_s=900 * GBPS, nvlink_generation=5, nvswitch=True, pcie_generation=5,
                  gpus_per_node=8), f"{_NV} B200: NVLink5 18 links, 1.8 TB/s bidirectional = 900 {_GBPS_DIR}; "
                                    "HGX B200: 2 NVLink5 switch chips; PCIe Gen5"),
    "rtx-3090": (dict(nvlink_bytes_per_s=56.25 * GBPS, nvlink_generation=3, nvlink_bridge=True, pcie_generation=4, gpus_per_node=4),
                 "NVIDIA GeForce RTX 3090: NVLink bridge for two cards, 112.5 GB/s bidirectional; PCIe Gen4"),
    "rtx-4090": (dict(pcie_generation=4, gpus_per_node=4), "NVIDIA GeForce RTX 4090: PCIe Gen4 x16, no NVLink"),
}
GPUS = tuple(replace(g, **_INTERCONNECT[g.name][0], sources={**g.sources, "interconnect": _INTERCONNECT[g.name][1]})
             if g.name in _INTERCONNECT else g for g in GPUS)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def host_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_spec() -> DeviceSpec:
    """This host as a device. Its analytic peaks are rough; a measured database should price CPU runs."""
    cores = host_cores()
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
