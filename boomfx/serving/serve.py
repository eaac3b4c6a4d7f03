"""``boomfx serve`` as a library: engine options -> memory plan -> step times -> workload simulation.

Example::

    >>> from boomfx.serving import serve
    >>> report = serve("llama.pt2", device="h100-80gb", max_model_len=4096, request_rate=8, num_prompts=1000)
    >>> report.memory.num_blocks, report.workload.ttft.p50_ns
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from boomfx.analysis.analysis import Analysis, AnalyzeOptions
from boomfx.core.devices import DeviceSpec, get_device
from boomfx.core.errors import OptionError
from boomfx.core.program import Program, ProgramOptions
from boomfx.serving.engine import EngineConfig, EngineRules, get_engine
from boomfx.serving.kv_cache import KVSpec, MemoryPlan, plan_memory
from boomfx.serving.model import ServingModel, serving_model
from boomfx.serving.report import ServeReport, StepRow, WorkloadReport, workload_report
from boomfx.serving.steps import HostOverhead, Step, StepPricer, profile_activation_bytes
from boomfx.serving.workload import Workload, simulate_workload, sustainable

MAX_RATE_PROBES = 7             # bisection steps of the highest-sustainable-rate search
MAX_RATE_PROBE_PROMPTS = 400    # requests per probe (the full run's count when smaller)


@dataclass
class ServingSetup:
    """Everything derived once per model, device and engine options."""

    engine: EngineRules
    analysis: Analysis
    model: ServingModel
    config: EngineConfig
    kv: KVSpec
    kv_dtype: torch.dtype
    plan: MemoryPlan

    def pricer(self, bucket_tokens: int = 1, interpolate: bool = False, kv_write: Optional[str] = None,
               host_overhead: Optional[HostOverhead] = None) -> StepPricer:
        return StepPricer(self.analysis, self.model, self.engine, self.config, self.kv_dtype,
                          self.kv.kv_heads_per_rank, kv_write=kv_write, bucket_tokens=bucket_tokens,
                          interpolate=interpolate, host_overhead=host_overhead or HostOverhead())


_KV_TORCH_DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}


def setup(program: Program, device: DeviceSpec, engine: Optional[EngineRules] = None, db: Optional[str] = None,
          block_size: Optional[int] = None, gpu_memory_utilization: Optional[float] = None,
          max_model_len: Optional[int] = None, max_num_seqs: Optional[int] = None,
          max_num_batched_tokens: Optional[int] = None, kv_cache_dtype: str = "auto",
          tensor_parallel_size: int = 1, enforce_eager: bool = False, outside_memory: str = "") -> ServingSetup:
    """Check the engine options against the model and the engine's rules, and plan the memory."""
    rules = engine or get_engine()
    model = serving_model(program)
    site = model.uniform_site()
    seq = model.seq
    if max_model_len is None:
        if seq.max_value is None:
            raise OptionError(f"the export's sequence dimension {seq.describe()} has no upper bound: give --max-model-len")
        max_model_len = seq.max_value
    if seq.max_value is not None and max_model_len > seq.max_value:
        raise OptionError(f"--max-model-len {max_model_len} exceeds the exported sequence range {seq.describe()}; "
                          "export with a larger Dim('seq', max=...)")
    defaults = rules.batch_defaults(device.memory_bytes if device.kind == "cuda" else 0, device.name)
    config = EngineConfig(
        block_size=rules.check_block_size(block_size if block_size is not None else rules.default_block_size),
        gpu_memory_utilization=rules.check_utilization(gpu_memory_utilization if gpu_memory_utilization is not None
                                                       else rules.default_gpu_memory_utilization),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs if max_num_seqs is not None else defaults.max_num_seqs,
        max_num_batched_tokens=(max_num_batched_tokens if max_num_batched_tokens is not None
                                else defaults.max_num_batched_tokens),
        kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager).check()
    dtype_bytes = rules.kv_dtype_bytes(kv_cache_dtype, model.dtype_bytes)
    kv_dtype = model.dtype if kv_cache_dtype == "auto" else _KV_TORCH_DTYPES[dtype_bytes]
    kv = KVSpec(model.num_layers, site.kv_heads, rules.kv_heads_per_rank(site.kv_heads, tensor_parallel_size),
                site.head_dim, site.v_head_dim, dtype_bytes, config.block_size)
    analysis = Analysis(program, device, AnalyzeOptions(device.name, db=db, outside_memory=outside_memory))
    profile_tokens = config.max_num_batched_tokens
    activation = profile_activation_bytes(analysis, model, profile_tokens, min(config.max_num_seqs, profile_tokens))
    context = non_torch = graph_pool = 0
    if device.kind == "cuda":
        items = {i.name: i for i in analysis.outside.items()}
        context = items["cuda_context"].nbytes
        activation += items["cublas_workspace"].nbytes     # allocated through torch during the profile run
        non_torch = items["nccl"].nbytes
        if not enforce_eager:
            sizes = rules.cudagraph_sizes(config.max_num_seqs, config.max_num_batched_tokens)
            graph_pool = profile_activation_bytes(analysis, model, sizes[-1], sizes[-1]) if sizes else 0
    plan = plan_memory(kv, device.memory_bytes, config.gpu_memory_utilization,
                       math.ceil(model.weights_bytes / tensor_parallel_size), activation, non_torch, context,
                       graph_pool, max_model_len)
    return ServingSetup(rules, analysis, model, config, kv, kv_dtype, plan)


def step_rows(s: ServingSetup, pricer: StepPricer, input_len: int, output_len: int,
              batches: Optional[list[int]] = None, contexts: Optional[list[int]] = None) -> list[StepRow]:
    """Prefill of one prompt (in chunks of the token budget) and decode steps of several batch sizes."""
    rows = []
    budget = s.config.max_num_batched_tokens
    done = 0
    while done < input_len:
        chunk = min(budget, input_len - done)
        done += chunk
        st = pricer.step_time(Step((), ((chunk, done),)))
        rows.append(StepRow("prefill", 1, chunk, done, st.total_ns, st.cuda_graph,
                            {k: v.device_ns for k, v in st.parts.items()}))
    ctx_list = contexts or [min(s.config.max_model_len, input_len + max(1, output_len // 2))]
    for ctx in ctx_list:
        for b in batches or sorted({1, 8, 32, s.config.max_num_seqs}):
            if b > s.config.max_num_seqs:
                continue
            st = pricer.step_time(Step((ctx,) * b))
            blocks = b * -(-ctx // s.config.block_size)
            rows.append(StepRow("decode", b, b, ctx, st.total_ns, st.cuda_graph,
                                {k: v.device_ns for k, v in st.parts.items()}, fits_kv=blocks <= s.plan.num_blocks))
    return rows


def run_workload(s: ServingSetup, workload: Workload, progress: Optional[Callable[[int, int], None]] = None,
                 find_max_rate: bool = True) -> WorkloadReport:
    """Simulate ``workload``; in rate mode also bisect for the highest sustainable rate."""
    pricer = s.pricer(bucket_tokens=s.config.block_size, interpolate=True)

    def timer(step: Step) -> float:
        return pricer.step_time(step).total_ns

    result = simulate_workload(workload, s.config, s.plan.num_blocks, timer, progress)
    ok = sustainable(result)
    best: Optional[float] = None
    if find_max_rate and workload.request_rate is not None:
        best = _highest_rate(s, workload, timer)
    return workload_report(workload, result, ok, best)


def _highest_rate(s: ServingSetup, workload: Workload, timer: Callable[[Step], float]) -> Optional[float]:
    from dataclasses import replace
    n = min(workload.num_prompts, MAX_RATE_PROBE_PROMPTS)
    out_len = workload.lengths_of(0)[1]
    step = timer(Step((workload.lengths_of(0)[0] + out_len // 2,) * s.config.max_num_seqs))
    capacity = s.config.max_num_seqs / (step / 1e9) / max(1, out_len)     # decode-bound requests/s
    lo, hi = 0.0, 2.0 * capacity
    for _ in range(MAX_RATE_PROBES):
        mid = (lo + hi) / 2
        probe = replace(workload, num_prompts=n, request_rate=mid, concurrency=None)
        if sustainable(simulate_workload(probe, s.config, s.plan.num_blocks, timer)):
            lo = mid
        else:
            hi = mid
    return lo if lo > 0 else None


def serve(source: Any, device: str | DeviceSpec = "a100-80gb", db: Optional[str] = None, *,
          block_size: Optional[int] = None, gpu_memory_utilization: Optional[float] = None,
          max_model_len: Optional[int] = None, max_num_seqs: Optional[int] = None,
          max_num_batched_tokens: Optional[int] = None, kv_cache_dtype: str = "auto",
          tensor_parallel_size: int = 1, enforce_eager: bool = False, request_rate: Optional[float] = None,
          concurrency: Optional[int] = None, num_prompts: int = 200, input_len: int = 512, output_len: int = 128,
          seed: int = 0, dataset: Optional[str] = None, simulate: bool = True) -> ServeReport:
    """Plan, price and (with a request rate or concurrency) simulate serving ``source`` (see ``setup``)."""
    from boomfx.frontend.capture import capture
    from boomfx.serving.workload import read_dataset
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    program = capture(source, options=ProgramOptions(target_kind=spec.kind))
    s = setup(program, spec, db=db, block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager)
    rows = step_rows(s, s.pricer(), input_len, output_len) if s.plan.fits else []
    wl = None
    if simulate and s.plan.fits and (request_rate is not None or concurrency is not None):
        workload = Workload(num_prompts, input_len, output_len, request_rate, concurrency, seed=seed,
                            lengths=read_dataset(dataset) if dataset else ()).check(s.config.max_model_len)
        wl = run_workload(s, workload)
    return build_report(s, spec, rows, wl)


def build_report(s: ServingSetup, device: DeviceSpec, rows: list[StepRow],
                 workload: Optional[WorkloadReport]) -> ServeReport:
    site = s.model.uniform_site()
    warnings = []
    if s.config.tensor_parallel_size > 1:
        warnings.append("tensor parallelism: KV heads per rank and weights / TP follow the engine; step times are "
                        "priced at TP=1 (no all-reduce)")
    if s.analysis.costs.unmodelled_ops():
        warnings.append(f"{len(s.analysis.costs.unmodelled_ops())} op(s) without a cost formula priced by bytes moved")
    return ServeReport(
        source=s.model.program.source, device=device.name, engine=s.engine.label,
        model={"attention_layers": s.model.num_layers, "query_heads": site.q_heads, "kv_heads": site.kv_heads,
               "head_dim": site.head_dim, "v_head_dim": site.v_head_dim, "dtype": str(site.dtype).replace("torch.", ""),
               "weights_bytes": s.model.weights_bytes, "exported_seq_range": [s.model.seq.min_value,
                                                                              s.model.seq.max_value]},
        options=dataclasses.asdict(s.config), memory=s.plan, steps=rows, workload=workload, warnings=warnings)
