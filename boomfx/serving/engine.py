"""The serving engine's rules: which options it accepts, its defaults, and how it sizes things.

boomfx predicts what an engine does with a model; the engine's own rules decide the KV-cache size,
the batches it forms and the CUDA graphs it replays. Every rule here names where it comes from, and
``EngineRules.version`` says which release of those rules is followed (shown in every report).

vLLM V1 (read in the vLLM source, not copied):

- ``vllm/config/cache.py``: ``BlockSize = Literal[1, 8, 16, 32, 64, 128]`` (CUDA; 256 appears only in
  later releases), ``block_size`` defaults to 16 on CUDA, ``gpu_memory_utilization`` to 0.9 and must lie in
  (0, 1]; ``cache_dtype`` "auto" (the model's dtype) or an fp8 variant (1 byte).
- ``vllm/engine/arg_utils.py`` ``EngineArgs.get_batch_defaults``: for ``vllm serve`` (usage context
  OPENAI_API_SERVER), ``max_num_batched_tokens`` 8192 and ``max_num_seqs`` 1024 on GPUs with >= 70 GiB
  that are not an A100, else 2048 and 256. V1 always chunks prefills.
- ``vllm/config/vllm.py`` ``_set_cudagraph_sizes``: the largest captured batch is
  ``min(max_num_seqs * 2, 512)`` capped at ``max_num_batched_tokens``; sizes ``[1, 2, 4]``, then every 8
  below 256, then every 16 up to the largest. ``cudagraph_mode`` FULL_AND_PIECEWISE: a decode-only batch
  is padded up to the next captured size and replayed as one full graph; a mixed batch runs piecewise
  (its attention eager).
- ``vllm/v1/core/kv_cache_utils.py``: page size per layer ``2 * block_size * kv_heads * head_size *
  dtype_bytes``; ``num_blocks = available_memory // page_size // num_layers``; the engine refuses to
  start when one request of ``max_model_len`` tokens does not fit the KV cache; "maximum concurrency"
  = ``num_blocks / cdiv(max_model_len, block_size)``.
- ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``: requested memory =
  ``total * gpu_memory_utilization``; KV memory = requested - (weights + the torch peak increase of
  ``profile_run``, a forward of ``max_num_batched_tokens`` tokens + non-torch increase). The CUDA
  context lives before the baseline snapshot and must fit in the rest: ``init_device`` refuses to start
  when free memory is below the requested memory.
- Tensor parallelism (``vllm/config/model.py`` ``get_num_kv_heads``): KV heads per rank =
  ``max(1, kv_heads // tp)``: divided, or replicated when there are fewer KV heads than ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from boomfx.core.errors import OptionError

GiB = 1024 ** 3


@dataclass(frozen=True)
class BatchDefaults:
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class EngineRules:
    """One engine's constants and sizing rules (see the module docstring for each source)."""

    name: str
    version: str
    block_sizes: tuple[int, ...]
    default_block_size: int
    default_gpu_memory_utilization: float
    large_gpu_bytes: int                    # "device_memory >= 70 GiB and not an A100" -> large defaults
    large_gpu_defaults: BatchDefaults
    small_gpu_defaults: BatchDefaults
    cudagraph_max_batch_cap: int            # min(max_num_seqs * 2, 512)
    cudagraph_seq_factor: int
    kv_cache_dtypes: tuple[str, ...]        # --kv-cache-dtype choices; "auto" = the model's dtype
    kv_write: str = "paged"                 # how new K/V enter the cache: "paged" (reshape_and_cache)

    @property
    def label(self) -> str:
        return f"{self.name} (rules of {self.version})"

    # -- option checks ---------------------------------------------------------------------------
    def check_block_size(self, block_size: int) -> int:
        if block_size not in self.block_sizes:
            raise OptionError(f"--block-size {block_size}: {self.name} accepts "
                              f"{', '.join(map(str, self.block_sizes))}")
        return block_size

    def check_utilization(self, utilization: float) -> float:
        if not 0.0 < utilization <= 1.0:
            raise OptionError(f"--gpu-memory-utilization {utilization}: must lie in (0, 1]")
        return utilization

    def kv_dtype_bytes(self, kv_cache_dtype: str, model_dtype_bytes: int) -> int:
        """Bytes per cached element: the model's for "auto", else the named dtype's."""
        sizes = {"auto": model_dtype_bytes, "bfloat16": 2, "float16": 2, "half": 2, "float32": 4,
                 "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
        if kv_cache_dtype not in self.kv_cache_dtypes or kv_cache_dtype not in sizes:
            raise OptionError(f"--kv-cache-dtype {kv_cache_dtype}: expected one of {', '.join(self.kv_cache_dtypes)}")
        return sizes[kv_cache_dtype]

    # -- defaults ----------------------------------------------------------------------------------
    def batch_defaults(self, device_memory_bytes: int, device_name: str) -> BatchDefaults:
        """``vllm serve`` defaults for a device (get_batch_defaults, OPENAI_API_SERVER context)."""
        if device_memory_bytes >= self.large_gpu_bytes and "a100" not in device_name.lower():
            return self.large_gpu_defaults
        return self.small_gpu_defaults

    def cudagraph_sizes(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, ...]:
        """Batch sizes captured as full CUDA graphs (decode-only batches)."""
        largest = min(max_num_seqs * self.cudagraph_seq_factor, self.cudagraph_max_batch_cap, max_num_batched_tokens)
        sizes = [s for s in (1, 2, 4) if s <= largest]
        sizes += list(range(8, min(largest + 1, 256), 8))
        if largest >= 256:
            sizes += list(range(256, largest + 1, 16))
        return tuple(sorted(set(sizes)))

    def kv_heads_per_rank(self, kv_heads: int, tensor_parallel_size: int) -> int:
        """Divided across ranks, or replicated (one per rank) when there are fewer KV heads than ranks."""
        if tensor_parallel_size < 1:
            raise OptionError(f"--tensor-parallel-size {tensor_parallel_size}: must be at least 1")
        if kv_heads >= tensor_parallel_size and kv_heads % tensor_parallel_size:
            raise OptionError(f"--tensor-parallel-size {tensor_parallel_size}: the model's {kv_heads} KV heads "
                              "are not divisible by it")
        return max(1, kv_heads // tensor_parallel_size)


VLLM_V1 = EngineRules(
    name="vLLM V1", version="vLLM v0.11.0",
    block_sizes=(1, 8, 16, 32, 64, 128), default_block_size=16, default_gpu_memory_utilization=0.9,
    large_gpu_bytes=70 * GiB,
    large_gpu_defaults=BatchDefaults(max_num_batched_tokens=8192, max_num_seqs=1024),
    small_gpu_defaults=BatchDefaults(max_num_batched_tokens=2048, max_num_seqs=256),
    cudagraph_max_batch_cap=512, cudagraph_seq_factor=2,
    kv_cache_dtypes=("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"),
)

ENGINES = {"vllm": VLLM_V1}


def get_engine(name: Optional[str] = None) -> EngineRules:
    key = (name or "vllm").lower()
    if key not in ENGINES:
        raise OptionError(f"--engine {name}: expected one of {', '.join(ENGINES)}")
    return ENGINES[key]


@dataclass(frozen=True)
class EngineConfig:
    """The engine options of one run, after defaults and checks (vLLM's names)."""

    block_size: int
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str
    tensor_parallel_size: int = 1
    enforce_eager: bool = False

    def check(self) -> "EngineConfig":
        if self.max_num_seqs < 1:
            raise OptionError(f"--max-num-seqs {self.max_num_seqs}: must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise OptionError(f"--max-num-batched-tokens {self.max_num_batched_tokens}: must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # SchedulerConfig._verify_args: every running sequence must be able to decode in one step
            raise OptionError(f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                              f"--max-num-seqs ({self.max_num_seqs})")
        if self.max_model_len < 1:
            raise OptionError(f"--max-model-len {self.max_model_len}: must be at least 1")
        return self
