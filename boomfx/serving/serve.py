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
from boomfx.serving.kv_groups import KVGroups, kv_groups
from boomfx.serving.model import ServingModel, serving_model
from boomfx.serving.report import ServeReport, StepRow, WorkloadReport, workload_report
from boomfx.serving.steps import KV_WRITE_CONCAT, HostOverhead, Step, StepPricer, profile_activation_bytes
from boomfx.serving.tensor_parallel import CollectiveTimes, tp_serving_program
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
    groups: Optional[KVGroups] = None
    # tensor parallelism: the whole model (``model`` is then one rank's) and the rank's collectives,
    # or why the rank's program could not be cut (step times then stay those of TP=1)
    whole: Optional[ServingModel] = None
    collectives: Optional[CollectiveTimes] = None
    tp_not_split: str = ""
    windows: tuple[Optional[int], ...] = ()   # each layer's sliding window (None: full), what the steps read

    def request_blocks(self, context: int) -> int:
        """Blocks one request of ``context`` tokens holds over all groups."""
        groups = self.groups or kv_groups((None,) * self.kv.num_layers)
        return groups.blocks_per_request(context, self.config.max_num_batched_tokens, self.config.block_size)

    def pricer(self, bucket_tokens: int = 1, interpolate: bool = False, kv_write: Optional[str] = None,
               host_overhead: Optional[HostOverhead] = None) -> StepPricer:
        """Step prices; under the concat rule (a transformers loop) with the database's measured Python
        per module call (``serving/host_overhead.py``) unless ``host_overhead`` is given."""
        if host_overhead is None and kv_write == KV_WRITE_CONCAT:
            from boomfx.kernels_db.host_overheads import MODULE_CALL, stored_ns
            measured = stored_ns(getattr(self.analysis.pricer, "host_records", {}), MODULE_CALL)
            if measured is not None:
                host_overhead = HostOverhead(0.0, measured, "transformers' Python per module call, measured here "
                                                            "(serve --collect)")
        return StepPricer(self.analysis, self.model, self.engine, self.config, self.kv_dtype,
                          self.kv.kv_heads_per_rank, kv_write=kv_write, bucket_tokens=bucket_tokens,
                          interpolate=interpolate, host_overhead=host_overhead or HostOverhead(),
                          collectives=self.collectives, windows=self.windows)


_KV_TORCH_DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}


def setup(program: Program, device: DeviceSpec, engine: Optional[EngineRules] = None, db: Optional[str] = None,
          block_size: Optional[int] = None, gpu_memory_utilization: Optional[float] = None,
          max_model_len: Optional[int] = None, max_num_seqs: Optional[int] = None,
          max_num_batched_tokens: Optional[int] = None, kv_cache_dtype: str = "auto",
          tensor_parallel_size: int = 1, enforce_eager: bool = False, outside_memory: str = "",
          sliding_window: Optional[int] = None, disable_hybrid_kv_cache_manager: bool = False) -> ServingSetup:
    """Check the engine options against the model and the engine's rules, and plan the memory.

    ``sliding_window``: the window of the layers whose mask shows one (all layers when none does),
    for windows the mask probe cannot see (``boomfx/serving/sliding_window.py``)."""
    rules = engine or get_engine()
    model = serving_model(program)
    site = model.uniform_site()
    seq = model.seq
    longest = model.max_seq_len
    what = (f"the export's cache range {model.past.describe()} + 1 new token" if model.past is not None
            else f"the exported sequence range {seq.describe()}")
    if max_model_len is None:
        if longest is None:
            raise OptionError(f"{what} has no upper bound: give --max-model-len")
        max_model_len = longest
    if longest is not None and max_model_len > longest:
        raise OptionError(f"--max-model-len {max_model_len} exceeds {what}; export with a larger "
                          f"Dim('{'past' if model.past is not None else 'seq'}', max=...)")
    windows = layer_windows(model.sites, sliding_window)
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
    whole, collectives, not_split = None, None, ""
    weights_per_rank = math.ceil(model.weights_bytes / tensor_parallel_size)
    if tensor_parallel_size > 1 and model.carries_cache:
        not_split = "an export that carries its KV cache is not split (export the plain model)"
    elif tensor_parallel_size > 1:
        try:
            rank_program = tp_serving_program(program, tensor_parallel_size)
        except OptionError as exc:
            not_split = str(exc).splitlines()[0]
        else:
            whole, program = model, rank_program
            model = serving_model(program)
            weights_per_rank = model.weights_bytes
            collectives = CollectiveTimes(program, device, tensor_parallel_size, db)
    if program.options.python_locals:   # the engine runs its own model code, compiled: the graph's frees
        program = dataclasses.replace(program, options=dataclasses.replace(program.options, python_locals=False))
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
    hybrid = not disable_hybrid_kv_cache_manager
    plan = plan_memory(kv, device.memory_bytes, config.gpu_memory_utilization,
                       weights_per_rank, activation, non_torch, context,
                       graph_pool, max_model_len, windows=windows,
                       max_num_batched_tokens=config.max_num_batched_tokens, hybrid_kv_cache_manager=hybrid)
    return ServingSetup(rules, analysis, model, config, kv, kv_dtype, plan, kv_groups(windows, hybrid), whole,
                        collectives, not_split, windows)


def layer_windows(sites: Any, sliding_window: Optional[int]) -> tuple[Optional[int], ...]:
    """Each layer's window: as its mask shows, or ``sliding_window`` for the layers whose mask shows
    one (every layer when none does)."""
    seen = tuple(s.sliding_window for s in sites)
    if sliding_window is None:
        return seen
    if sliding_window < 1:
        raise OptionError(f"--sliding-window {sliding_window}: must be at least 1 token")
    if any(w is not None for w in seen):
        return tuple(sliding_window if w is not None else None for w in seen)
    return (sliding_window,) * len(seen)


def report_steps(s: ServingSetup, input_len: int, output_len: int, batches: Optional[list[int]] = None,
                 contexts: Optional[list[int]] = None) -> list[Step]:
    """The steps the report prices: a prefill of one prompt (in chunks of the token budget), then decode
    steps of several batch sizes (``--sweep``: ``batches`` x ``contexts``)."""
    steps = []
    budget = s.config.max_num_batched_tokens
    done = 0
    while done < input_len:
        chunk = min(budget, input_len - done)
        done += chunk
        steps.append(Step((), ((chunk, done),)))
    ctx_list = contexts or [min(s.config.max_model_len, input_len + max(1, output_len // 2))]
    for ctx in ctx_list:
        for b in batches or sorted({1, 8, 32, s.config.max_num_seqs}):
            if b <= s.config.max_num_seqs:
                steps.append(Step((ctx,) * b))
    return steps


def step_rows(s: ServingSetup, pricer: StepPricer, input_len: int, output_len: int,
              batches: Optional[list[int]] = None, contexts: Optional[list[int]] = None) -> list[StepRow]:
    """The report's steps (``report_steps``), priced."""
    rows = []
    for step in report_steps(s, input_len, output_len, batches, contexts):
        st = pricer.step_time(step)
        parts = {k: v.device_ns for k, v in st.parts.items()}
        if step.prefills:
            chunk, done = step.prefills[0]
            rows.append(StepRow("prefill", 1, chunk, done, st.total_ns, st.cuda_graph, parts))
        else:
            b, ctx = len(step.decode_contexts), step.decode_contexts[0]
            rows.append(StepRow("decode", b, b, ctx, st.total_ns, st.cuda_graph, parts,
                                fits_kv=b * s.request_blocks(ctx) <= s.plan.num_blocks))
    return rows


def run_workload(s: ServingSetup, workload: Workload, progress: Optional[Callable[[int, int], None]] = None,
                 find_max_rate: bool = True, kv_write: Optional[str] = None) -> WorkloadReport:
    """Simulate ``workload``; in rate mode also bisect for the highest sustainable rate."""
    pricer = s.pricer(bucket_tokens=s.config.block_size, interpolate=True, kv_write=kv_write)
    groups = s.groups if s.plan.sliding_layers else None     # None: one full-attention group

    def timer(step: Step) -> float:
        return pricer.step_time(step).total_ns

    result = simulate_workload(workload, s.config, s.plan.num_blocks, timer, progress, groups=groups)
    ok = sustainable(result)
    best: Optional[float] = None
    if find_max_rate and workload.request_rate is not None:
        best = _highest_rate(s, workload, timer, groups)
    return workload_report(workload, result, ok, best)


def _highest_rate(s: ServingSetup, workload: Workload, timer: Callable[[Step], float],
                  groups: Optional[KVGroups]) -> Optional[float]:
    from dataclasses import replace
    n = min(workload.num_prompts, MAX_RATE_PROBE_PROMPTS)
    out_len = workload.lengths_of(0)[1]
    step = timer(Step((workload.lengths_of(0)[0] + out_len // 2,) * s.config.max_num_seqs))
    capacity = s.config.max_num_seqs / (step / 1e9) / max(1, out_len)     # decode-bound requests/s
    lo, hi = 0.0, 2.0 * capacity
    for _ in range(MAX_RATE_PROBES):
        mid = (lo + hi) / 2
        probe = replace(workload, num_prompts=n, request_rate=mid, concurrency=None)
        if sustainable(simulate_workload(probe, s.config, s.plan.num_blocks, timer, groups=groups)):
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
          seed: int = 0, dataset: Optional[str] = None, simulate: bool = True, sliding_window: Optional[int] = None,
          disable_hybrid_kv_cache_manager: bool = False) -> ServeReport:
    """Plan, price and (with a request rate or concurrency) simulate serving ``source`` (see ``setup``)."""
    from boomfx.frontend.capture import capture
    from boomfx.serving.workload import read_dataset
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    program = capture(source, options=ProgramOptions(target_kind=spec.kind))
    s = setup(program, spec, db=db, block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
              kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
              sliding_window=sliding_window, disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager)
    rows = step_rows(s, s.pricer(), input_len, output_len) if s.plan.fits else []
    wl = None
    if simulate and s.plan.fits and (request_rate is not None or concurrency is not None):
        workload = Workload(num_prompts, input_len, output_len, request_rate, concurrency, seed=seed,
                            lengths=read_dataset(dataset) if dataset else ()).check(s.config.max_model_len)
        wl = run_workload(s, workload)
    return build_report(s, spec, rows, wl)


def build_report(s: ServingSetup, device: DeviceSpec, rows: list[StepRow],
                 workload: Optional[WorkloadReport]) -> ServeReport:
    whole = s.whole or s.model
    site = whole.uniform_site()
    warnings = []
    if s.config.tensor_parallel_size > 1 and s.collectives is None:
        warnings.append(f"tensor parallelism: KV heads per rank and weights / TP follow the engine, but the rank's "
                        f"program was not cut ({s.tp_not_split}): step times are priced at TP=1 (no all-reduce)")
    if s.model.carries_cache:
        warnings.append(f"the export carries a KV cache ({len(s.model.cache_input_names)} past K/V inputs, cached "
                        f"length {s.model.past.min_value} to {s.model.past.max_value}): KV shapes read from them; under {s.engine.name} rules "
                        "the export's own attention and cache concatenations are replaced by the engine's")
    if s.analysis.costs.unmodelled_ops():
        warnings.append(f"{len(s.analysis.costs.unmodelled_ops())} op(s) without a cost formula priced by bytes moved")
    return ServeReport(
        source=s.model.program.source, device=device.name, engine=s.engine.label,
        model={"attention_layers": s.model.num_layers, "query_heads": site.q_heads, "kv_heads": site.kv_heads,
               "head_dim": site.head_dim, "v_head_dim": site.v_head_dim, "dtype": str(site.dtype).replace("torch.", ""),
               "weights_bytes": whole.weights_bytes, "exported_seq_range": [s.model.seq.min_value,
                                                                              s.model.seq.max_value],
               "carries_kv_cache": s.model.carries_cache,
               "cache_range": [s.model.past.min_value, s.model.past.max_value] if s.model.past is not None else None,
               "sliding_layers": list(s.plan.sliding_layers), "sliding_windows": list(s.plan.sliding_windows)},
        options=dataclasses.asdict(s.config), memory=s.plan, steps=rows, workload=workload, warnings=warnings)
