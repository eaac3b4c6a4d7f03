"""Low-precision GPU kernel model: tile/wave counts, shape tables, attention work, and the pricing chain."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import sympy
import torch

from boomfx.core.devices import get_device, list_devices
from boomfx.kernels_db import attention_model as am
from boomfx.kernels_db import gpu_model_core as core
from boomfx.kernels_db.gpu_model import GpuKernelModel
from boomfx.kernels_db.gpu_model_core import GemmParams, KernelFamily, MemoryParams
from boomfx.kernels_db.lowp_data import DEFAULT_LOWP_DIR
from boomfx.kernels_db.tensor_core_gemm import ShapeTable, roofline_gemm_ns
from boomfx.passes.costs.registry import OpCall, price_call
from boomfx.passes.specs import TensorSpec, contiguous_strides

aten = torch.ops.aten
CUDA_GPUS = [d.name for d in list_devices() if d.kind == "cuda"]
HAVE_DATA = (DEFAULT_LOWP_DIR / "gemm.csv").is_file()


def spec(*shape: int, dtype=torch.bfloat16) -> TensorSpec:
    s = tuple(sympy.Integer(x) for x in shape)
    return TensorSpec(s, contiguous_strides(s), dtype)


def mm(m: int, n: int, k: int, dtype=torch.bfloat16) -> OpCall:
    return OpCall.build(aten.mm.default, (spec(m, k, dtype=dtype), spec(k, n, dtype=dtype)), {},
                        (spec(m, n, dtype=dtype),))


def scaled_mm(m: int, n: int, k: int) -> OpCall:
    f8 = torch.float8_e4m3fn
    return OpCall.build(aten._scaled_mm.default,
                        (spec(m, k, dtype=f8), spec(k, n, dtype=f8), spec(dtype=torch.float32), spec(dtype=torch.float32)),
                        {"out_dtype": torch.bfloat16}, (spec(m, n),))


@pytest.fixture(scope="module")
def model() -> GpuKernelModel:
    return GpuKernelModel.load()


# ---------------------------------------------------------------------------------------------------
# The tile/wave formula with tensor-core element sizes
# ---------------------------------------------------------------------------------------------------

ONE_TILE = KernelFamily(((128, 128),), (1,), 64.0, 2, 2)
IDEAL = GemmParams(e_max=1.0, k_half=0.0, tile_alpha=0.0, floor_ns=0.0, mem_efficiency=1.0)


def test_wave_count_steps_at_a_multiple_of_the_sm_count():
    # 108 SMs at 1 TFLOP/s each (108e12 peak): a 128x128 tile of depth 1024 is 2*128*128*1024 FLOPs
    # = 33,554,432 FLOPs at 1000 FLOP/ns = 33,554.432 ns. m=1536, n=1152: 12 x 9 = 108 tiles = one wave;
    # m=1537: 13 x 9 = 117 tiles, the busiest SM runs 2: 67,108.864 ns. Bandwidth 1e15 B/s keeps DRAM
    # out of it (~9 MB: ~9 ns).
    kw = dict(peak_flops_per_s=108e12, bandwidth_bytes_per_s=1e15, sm_count=108, params=IDEAL, family=ONE_TILE)
    assert core.gemm_time_ns(1, 1536, 1152, 1024, **kw) == pytest.approx(33_554.432)
    assert core.gemm_time_ns(1, 1537, 1152, 1024, **kw) == pytest.approx(67_108.864)


def test_dram_bound_counts_two_byte_operands_and_output():
    # m=1, n=k=8192 bf16: bytes = 2*(1*8192 + 8192*8192) + 2*(1*8192) = 134,250,496; at 1e12 B/s with
    # mem_efficiency 0.5: 268,500.992 ns, far above the one-tile compute time.
    kw = dict(peak_flops_per_s=108e12, bandwidth_bytes_per_s=1e12, sm_count=108, family=ONE_TILE,
              params=GemmParams(1.0, 0.0, 0.0, 0.0, 0.5))
    assert core.gemm_time_ns(1, 1, 8192, 8192, **kw) == pytest.approx(268_500.992)


def test_an_empty_contraction_costs_its_output_write():
    # k = 0 (a weight gradient over zero tokens): no tile work, the [m, n] bf16 output written: 2 * 256 * 512
    # bytes at 1e12 B/s = 262.144 ns; an efficiency of 0 once made it NaN
    kw = dict(peak_flops_per_s=108e12, bandwidth_bytes_per_s=1e12, sm_count=108, family=ONE_TILE, params=IDEAL)
    assert core.gemm_time_ns(1, 256, 512, 0, **kw) == pytest.approx(262.144)


def test_shape_table_interpolates_in_log2_sizes_and_clamps():
    # 2x1x1 grid: log ratio 0 at m=1, log(2) at m=4; m=2 is halfway in log2: exp(log(2)/2) = sqrt(2)
    table = ShapeTable((0.0, 2.0), (5.0,), (5.0,), (((0.0,),), ((math.log(2.0),),)))
    assert table.correction(2, 32, 32) == pytest.approx(math.sqrt(2.0))
    assert table.correction(4, 32, 32) == pytest.approx(2.0)
    assert table.correction(1 << 20, 1 << 16, 7) == pytest.approx(2.0)   # clamped beyond the grid


# ---------------------------------------------------------------------------------------------------
# The fitted model
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gpu", CUDA_GPUS)
def test_times_are_positive_finite_and_never_beat_the_roofline(model, gpu):
    dev = get_device(gpu)
    half = torch.bfloat16 if torch.bfloat16 in dev.peak_flops_per_s else torch.float16   # V100/T4: fp16 only
    rng = random.Random(0)
    for _ in range(40):
        m, n, k = rng.randint(1, 20000), rng.randint(16, 20000), rng.randint(16, 20000)
        t = model.predict_ns(mm(m, n, k, dtype=half), dev)
        assert t is not None and math.isfinite(t) and t > 0
        assert t >= float(roofline_gemm_ns("bf16", 1, m, n, k, dev, half)) * (1 - 1e-9)
        if torch.float8_e4m3fn in dev.peak_flops_per_s:
            t8 = model.predict_ns(scaled_mm(m, n, k), dev)
            assert t8 is not None and t8 > 0 and t8 >= float(roofline_gemm_ns("fp8", 1, m, n, k, dev)) * (1 - 1e-9)
    attn = model.attention
    for _ in range(10):
        L, heads = rng.randint(1, 8192), rng.choice((8, 16, 32))
        for backward in (False, True):
            assert attn.sdpa_ns(2 * heads, L, L, 128, dev, causal=True, backward=backward) > 0
        assert attn.prefill_ns([L, 3], [0, L], heads, 8, 128, torch.bfloat16, dev) > 0
        assert attn.decode_ns([L] * 4, heads, 8, 128, torch.bfloat16, dev) > 0


def test_bf16_gemm_on_an_a100_is_priced_by_the_model_not_the_roofline():
    from boomfx.kernels_db.price import PriceSource
    from boomfx.kernels_db.roofline import roofline_ns
    from boomfx.kernels_db.pricing import make_pricer
    dev = get_device("a100-80gb")
    call = mm(4096, 4096, 4096)
    price = make_pricer(dev).price(call, price_call(call).cost)
    assert price.source == PriceSource.MODEL
    assert price.time_ns != pytest.approx(roofline_ns(call, price_call(call).cost, dev))
    # 2*4096^3 = 1.374e11 FLOPs at 312 TF/s dense = 440.5 us: the model sits between that and 2x it
    assert 440_000 < price.time_ns < 2 * 440_500


def test_unmeasured_gpus_borrow_a_measured_gpu_of_their_compute_capability(model):
    lowp = model.lowp
    assert lowp.source_device("bf16", get_device("h100-pcie")) in ("h100-sxm", "h200")   # sm90
    assert lowp.source_device("bf16", get_device("rtx-4090")) == "l40s"                 # sm89
    assert lowp.source_device("bf16", get_device("a10")) is None                        # sm86: generic
    assert lowp.source_device("fp8", get_device("a100-80gb")) is None                   # no fp8 rows


@pytest.mark.skipif(not HAVE_DATA, reason="public low-precision data not present")
def test_model_matches_a_measured_large_gemm(model):
    from boomfx.kernels_db.lowp_data import load_gemms
    table = load_gemms()[("h100-sxm", "bf16")]
    row = np.flatnonzero((table.m == 8192) & (table.n == 8192) & (table.k == 8192))[0]
    measured = table.latency_ns[row]
    predicted = model.predict_ns(mm(8192, 8192, 8192), get_device("h100-sxm"))
    assert abs(predicted / measured - 1) < 0.10


# ---------------------------------------------------------------------------------------------------
# Attention work
# ---------------------------------------------------------------------------------------------------

def test_attended_pairs_causal_window_and_prefix():
    assert am.attended_pairs(16, 16) == 136                       # 16*17/2
    assert am.attended_pairs(16, 16, window_left=3) == 58         # 1+2+3 + 13*4
    assert am.attended_pairs(4, 10) == 4 * 6 + 10                 # 6 cached: 7+8+9+10 = 34
    assert am.attended_pairs(4, 10, window_left=7) == 31          # 7 + 3*8: keys 7, 8, 9, 10 capped at 8
    assert am.attended_pairs(16, 24, causal=False) == 16 * 24


def test_windowed_prefill_counts_whole_tiles():
    # L=1024 with a 127-key window: 8 query blocks of 128; block 0 touches 1 key tile, the others 2
    # (their window reaches into the previous tile): 1 + 7*2 = 15 tiles; full causal: 8*9/2 = 36.
    assert am.computed_tiles(1024, 1024, True, 127) == 15
    assert am.computed_tiles(1024, 1024, True, None) == 36


def test_backward_costs_more_than_forward_and_efficient_more_than_flash(model):
    dev = get_device("a100-80gb")
    attn = model.attention
    fwd = attn.sdpa_ns(96, 1024, 1024, 64, dev, causal=True, backward=False)
    bwd = attn.sdpa_ns(96, 1024, 1024, 64, dev, causal=True, backward=True)
    eff = attn.sdpa_ns(96, 1024, 1024, 64, dev, causal=True, backward=False, backend="efficient")
    full = attn.sdpa_ns(96, 1024, 1024, 64, dev, causal=False, backward=False)
    # 2.5x the FLOPs at 0.8x the rate: the FLOP-proportional part is 3.125x, the floor once
    assert 2.0 < bwd / fwd < am.BACKWARD_FLOP_RATIO / am.BACKWARD_RATE_FRACTION
    assert eff > fwd and full > fwd


def test_decode_is_a_kv_read_on_the_fitted_bandwidth_curve(model):
    dev = get_device("h100-sxm")
    attn = model.attention
    # 8 sequences of 4095 cached tokens (+1 current): K and V of 8 KV heads x 128 dims in bf16:
    # 8 * 4096 * 2 * 8 * 128 * 2 = 134,217,728 bytes, + q and out: 8 * 2 * 32 * 128 * 2 = 131,072
    nbytes = 134_217_728 + 131_072
    params = attn.curves(dev).decode
    expected = params.floor_ns + nbytes / dev.memory_bandwidth_bytes_per_s * 1e9 * float(
        core.inv_efficiency_at(np.log2(nbytes), params))
    assert attn.decode_ns([4095] * 8, 32, 8, 128, torch.bfloat16, dev) == pytest.approx(expected)
    assert attn.decode_ns([8191] * 8, 32, 8, 128, torch.bfloat16, dev) > attn.decode_ns([4095] * 8, 32, 8, 128,
                                                                                        torch.bfloat16, dev)


def test_flash_sdpa_call_is_priced_by_the_attention_model(model):
    dev = get_device("a100-80gb")
    q = spec(8, 12, 1024, 64)
    call = OpCall.build(aten._scaled_dot_product_flash_attention.default, (q, q, q), {"is_causal": True},
                        (q, spec(8, 12, 1024, dtype=torch.float32)))
    assert model.predict_ns(call, dev) == pytest.approx(
        model.attention.sdpa_ns(96, 1024, 1024, 64, dev, causal=True, backward=False))


# ---------------------------------------------------------------------------------------------------
# Memory-bound kernels at any precision
# ---------------------------------------------------------------------------------------------------

def test_autocast_cast_priced_by_bytes_on_the_elementwise_curve(model):
    dev = get_device("a100-80gb")
    n = 1 << 24
    call = OpCall.build(aten._to_copy.default, (spec(n, dtype=torch.float32),), {"dtype": torch.bfloat16},
                        (spec(n),))
    nbytes = 4 * n + 2 * n   # fp32 read + bf16 written = 100,663,296 bytes
    params: MemoryParams = model.memory_params("elementwise", dev)
    expected = float(core.memory_time_ns(nbytes, 1, bandwidth_bytes_per_s=dev.memory_bandwidth_bytes_per_s,
                                         params=params))
    assert model.predict_ns(call, dev) == pytest.approx(expected)


def test_foreach_optimizer_kernel_counts_its_in_place_writes(model):
    dev = get_device("h100-sxm")
    tensors = [spec(1 << 20, dtype=torch.float32) for _ in range(4)]
    call = OpCall.build(aten._foreach_mul_.Scalar, (tensors, 0.9), {}, ())
    # 4 tensors of 1 Mi fp32, read and written in place: 2 * 4 * 4 MiB = 33,554,432 bytes
    _, read, written = price_call(call).cost.evaluate()
    assert read + written == 33_554_432
    params = model.memory_params("elementwise", dev)
    expected = float(core.memory_time_ns(33_554_432, 1, bandwidth_bytes_per_s=dev.memory_bandwidth_bytes_per_s,
                                         params=params))
    assert model.predict_ns(call, dev) == pytest.approx(expected)


def test_serving_entry_points_match_the_model(model):
    dev = get_device("h200")
    assert am.prefill_attention_ns([512, 256], [0, 1024], 32, 8, 128, torch.bfloat16, dev) == pytest.approx(
        model.attention.prefill_ns([512, 256], [0, 1024], 32, 8, 128, torch.bfloat16, dev))
    # a cached prefix adds work: 256 new tokens after 1024 cached attend 256*1024 + 256*257/2 pairs
    assert am.prefill_attention_ns([256], [1024], 32, 8, 128, torch.bfloat16, dev) > am.prefill_attention_ns(
        [256], [0], 32, 8, 128, torch.bfloat16, dev)
    assert am.decode_attention_ns([100, 2000], 32, 8, 128, torch.bfloat16, dev) == pytest.approx(
        model.attention.decode_ns([100, 2000], 32, 8, 128, torch.bfloat16, dev))
    # an fp8 KV cache reads half the bytes
    assert am.decode_attention_ns([65535] * 8, 32, 8, 128, torch.bfloat16, dev, torch.float8_e4m3fn) < \
        am.decode_attention_ns([65535] * 8, 32, 8, 128, torch.bfloat16, dev)
