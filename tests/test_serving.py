"""boomfx serve: KV-cache arithmetic against hand formulas and a real DynamicCache, the engine's rules,
the scheduler simulation's queueing sanity, decode attention linear in context, and bad input."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from boomfx.cli.main import main
from boomfx.core.errors import OptionError
from boomfx.serving.engine import VLLM_V1, EngineConfig
from boomfx.serving.kv_cache import KVSpec, kv_bytes_per_token, num_blocks, page_size_bytes, plan_memory
from boomfx.serving.steps import Step
from boomfx.serving.workload import Workload, simulate_workload, sustainable

MiB = 1024 ** 2
GiB = 1024 ** 3


# -- KV-cache arithmetic -----------------------------------------------------------------------------

def test_kv_bytes_per_token_is_the_hand_formula() -> None:
    # Llama-3-8B-shaped, bf16: 2 x 32 layers x 8 KV heads x 128 x 2 B = 131072 B per token
    assert kv_bytes_per_token(32, 8, 128, 128, 2) == 2 * 32 * 8 * 128 * 2 == 131072
    # fp8 cache halves it: 2 x 32 x 8 x 128 x 1 = 65536
    assert kv_bytes_per_token(32, 8, 128, 128, 1) == 65536


def test_kv_bytes_linear_in_tokens() -> None:
    spec = KVSpec(num_layers=4, kv_heads=2, kv_heads_per_rank=2, head_dim=64, v_head_dim=64, dtype_bytes=2,
                  block_size=16)
    per_token = spec.bytes_per_token       # 2 x 4 x 2 x 64 x 2 = 2048
    assert per_token == 2048
    # a block of 16 tokens in one layer: 16 x 2 x (64 + 64) x 2 = 8192 B; all layers: 4 x 8192 = 16 x 2048
    assert spec.page_bytes == page_size_bytes(16, 2, 64, 64, 2) == 8192
    assert spec.page_bytes * spec.num_layers == spec.block_size * per_token


def test_block_counts_by_hand() -> None:
    spec = KVSpec(num_layers=32, kv_heads=8, kv_heads_per_rank=8, head_dim=128, v_head_dim=128, dtype_bytes=2,
                  block_size=16)
    # 80 GiB x 0.9 = 73,014,444,032 B requested (int of 77309411328 * 0.9 = 69578470195)
    plan = plan_memory(spec, 80 * GiB, 0.9, weights_bytes=16 * GiB, activation_peak_bytes=2 * GiB,
                       non_torch_bytes=0, outside_baseline_bytes=512 * MiB, cudagraph_pool_bytes=0,
                       max_model_len=8192)
    requested = int(80 * GiB * 0.9)                       # 77309411328
    available = requested - 18 * GiB                      # 57982058496
    page = 16 * 8 * 256 * 2                               # 65536 B per layer and block
    assert plan.requested_bytes == requested
    assert plan.kv_available_bytes == available
    assert plan.page_bytes == page
    assert plan.num_blocks == available // page // 32 == 27648
    assert plan.kv_tokens == 27648 * 16 == 442368
    assert plan.blocks_per_request == 8192 // 16 == 512
    assert plan.max_concurrency == pytest.approx(27648 / 512)   # 54.0x
    assert plan.fits


def test_num_blocks_never_negative() -> None:
    assert num_blocks(-5, 100, 2) == 0


def test_model_that_does_not_fit_gets_a_verdict() -> None:
    spec = KVSpec(80, 8, 8, 128, 128, 2, 16)
    plan = plan_memory(spec, 80 * GiB, 0.9, weights_bytes=140 * GiB, activation_peak_bytes=GiB, non_torch_bytes=0,
                       outside_baseline_bytes=0, cudagraph_pool_bytes=0, max_model_len=4096)
    assert not plan.fits and "no memory for the KV cache" in plan.verdict
    # weights fit but one request of max_model_len does not: 1 block x 80 layers x 64 KiB x (131072/16) blocks
    tight = plan_memory(spec, 80 * GiB, 0.9, weights_bytes=70 * GiB, activation_peak_bytes=0, non_torch_bytes=0,
                        outside_baseline_bytes=0, cudagraph_pool_bytes=0, max_model_len=131072)
    # needs 8192 blocks x 80 x 65536 B = 40 GiB > 2 GiB available
    assert not tight.fits and "--max-model-len 131072" in tight.verdict


# -- the engine's rules --------------------------------------------------------------------------------

def test_tensor_parallel_divides_or_replicates_kv_heads() -> None:
    assert VLLM_V1.kv_heads_per_rank(8, 1) == 8
    assert VLLM_V1.kv_heads_per_rank(8, 2) == 4      # halved
    assert VLLM_V1.kv_heads_per_rank(8, 16) == 1     # fewer KV heads than ranks: replicated, one per rank
    assert VLLM_V1.kv_heads_per_rank(1, 4) == 1      # MQA
    with pytest.raises(OptionError):
        VLLM_V1.kv_heads_per_rank(6, 4)


def test_engine_refuses_what_vllm_refuses() -> None:
    with pytest.raises(OptionError, match="block-size 24"):
        VLLM_V1.check_block_size(24)
    assert VLLM_V1.check_block_size(16) == 16
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(OptionError, match="gpu-memory-utilization"):
            VLLM_V1.check_utilization(bad)
    assert VLLM_V1.check_utilization(1.0) == 1.0


def test_cudagraph_sizes_follow_vllm() -> None:
    # max_num_seqs 256: largest = min(512, 512, 8192) = 512 -> [1, 2, 4, 8..248 by 8, 256..512 by 16]
    sizes = VLLM_V1.cudagraph_sizes(256, 8192)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 512 and len(sizes) == 3 + 31 + 17
    assert VLLM_V1.cudagraph_sizes(4, 8192) == (1, 2, 4, 8)       # min(4 x 2, 512) = 8


def test_batch_defaults_by_device() -> None:
    assert VLLM_V1.batch_defaults(80 * GiB, "h100-sxm").max_num_batched_tokens == 8192
    assert VLLM_V1.batch_defaults(80 * GiB, "a100-80gb").max_num_seqs == 256   # A100 excluded


# -- scheduler simulation with constant step times ---------------------------------------------------

CFG = EngineConfig(block_size=16, gpu_memory_utilization=0.9, max_model_len=4096, max_num_seqs=8,
                   max_num_batched_tokens=1024, kv_cache_dtype="auto")
STEP_NS = 1e6   # every step takes 1 ms


def constant(step: Step) -> float:
    return STEP_NS


def test_low_load_ttft_is_one_prefill() -> None:
    # one request every second, 100-token prompts fit one step's budget: TTFT = one prefill step
    wl = Workload(20, 100, 10, request_rate=1.0, fixed_interval=True)
    res = simulate_workload(wl, CFG, num_blocks=1000, step_ns=constant)
    assert all(r.ttft_ns == STEP_NS for r in res.requests)
    # 9 decode steps after the first token, 1 ms each
    assert all(r.e2e_ns == 10 * STEP_NS for r in res.requests)
    assert sustainable(res)


def test_throughput_never_exceeds_decode_capacity() -> None:
    wl = Workload(200, 32, 64, request_rate=float("inf"))
    res = simulate_workload(wl, CFG, num_blocks=10_000, step_ns=constant)
    tokens = sum(r.output_len for r in res.requests)
    capacity_tokens_per_ns = CFG.max_num_seqs / STEP_NS       # at most max_num_seqs tokens per step
    assert tokens / res.makespan_ns <= capacity_tokens_per_ns
    assert max(s.decode_seqs + (1 if s.prefill_tokens else 0) for s in res.steps) <= CFG.max_num_seqs + 1


def test_overload_queues_grow_and_is_not_sustainable() -> None:
    # capacity: 8 sequences x 64 tokens at 1 ms per step -> about 8 / 65 ms = 123 requests/s; offer 1000/s
    wl = Workload(400, 32, 64, request_rate=1000.0, seed=3)
    res = simulate_workload(wl, CFG, num_blocks=10_000, step_ns=constant)
    queue = [r.queue_ns for r in res.requests]
    # the wait grows with the arrival index: the last quarter waits over twice as long as the second
    assert sum(queue[-100:]) > 2 * sum(queue[100:200])
    assert not sustainable(res)


def test_preemption_when_blocks_run_out() -> None:
    # 4 blocks of 16 tokens; two requests of 20 + 30 tokens need 4 blocks each at the end: one is preempted
    wl = Workload(2, 20, 30, request_rate=float("inf"))
    res = simulate_workload(wl, CFG, num_blocks=5, step_ns=constant)
    assert res.preemptions >= 1
    assert all(r.output_len == 30 for r in res.requests)


def _bucketed(step: Step) -> float:
    """A step time that grows with the decode batch's mean context in blocks of 16 (as the simulation's
    pricer buckets it), in whole multiples of 1024 ns so that sums are exact in floating point."""
    b = len(step.decode_contexts)
    mean = -(-sum(step.decode_contexts) // b) if b else 0
    return 1024.0 * (1000 + 3 * (-(-mean // 16)) + 7 * b + step.num_tokens)


def test_fast_forward_equals_stepping_one_by_one() -> None:
    for wl in (Workload(40, 50, 70, request_rate=30.0, seed=2), Workload(30, 20, 90, concurrency=3)):
        fast = simulate_workload(wl, CFG, 400, _bucketed)
        slow = simulate_workload(wl, CFG, 400, _bucketed, fast_forward=False)
        assert fast.requests == slow.requests
        assert sum(s.count for s in fast.steps) == len(slow.steps)
        assert len(fast.steps) < len(slow.steps)       # stretches were taken


def test_seeded_runs_are_deterministic() -> None:
    wl = Workload(300, 64, 32, request_rate=200.0, seed=7)
    a = simulate_workload(wl, CFG, 2000, constant)
    b = simulate_workload(wl, CFG, 2000, constant)
    assert a == b
    c = simulate_workload(Workload(300, 64, 32, request_rate=200.0, seed=8), CFG, 2000, constant)
    assert [r.arrival_ns for r in c.requests] != [r.arrival_ns for r in a.requests]


# -- steps priced from a real export -----------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_setup(examples_dir: Path):
    from boomfx.frontend.capture import capture
    from boomfx.core.devices import get_device
    from boomfx.core.program import ProgramOptions
    from boomfx.serving.serve import setup
    device = get_device("h100-80gb")
    program = capture(str(examples_dir / "llama_tiny.pt2"), options=ProgramOptions(target_kind="cuda"))
    return setup(program, device, db="none", max_model_len=4096)


def test_decode_attention_grows_linearly_with_context(llama_setup) -> None:
    pricer = llama_setup.pricer()
    # the cost formula: bytes read grow by exactly the K/V bytes of the extra context
    calls = [pricer.attention_calls(Step((ctx,) * 4))[0] for ctx in (1024, 2048, 4096)]
    from boomfx.passes.costs.registry import price_call
    read = [int(price_call(c).cost.bytes_read) for c in calls]
    kv_bytes_per_token_layer = 2 * 2 * 16 * 4     # K and V x 2 KV heads x 16 x fp32, per sequence
    assert read[1] - read[0] == 4 * 1024 * kv_bytes_per_token_layer
    assert read[2] - read[1] == 2 * (read[1] - read[0])
    # and the priced time (roofline, memory-bound): equal increments per equal context increment
    t = [pricer.price(c).device_ns for c in calls]
    assert t[2] - t[1] == pytest.approx(2 * (t[1] - t[0]), rel=1e-6)
    assert t[1] > t[0]


def test_graph_roles_of_the_export(llama_setup) -> None:
    m = llama_setup.model
    assert m.num_layers == 2 and m.sites[0].kv_heads == 2 and m.sites[0].q_heads == 4
    # the GQA expansion (repeat_interleave of K and V per layer) is attention-side, not token-wise
    assert sum(1 for n in m.attention_side if n.startswith("repeat_interleave")) == 4
    assert len(m.logits_nodes) >= 1
    assert llama_setup.plan.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4   # 2 x layers x KV heads x dim x fp32


# -- a real DynamicCache against the plan --------------------------------------------------------------

def test_dynamic_cache_bytes_equal_the_plan() -> None:
    transformers = pytest.importorskip("transformers")
    from torch.export import Dim

    from boomfx.frontend.capture import capture
    from boomfx.core.devices import cpu_spec
    from boomfx.core.program import ProgramOptions
    from boomfx.serving.serve import setup
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    cfg.use_cache = False
    model = transformers.LlamaForCausalLM(cfg).eval()
    ep = torch.export.export(model, (), {"input_ids": torch.randint(0, 256, (2, 16))},
                             dynamic_shapes={"input_ids": {0: Dim("batch", min=1, max=64),
                                                           1: Dim("seq", min=2, max=512)}}, strict=False)
    s = setup(capture(ep, options=ProgramOptions(target_kind="cpu")), cpu_spec(), db="none",
              max_num_seqs=8, max_num_batched_tokens=512)
    batch, tokens = 2, 37
    with torch.no_grad():
        out = model(torch.randint(0, 256, (batch, tokens)), use_cache=True,
                    past_key_values=transformers.DynamicCache(config=cfg))
    cache = out.past_key_values
    real = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert real == s.plan.kv_bytes_per_token * batch * tokens


# -- bad input on the command line -------------------------------------------------------------------

def _bad(capsys, *argv: str) -> str:
    code = main(["serve", *argv])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_cli_bad_input(capsys, examples_dir: Path) -> None:
    f = str(examples_dir / "llama_tiny.pt2")
    assert "exceeds the exported sequence range" in _bad(capsys, f, "--max-model-len", "8192", "--db", "none")
    assert "gpu-memory-utilization" in _bad(capsys, f, "--gpu-memory-utilization", "1.5", "--db", "none")
    assert "gpu-memory-utilization" in _bad(capsys, f, "--gpu-memory-utilization", "0", "--db", "none")
    assert "--block-size 24" in _bad(capsys, f, "--block-size", "24", "--db", "none")
    # 0.0001 x 16 GiB = 1.7 MiB cannot hold the weights (0.6 MiB) and the profiling peak
    assert "does not fit" in _bad(capsys, f, "--device", "t4", "--gpu-memory-utilization", "0.0001", "--db", "none")
    # no attention to page: refused, saying how to export one that has it
    assert "attn_implementation='sdpa'" in _bad(capsys, str(examples_dir / "mlp.pt2"), "--db", "none")


def test_cli_serve_prints_plan_steps_and_workload(capsys, examples_dir: Path) -> None:
    code = main(["serve", str(examples_dir / "llama_tiny.pt2"), "--device", "h100-80gb", "--db", "none",
                 "--max-model-len", "1024", "--request-rate", "20", "--num-prompts", "50", "--input-len", "64",
                 "--output-len", "16"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "vLLM v0.11.0" in out and "maximum concurrency" in out and "TTFT" in out and "decode" in out
