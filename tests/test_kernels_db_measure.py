"""The CPU measurer: sane statistics, host overhead inside the time, workspace from profiler events."""

from __future__ import annotations

import pytest
import torch

from boomfx.kernels_db.collectors import build_call, spec
from boomfx.kernels_db.keys import kernel_key
from boomfx.kernels_db.measure import Measurer, summarize, l2_cache_bytes, step_flush_bytes
from boomfx.kernels_db.store import Store

aten = torch.ops.aten


def fast_measurer() -> Measurer:
    return Measurer("cpu", target_s=0.003, min_runs=3, num_threads=1)


def test_summarize_quantiles() -> None:
    # sorted 1..11: median 6, p10 at position 1.0 -> 2, p90 at position 9.0 -> 10
    assert summarize([float(v) for v in range(11, 0, -1)]) == (6.0, 2.0, 10.0)


def test_cpu_measurement_statistics() -> None:
    key = kernel_key(build_call(aten.relu.default, (spec((4096,), torch.float32),)))
    m = fast_measurer().measure(key)
    assert 0 < m.p10_ns <= m.median_ns <= m.p90_ns
    assert m.n_runs >= 3
    assert 0 < m.host_ns <= m.median_ns  # on CPU the dispatch is part of the call's wall time
    assert m.source == "measured:cpu"


def test_workspace_of_mm_with_unit_strideless_input() -> None:
    # A (256, 256) view with strides (512, 2) has no unit stride: BLAS needs a contiguous copy first,
    # 256*256*4 = 262144 bytes of scratch beyond inputs and output.
    strided = spec((256, 256), torch.float32, stride=(512, 2))
    key = kernel_key(build_call(aten.mm.default, (strided, spec((256, 256), torch.float32))))
    m = fast_measurer().measure(key)
    assert m.workspace_bytes >= 256 * 256 * 4


def test_conv_workspace_recorded(tmp_path) -> None:
    key = kernel_key(
        build_call(
            aten.convolution.default,
            (
                spec((1, 8, 16, 16), torch.float32),
                spec((16, 8, 3, 3), torch.float32),
                None,
                [1, 1],
                [1, 1],
                [1, 1],
                False,
                [0, 0],
                1,
            ),
        )
    )
    measurer = fast_measurer()
    m = measurer.measure(key)
    assert m.workspace_bytes >= 0
    with Store(tmp_path / "k.sqlite") as store:
        store.put(m.record(measurer.fingerprint(), key))
        assert store.get(measurer.fingerprint(), key.key_hash).workspace_bytes == m.workspace_bytes


def test_view_like_op_falls_back_to_calibrated_host_time() -> None:
    # view(x, [64, 64]) is invalid on a one-element tensor, so the shrunk call cannot run.
    key = kernel_key(build_call(aten.view.default, (spec((4096,), torch.float32), [64, 64])))
    measurer = fast_measurer()
    m = measurer.measure(key)
    assert measurer._fallback_host_ns is not None
    assert 0 < m.host_ns <= m.median_ns


def test_registry_device_name_matches_cuda_names() -> None:
    from boomfx.kernels_db.measure import registry_device_name

    assert registry_device_name("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert registry_device_name("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert registry_device_name("Tesla T4") == "t4"
    assert registry_device_name("Some Future GPU") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mm_cannot_beat_the_datasheet_peak() -> None:
    from boomfx.core.devices import get_device

    m, k, n = 4096, 4096, 4096
    key = kernel_key(build_call(aten.mm.default, (spec((m, k), torch.float16), spec((k, n), torch.float16))))
    measurer = Measurer("cuda", target_s=0.05)
    result = measurer.measure(key)
    fp = measurer.fingerprint()
    assert result.source == "measured:cuda" and result.workspace_bytes >= 0
    assert 0 < result.host_ns < 1e6  # issuing one GEMM takes microseconds, not a millisecond
    try:
        peak = get_device(fp.device_name).peak_flops_per_s[torch.float16]
    except KeyError:
        pytest.skip(f"{fp.device_name} is not in the device registry")
    # 2*M*N*K FLOPs at no more than the dense datasheet peak: a lower bound on the time.
    assert result.median_ns >= 2 * m * n * k / peak * 1e9


def test_step_flush_follows_step_footprint():
    """A kernel sample is flushed by the bytes a step touches between two uses of a tensor (its
    footprint), at least the L2 and at most the effective cache."""
    mib = 1 << 20
    assert step_flush_bytes(39 * mib, 64 * mib, 2 * mib) == 39 * mib     # ViT training step
    assert step_flush_bytes(448 * mib, 64 * mib, 2 * mib) == 64 * mib    # beyond the cache: all cold
    assert step_flush_bytes(1 * mib, 64 * mib, 2 * mib) == 2 * mib       # the L2 is overwritten anyway
    assert step_flush_bytes(8 * mib, 1 * mib, 2 * mib) == 1 * mib        # never more than the cache
    assert l2_cache_bytes() >= 64 << 10
