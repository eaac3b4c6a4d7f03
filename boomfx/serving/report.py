"""The serving report: plain dataclasses, their JSON form and the text the CLI prints."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from boomfx.core.units import fmt_bytes, fmt_time

if TYPE_CHECKING:
    from boomfx.serving.workload import SimulationResult, Summary, Workload

SCHEMA_VERSION = 1
KV_TIMELINE_POINTS = 100


@dataclass
class StepRow:
    kind: str                 # "prefill" | "decode"
    batch: int
    tokens: int
    context: int
    time_ns: float
    cuda_graph: bool
    parts_ns: dict[str, float]
    fits_kv: bool = True


@dataclass
class WorkloadReport:
    mode: str
    num_prompts: int
    request_rate: Optional[float]
    concurrency: Optional[int]
    seed: int
    ttft: "Summary"
    tpot: "Summary"
    itl: "Summary"
    e2e: "Summary"
    duration_ns: float
    requests_per_s: float
    output_tokens_per_s: float
    steps: int
    preemptions: int
    kv_utilization_mean: float
    kv_utilization_max: float
    kv_utilization_timeline: list[tuple[float, float]]
    sustainable: bool
    highest_sustainable_rate: Optional[float]
    step_trace: list[tuple[float, float, int, int]] = field(default_factory=list, repr=False)


@dataclass
class ServeReport:
    source: str
    device: str
    engine: str
    model: dict[str, Any]
    options: dict[str, Any]
    memory: Any                  # kv_cache.MemoryPlan
    steps: list[StepRow]
    workload: Optional[WorkloadReport]
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d.get("workload"):
            d["workload"].pop("step_trace", None)
        return {"schema_version": SCHEMA_VERSION, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


def workload_report(workload: "Workload", result: "SimulationResult", ok: bool,
                    best_rate: Optional[float]) -> WorkloadReport:
    from boomfx.serving.workload import Summary
    reqs = result.requests
    tpot = [(r.e2e_ns - r.ttft_ns) / (r.output_len - 1) for r in reqs if r.output_len > 1]
    itl = [x for r in reqs for x in r.itl_ns]
    start = min(r.arrival_ns for r in reqs)
    duration = max(1.0, result.makespan_ns - start)
    busy = sum(s.duration_ns * s.count for s in result.steps) or 1.0
    util = [s.kv_blocks_used / max(1, result.num_blocks) for s in result.steps]
    mean_util = sum(u * s.duration_ns * s.count for u, s in zip(util, result.steps)) / busy
    stride = max(1, len(result.steps) // KV_TIMELINE_POINTS)
    timeline = [(s.start_ns, u) for s, u in list(zip(result.steps, util))[::stride]]
    return WorkloadReport(
        mode="rate" if workload.request_rate is not None else "concurrency", num_prompts=len(reqs),
        request_rate=workload.request_rate, concurrency=workload.concurrency, seed=workload.seed,
        ttft=Summary.of(r.ttft_ns for r in reqs), tpot=Summary.of(tpot), itl=Summary.of(itl),
        e2e=Summary.of(r.e2e_ns for r in reqs), duration_ns=duration,
        requests_per_s=len(reqs) / (duration / 1e9),
        output_tokens_per_s=sum(r.output_len for r in reqs) / (duration / 1e9),
        steps=sum(s.count for s in result.steps), preemptions=result.preemptions, kv_utilization_mean=mean_util,
        kv_utilization_max=max(util) if util else 0.0, kv_utilization_timeline=timeline, sustainable=ok,
        highest_sustainable_rate=best_rate,
        step_trace=[(s.start_ns, s.duration_ns * s.count, s.decode_seqs, s.prefill_tokens) for s in result.steps])


def _summary_line(name: str, sm: "Summary") -> str:
    return (f"  {name:<5} mean {fmt_time(sm.mean_ns):>10}  p50 {fmt_time(sm.p50_ns):>10}  "
            f"p90 {fmt_time(sm.p90_ns):>10}  p99 {fmt_time(sm.p99_ns):>10}")


def render_text(r: ServeReport) -> str:
    m, p = r.model, r.memory
    o = r.options
    lines = [f"boomfx serve: {r.source} on {r.device}, following {r.engine}",
             f"model: {m['attention_layers']} attention layers, {m['query_heads']} query / {m['kv_heads']} KV heads of "
             f"{m['head_dim']}, {m['dtype']}, weights {fmt_bytes(m['weights_bytes'])}",
             f"engine: --block-size {o['block_size']} --gpu-memory-utilization {o['gpu_memory_utilization']} "
             f"--max-model-len {o['max_model_len']} --max-num-seqs {o['max_num_seqs']} "
             f"--max-num-batched-tokens {o['max_num_batched_tokens']} --kv-cache-dtype {o['kv_cache_dtype']} "
             f"--tensor-parallel-size {o['tensor_parallel_size']}",
             "",
             "memory plan (per rank)",
             f"  device memory                {fmt_bytes(p.device_bytes):>12}",
             f"  x gpu_memory_utilization     {fmt_bytes(p.requested_bytes):>12}",
             f"  - weights                    {fmt_bytes(p.weights_bytes):>12}",
             f"  - profiling peak ({o['max_num_batched_tokens']} tok) {fmt_bytes(p.activation_peak_bytes):>12}",
             f"  - non-torch                  {fmt_bytes(p.non_torch_bytes):>12}",
             f"  = KV cache                   {fmt_bytes(p.kv_available_bytes):>12}",
             f"  (outside the budget: CUDA context {fmt_bytes(p.outside_baseline_bytes)}, "
             f"CUDA-graph pool {fmt_bytes(p.cudagraph_pool_bytes)})",
             f"  KV bytes per token {p.kv_bytes_per_token} B; block of {p.block_size} tokens = {p.page_bytes} B per "
             f"layer; {p.num_blocks} blocks = {p.kv_tokens} tokens",
             *_group_lines(p, m.get("attention_layers", 0)),
             f"  maximum concurrency for {p.max_model_len} tokens per request: {p.max_concurrency:.2f}x",
             f"  verdict: {p.verdict}"]
    if r.steps:
        lines += ["", "steps"]
        lines.append(f"  {'kind':<8}{'batch':>6}{'tokens':>8}{'context':>9}{'time':>12}{'tok/s':>11}  graph  parts")
        for s in r.steps:
            parts = ", ".join(f"{k} {fmt_time(v)}" for k, v in s.parts_ns.items() if v > 0)
            rate = s.tokens / (s.time_ns / 1e9) if s.time_ns else 0.0
            flag = "" if s.fits_kv else "  (exceeds the KV cache)"
            lines.append(f"  {s.kind:<8}{s.batch:>6}{s.tokens:>8}{s.context:>9}{fmt_time(s.time_ns):>12}{rate:>11.0f}"
                         f"  {'yes' if s.cuda_graph else 'no ':<5}  {parts}{flag}")
    w = r.workload
    if w is not None:
        load = f"{w.request_rate:g} requests/s" if w.request_rate is not None else f"concurrency {w.concurrency}"
        lines += ["", f"workload: {w.num_prompts} requests at {load} (seed {w.seed}), {w.steps} steps, "
                      f"{w.preemptions} preemptions",
                  _summary_line("TTFT", w.ttft), _summary_line("TPOT", w.tpot), _summary_line("ITL", w.itl),
                  _summary_line("E2E", w.e2e),
                  f"  throughput {w.requests_per_s:.2f} requests/s, {w.output_tokens_per_s:.0f} output tokens/s; "
                  f"KV cache use mean {100 * w.kv_utilization_mean:.0f}%, max {100 * w.kv_utilization_max:.0f}%"]
        if w.request_rate is not None:
            verdict = "sustainable" if w.sustainable else "NOT sustainable: the queue grows"
            lines.append(f"  this rate is {verdict}" + (f"; highest sustainable rate about "
                                                        f"{w.highest_sustainable_rate:.2f} requests/s"
                                                        if w.highest_sustainable_rate else ""))
    lines += [f"warning: {x}" for x in r.warnings]
    return "\n".join(lines)


def _layer_ranges(layers: list[int]) -> str:
    """``[0, 1, 2, 4]`` -> ``0-2, 4``."""
    out: list[str] = []
    for i in layers:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out)


def _group_lines(p: Any, num_layers: int) -> list[str]:
    """Which layers slide, and the engine's KV-cache groups when there are several."""
    if not p.sliding_layers:
        return []
    full = [i for i in range(num_layers) if i not in p.sliding_layers]
    windows = sorted(set(p.sliding_windows))
    line = (f"  sliding-window layers {_layer_ranges(list(p.sliding_layers))} (window "
            f"{', '.join(map(str, windows))} tokens; their blocks outside the window are freed)"
            + (f"; full-attention layers {_layer_ranges(full)}" if full else ""))
    lines = [line]
    if p.kv_groups > 1:
        lines.append(f"  {p.kv_groups} KV-cache groups of {p.layers_per_group} layer(s) share the blocks (hybrid "
                     f"allocator); a request of {p.max_model_len} tokens needs {p.blocks_per_request} blocks")
    else:
        lines.append(f"  a request of {p.max_model_len} tokens needs {p.blocks_per_request} blocks")
    return lines


def write_trace(path: str, w: WorkloadReport) -> None:
    """Chrome/Perfetto trace: one complete event per engine step."""
    events = [{"name": f"step d{d} p{p}", "ph": "X", "ts": start / 1e3, "dur": dur / 1e3, "pid": 0, "tid": 0,
               "args": {"decode_seqs": d, "prefill_tokens": p}} for start, dur, d, p in w.step_trace]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
