"""boomfx serve on exports that carry a KV cache (a decode step with DynamicCache inputs) and on
sliding-window models: KV shapes against a real CPU decode loop, decode-step FLOPs against PyTorch's
own counter, windows read from the masks against the model configs, and vLLM's KV-cache group
arithmetic by hand."""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from boomfx.cli.main import main
from boomfx.core.errors import OptionError
from boomfx.serving.kv_cache import KVSpec, plan_memory
from boomfx.serving.kv_groups import kv_groups
from boomfx.serving.steps import KV_WRITE_CONCAT, Step

pytest.importorskip("transformers")
import hf_decode  # noqa: E402  (tests/ is on sys.path under pytest)

GiB = 1024 ** 3
WINDOW = 24


def _setup(ep: Any, **options: Any) -> Any:
    from boomfx.core.devices import cpu_spec
    from boomfx.core.program import ProgramOptions
    from boomfx.frontend.capture import capture
    from boomfx.serving.serve import setup
    return setup(capture(ep, options=ProgramOptions(target_kind="cpu")), cpu_spec(), db="none", max_num_seqs=8,
                 max_num_batched_tokens=512, **options)


@pytest.fixture(scope="module")
def llama() -> Any:
    return hf_decode.llama()


@pytest.fixture(scope="module")
def decode_export(llama: Any) -> Any:
    return hf_decode.export_decode_step(llama)


@pytest.fixture(scope="module")
def decode_setup(decode_export: Any) -> Any:
    return _setup(decode_export)


# -- an export that carries a KV cache ---------------------------------------------------------------

def test_cache_inputs_are_recognised(decode_setup: Any, decode_export: Any) -> None:
    m = decode_setup.model
    user_inputs = [s.arg.name for s in decode_export.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    cache_inputs = [n for n in user_inputs if n.startswith("past_key_values")]
    assert len(cache_inputs) == 4                         # K and V of 2 layers
    assert m.carries_cache and m.cache_input_names == frozenset(cache_inputs)
    assert (m.past.min_value, m.past.max_value) == (2, hf_decode.MAX_PAST)
    assert all((s.kv_heads, s.head_dim, s.q_heads) == (2, 16, 4) for s in m.sites)
    # the concatenations that append the new K/V are the model's cache write: not token-wise work
    assert m.cache_write_nodes and m.cache_write_nodes <= m.attention_side
    # DynamicCache's unflatten rebuilds each layer with cat([empty, past]): one copy per cache input,
    # not made by a framework that keeps its cache object between steps
    nodes = {n.name: n for n in m.program.graph.nodes}
    assert len(m.cache_rewrap_nodes) == 4 and m.cache_rewrap_nodes <= m.cache_write_nodes
    for name in m.cache_rewrap_nodes:
        empty, cached = nodes[name].args[0]
        assert tuple(empty.meta["val"].shape) == (0,) and cached.name in m.cache_input_names
    # the longest context a decode step can price: the cache range + the new token
    assert decode_setup.config.max_model_len == hf_decode.MAX_PAST + 1


def test_kv_bytes_from_cache_inputs_equal_a_real_decode_loop(llama: Any, decode_setup: Any) -> None:
    # 2 x 2 layers x 2 KV heads x 16 x 4 B (float32) = 512 B per token, as the plain export's plan says
    assert decode_setup.plan.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    plain = _setup(hf_decode.export_plain(llama))
    assert plain.plan.kv_bytes_per_token == decode_setup.plan.kv_bytes_per_token
    batch, prompt, steps = 3, 9, 4
    cache = hf_decode.decode_loop(llama, batch, prompt, steps)   # a real greedy decode loop on this CPU
    assert hf_decode.cache_bytes(cache) == decode_setup.plan.kv_bytes_per_token * batch * (prompt + steps)


def test_tensor_parallel_halves_the_cache_inputs_heads(decode_export: Any) -> None:
    tp2 = _setup(decode_export, tensor_parallel_size=2)
    tp4 = _setup(decode_export, tensor_parallel_size=4)
    assert tp2.kv.kv_heads_per_rank == 1 and tp2.plan.kv_bytes_per_token == 512 // 2
    assert tp4.kv.kv_heads_per_rank == 1 and tp4.plan.kv_bytes_per_token == 512 // 2   # 2 heads on 4 ranks: replicated


def _graph_flops(s: Any, batch: int, context: int) -> dict[str, float]:
    point = s.analysis.evaluate(s.model.bindings(batch, 1, context - 1))
    nodes = {n.name: n for n in s.model.program.graph.nodes}
    out: dict[str, float] = {}
    for k in point.report.kernels:
        op = str(getattr(nodes[k.node].target, "overloadpacket", nodes[k.node].target)) if k.node in nodes else ""
        out[op] = out.get(op, 0.0) + k.flops
    return out


@pytest.mark.parametrize("batch,context", [(2, 33), (4, 100)])
def test_decode_step_from_the_graph_matches_pytorchs_counter(llama: Any, decode_setup: Any, batch: int,
                                                             context: int) -> None:
    from torch.utils.flop_counter import FlopCounterMode
    flops = _graph_flops(decode_setup, batch, context)
    cache = hf_decode.prefilled_cache(llama, batch, context - 1)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        llama(torch.randint(0, hf_decode.VOCAB, (batch, 1)), past_key_values=cache, use_cache=True)
    # the real step's matmuls, as PyTorch counts them (its CPU SDPA kernel is not counted)
    assert flops["aten.linear"] == counter.get_total_flops()
    # the attention reads the whole cached context: 4 x batch x 4 query heads x 1 query x context x 16, per layer
    assert flops["aten.scaled_dot_product_attention"] == 2 * 4 * batch * 4 * 1 * context * 16


def test_decode_from_the_graph_grows_with_context(decode_setup: Any) -> None:
    pricer = decode_setup.pricer(kv_write=KV_WRITE_CONCAT)
    assert pricer.decode_from_graph
    t = [pricer.step_time(Step((ctx,) * 4)) for ctx in (64, 256, 448)]
    attention = [x.parts["attention"].device_ns for x in t]
    writes = [x.parts["kv_cache_write"].device_ns for x in t]
    assert attention[0] < attention[1] < attention[2]
    assert writes[0] < writes[1] < writes[2]            # torch.cat copies the whole cache every step
    with pytest.raises(OptionError, match="cache range"):
        pricer.step_time(Step((hf_decode.MAX_PAST + 2,)))
    # the engine's rules (paged writes) replace the graph's attention: not priced from the graph
    assert not decode_setup.pricer().decode_from_graph


def test_cli_cache_export(capsys: Any, tmp_path: Any, decode_export: Any) -> None:
    f = str(tmp_path / "decode.pt2")
    torch.export.save(decode_export, f)
    assert main(["serve", f, "--device", "h100-80gb", "--db", "none", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "256", "--input-len", "32", "--output-len", "8"]) == 0
    out, _ = capsys.readouterr()
    assert "carries a KV cache (4 past K/V inputs" in out and "maximum concurrency for 511 tokens" in out
    assert main(["serve", f, "--db", "none", "--max-model-len", "600"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "exceeds the export's cache range" in err


# -- sliding windows ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3() -> Any:
    model = hf_decode.sliding("gemma3", WINDOW)
    return model, hf_decode.export_plain(model)


def test_window_is_read_from_the_mask() -> None:
    mistral = hf_decode.sliding("mistral", WINDOW)
    s = _setup(hf_decode.export_plain(mistral))
    assert [site.sliding_window for site in s.model.sites] == [mistral.config.sliding_window] * 2 == [WINDOW] * 2
    plain = _setup(hf_decode.export_plain(hf_decode.llama()))
    assert all(site.sliding_window is None for site in plain.model.sites)


def test_alternating_layers_are_read_from_their_masks(gemma3: Any) -> None:
    model, ep = gemma3
    s = _setup(ep)
    expected = [WINDOW if t == "sliding_attention" else None for t in model.config.layer_types]
    assert expected == [WINDOW] * 5 + [None]
    assert [site.sliding_window for site in s.model.sites] == expected
    assert s.plan.sliding_layers == (0, 1, 2, 3, 4) and s.plan.kv_groups == 6 and s.plan.layers_per_group == 1
    # --sliding-window N gives the sliding layers' window (a window too long for the mask probe to see)
    wide = _setup(ep, sliding_window=128)
    assert wide.plan.sliding_layers == (0, 1, 2, 3, 4) and set(wide.plan.sliding_windows) == {128}
    # min(127 + 512, 512) = 512 tokens: no saving at this budget; per request 5 x (32 + 1) + 32 blocks
    assert wide.plan.blocks_per_request == 5 * 33 + 32


def _mistral_like(windows: tuple[Optional[int], ...], hybrid: bool = True) -> Any:
    spec = KVSpec(num_layers=len(windows), kv_heads=8, kv_heads_per_rank=8, head_dim=128, v_head_dim=128,
                  dtype_bytes=2, block_size=16)
    return plan_memory(spec, 80 * GiB, 0.9, weights_bytes=14 * GiB, activation_peak_bytes=2 * GiB, non_torch_bytes=0,
                       outside_baseline_bytes=0, cudagraph_pool_bytes=0, max_model_len=32768, windows=windows,
                       max_num_batched_tokens=8192, hybrid_kv_cache_manager=hybrid)


def test_uniform_sliding_window_plan_by_hand() -> None:
    # Mistral-7B-shaped: 32 layers, 8 KV heads of 128, bf16, window 4096; 80 GiB x 0.9 - 16 GiB = 56 GiB
    plan = _mistral_like((4096,) * 32)
    page = 16 * 8 * 256 * 2                                   # 65536 B per layer and block
    assert plan.kv_available_bytes == 56 * GiB
    assert plan.num_blocks == 56 * GiB // page // 32 == 28672  # one group of all 32 layers, as full attention
    assert plan.kv_tokens == 28672 * 16 == 458752
    # a request holds the window's last 4095 tokens + one step's 8192, plus one block: cdiv(12287, 16) + 1
    assert plan.blocks_per_request == 768 + 1
    assert plan.max_concurrency == pytest.approx(28672 / 769)   # 37.3x; full attention: 28672 / 2048 = 14.0x
    assert _mistral_like((None,) * 32).max_concurrency == pytest.approx(14.0)
    assert plan.sliding_layers == tuple(range(32)) and plan.kv_groups == 1


def test_hybrid_sliding_window_plan_by_hand() -> None:
    # Gemma-3-shaped pattern: 5 sliding (window 1024) : 1 full, 30 layers -> 25 sliding + 5 full
    windows = tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(30))
    plan = _mistral_like(windows)
    # group size = the fewest layers of a kind (5); 25 / 5 = 5 sliding groups + 1 full group = 6 groups
    assert (plan.layers_per_group, plan.kv_groups) == (5, 6)
    assert plan.num_blocks == 56 * GiB // 65536 // 5 == 183500          # 917504 // 5
    assert plan.kv_tokens == 183500 // 6 * 16 == 489328
    # per request: 5 sliding groups x (cdiv(min(1023 + 8192, 32768), 16) + 1) + 1 full group x 32768 / 16
    assert plan.blocks_per_request == 5 * 577 + 2048 == 4933
    assert plan.max_concurrency == pytest.approx(183500 / 4933)         # 37.2x
    # --disable-hybrid-kv-cache-manager: every layer full-attention sized: 917504 // 30 blocks of 2048 each
    flat = _mistral_like(windows, hybrid=False)
    assert (flat.num_blocks, flat.kv_groups, flat.blocks_per_request) == (30583, 1, 2048)
    assert flat.max_concurrency == pytest.approx(30583 / 2048)          # 14.9x
    assert flat.sliding_layers == ()


def test_window_lets_a_long_request_fit() -> None:
    # 64 KiB pages x 32 layers x 2048 blocks = 4 GiB for one full 32768-token request; give 2 GiB of KV
    spec = KVSpec(32, 8, 8, 128, 128, 2, 16)
    kwargs: dict[str, Any] = dict(weights_bytes=int(70 * GiB), activation_peak_bytes=0, non_torch_bytes=0,
                                  outside_baseline_bytes=0, cudagraph_pool_bytes=0, max_model_len=32768,
                                  max_num_batched_tokens=8192)
    assert not plan_memory(spec, 80 * GiB, 0.9, **kwargs).fits
    # sliding: 32 x 769 blocks x 64 KiB = 1.5 GiB <= 2 GiB
    assert plan_memory(spec, 80 * GiB, 0.9, windows=(4096,) * 32, **kwargs).fits


def test_group_size_rule() -> None:
    near = kv_groups((512,) * 12 + (None,) * 13)       # 13 < 1.5 x 12: groups of the larger count, padded
    assert near.group_size == 13 and len(near.groups) == 2
    alternating = kv_groups((512, None) * 4)
    assert alternating.group_size == 4 and len(alternating.groups) == 2
    with pytest.raises(OptionError):
        kv_groups((512, 1024), hybrid_manager=False)   # two windows, no full layer: the engine cannot unify


def test_cli_names_the_sliding_layers(capsys: Any, tmp_path: Any, gemma3: Any) -> None:
    f = str(tmp_path / "gemma3.pt2")
    torch.export.save(gemma3[1], f)
    argv = ["serve", f, "--device", "h100-80gb", "--db", "none", "--max-num-seqs", "8", "--max-num-batched-tokens",
            "256", "--input-len", "32", "--output-len", "8"]
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    assert "sliding-window layers 0-4 (window 24 tokens" in out and "full-attention layers 5" in out
    assert "6 KV-cache groups of 1 layer(s)" in out
    assert main(argv + ["--sliding-window", "0"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "--sliding-window 0" in err


def test_static_cache_export_is_refused_in_one_line() -> None:
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    from boomfx.serving.model import ServingModelError
    model = hf_decode.llama()
    model.generation_config.cache_implementation = "static"
    wrapped = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=64)
    ep = torch.export.export(wrapped, (), {"input_ids": torch.zeros((1, 1), dtype=torch.long),
                                           "cache_position": torch.tensor([0])}, strict=False)
    with pytest.raises(ServingModelError, match="StaticCache"):
        _setup(ep)


def test_engine_steps_are_the_same_from_either_export(llama: Any, decode_export: Any) -> None:
    """Under vLLM's rules the engine runs its own attention and cache writes: the plain export and the
    decode-step export of one model plan the same memory and price the same attention, writes,
    LM head and sampler."""
    from boomfx.core.devices import get_device
    from boomfx.core.program import ProgramOptions
    from boomfx.frontend.capture import capture
    from boomfx.serving.serve import setup
    device = get_device("h100-80gb")
    opts: dict[str, Any] = dict(db="none", max_model_len=500, max_num_seqs=8, max_num_batched_tokens=512)
    plain, cached = (setup(capture(ep, options=ProgramOptions(target_kind="cuda")), device, **opts)
                     for ep in (hf_decode.export_plain(llama), decode_export))
    assert (plain.plan.num_blocks, plain.plan.activation_peak_bytes) == (cached.plan.num_blocks,
                                                                         cached.plan.activation_peak_bytes)
    for step in (Step((300,) * 8), Step((), ((256, 256),))):
        a, b = plain.pricer().step_time(step), cached.pricer().step_time(step)
        for part in ("attention", "kv_cache_write", "logits", "sampler"):
            assert a.parts[part].device_ns == b.parts[part].device_ns, part


# -- the scheduler with sliding-window groups ----------------------------------------------------------

def _sim_config() -> Any:
    from boomfx.serving.engine import EngineConfig
    return EngineConfig(block_size=16, gpu_memory_utilization=0.9, max_model_len=4096, max_num_seqs=8,
                        max_num_batched_tokens=1024, kv_cache_dtype="auto")


def test_sliding_group_frees_blocks_outside_the_window() -> None:
    from boomfx.serving.workload import Workload, held_blocks, simulate_workload
    sliding = kv_groups((32,))
    # 20 + 100 tokens: the last step runs with 118 computed (119 in all); full attention holds
    # cdiv(119, 16) = 8 blocks, the window of 32 frees the first (118 - 32 + 1) // 16 = 5 of them
    assert held_blocks(None, 16, 118, 119) == 8
    assert held_blocks(sliding, 16, 118, 119) == 8 - 5 == 3
    # a Gemma-style pair of groups (one sliding, one full) holds both: 3 + 8
    assert held_blocks(kv_groups((32, None)), 16, 118, 119) == 11
    wl = Workload(1, 20, 100, request_rate=float("inf"))
    full = simulate_workload(wl, _sim_config(), 1000, lambda st: 1e6, fast_forward=False)
    win = simulate_workload(wl, _sim_config(), 1000, lambda st: 1e6, fast_forward=False, groups=sliding)
    assert full.steps[-1].kv_blocks_used == 8 and win.steps[-1].kv_blocks_used == 3
    # never more than the window's cdiv(31 + 1, 16) + 1 = 3 blocks once decoding
    assert max(s.kv_blocks_used for s in win.steps) == 3


def test_sliding_window_avoids_preemption() -> None:
    from boomfx.serving.workload import Workload, simulate_workload
    # two requests of 20 + 100 tokens in 10 blocks: full attention needs 2 x 8 = 16 and preempts;
    # a window of 32 keeps each at 3 blocks (6 in all)
    wl = Workload(2, 20, 100, request_rate=float("inf"))
    assert simulate_workload(wl, _sim_config(), 10, lambda st: 1e6).preemptions >= 1
    assert simulate_workload(wl, _sim_config(), 10, lambda st: 1e6, groups=kv_groups((32,))).preemptions == 0


def test_fast_forward_is_exact_with_sliding_groups() -> None:
    from boomfx.serving.workload import Workload, simulate_workload

    def timer(step: Step) -> float:   # grows with the batch's mean context bucket, exact in floating point
        b = len(step.decode_contexts)
        mean = -(-sum(step.decode_contexts) // b) if b else 0
        return 1024.0 * (1000 + 3 * (-(-mean // 16)) + 7 * b + step.num_tokens)
    groups = kv_groups((40, None, 40))
    for wl in (Workload(30, 50, 90, request_rate=30.0, seed=2), Workload(20, 20, 120, concurrency=3)):
        fast = simulate_workload(wl, _sim_config(), 120, timer, groups=groups)
        slow = simulate_workload(wl, _sim_config(), 120, timer, fast_forward=False, groups=groups)
        assert fast.requests == slow.requests and fast.preemptions == slow.preemptions
        assert sum(s.count for s in fast.steps) == len(slow.steps) > len(fast.steps)


def test_sliding_window_option_without_a_window_in_the_masks(decode_export: Any) -> None:
    # a plain Llama's masks show no window: --sliding-window N applies to every layer (Mistral-style)
    s = _setup(decode_export, sliding_window=64)
    assert s.plan.sliding_layers == (0, 1) and s.plan.sliding_windows == (64, 64) and s.plan.kv_groups == 1
    # min(63 + 512, 511) = 511 tokens: cdiv(511, 16) + 1 = 33 blocks per request (full attention: 32)
    assert s.plan.blocks_per_request == 33
    assert _setup(decode_export).plan.blocks_per_request == 32
