"""The parallel configuration: degrees, world, FSDP/DDP/pipeline options, and how ranks map to them.

The vocabulary is torchtitan's: ``dp_replicate`` (DDP, or the replicate dimension of HSDP),
``dp_shard`` (FSDP2 ``fully_shard``), ``tp`` (Megatron-style tensor parallelism), ``pp`` (pipeline
stages), ``sp`` (sequence parallelism with TP). The mesh is laid out as torchtitan's
``[pp, dp_replicate, dp_shard, tp]`` with tp innermost, so TP groups sit inside a node.

Batch: ``--batch`` is the batch each data-parallel rank feeds its model per step (per rank; the ranks
of one TP group share it); with pipeline parallelism it is cut into ``microbatches`` micro-batches, and
without it ``--microbatches M`` is gradient accumulation: M forward and backward passes of ``batch / M``
before one optimizer step (``accumulation.py``). The global batch is ``batch x dp_replicate x dp_shard``.

Example::

    >>> cfg = ParallelConfig.parse("dp_shard=16,tp=4", nodes=8, gpus_per_node=8)
    >>> cfg.world, cfg.global_batch(2)
    (64, 32)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from boomfx.core.errors import OptionError
from boomfx.core.networks import UnknownNetworkError, get_network

DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# colwise_packed: a fused projection (q|k|v, gate|up) whose output the model splits into parts; each
# rank holds 1/tp of every part, as vLLM's QKVParallelLinear / MergedColumnParallelLinear
TP_STYLES = ("colwise", "rowwise", "colwise_packed")
FSDP_WRAPS = ("layers", "root")
DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
DEFAULT_BUCKET_CAP_MB = 25.0  # torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)


TP_PRESET = "torchtitan"  # --tp-plan's named plan


@dataclass(frozen=True)
class ParallelConfig:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    nodes: int = 1
    gpus_per_node: Optional[int] = None  # None: the product of the degrees on one node
    pp_schedule: str = "1f1b"
    microbatches: Optional[int] = None  # None: one per stage (the minimum 1F1B needs)
    # interleaved 1F1B: model chunks (virtual stages) per rank, ``ScheduleInterleaved1F1B``'s local
    # stages; rank s holds chunks s, s + pp, ... of the pp x N-stage split (None: 2)
    pp_stages_per_rank: Optional[int] = None
    # None: torchtitan's "default" policy, True without pipeline parallelism and False with it (a stage
    # re-gathering its parameters for every micro-batch would multiply the all-gathers by the micro-batches)
    reshard_after_forward: Optional[bool] = None
    fsdp_param_dtype: Optional[str] = None  # MixedPrecisionPolicy(param_dtype=...)
    fsdp_reduce_dtype: Optional[str] = None  # MixedPrecisionPolicy(reduce_dtype=...)
    # FSDP2's units: "layers" (fully_shard on each layer of the main layer list, then the root, as
    # torchtitan wraps) or "root" (one fully_shard on the whole model: every parameter gathered at once)
    fsdp_wrap: str = "layers"
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    gradient_as_bucket_view: bool = False
    tp_plan: tuple[tuple[str, str], ...] = ()  # explicit (module pattern, a TP_STYLES style)
    # torchtitan's Llama plan (``--tp-plan torchtitan``): the derived layer plan plus the token
    # embedding rowwise over the vocabulary and the output head colwise (logits gathered)
    vocab_parallel: bool = False
    # torchtitan's loss parallel (logits kept split on the vocabulary, ``loss_parallel()`` cross-entropy):
    # None: on with a vocabulary-parallel head and a cross-entropy loss (torchtitan's default)
    loss_parallel: Optional[bool] = None
    backend: str = "nccl"  # "gloo": the CPU ground truth's backend
    network: str = "ib-ndr"  # between nodes (boomfx/core/networks.py): prices the collectives crossing them

    # -- construction ----------------------------------------------------------------------------
    @staticmethod
    def parse(text: str, **options: object) -> "ParallelConfig":
        """``"dp_shard=16,tp=4,sp"`` -> a config (other fields from ``options``); bad input: OptionError."""
        degrees: dict[str, object] = {}
        for item in (p.strip() for p in (text or "").split(",")):
            if not item:
                continue
            if item == "sp":
                degrees["sp"] = True
                continue
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in DEGREES:
                raise OptionError(f"--parallel: {item!r} is not one of {', '.join(DEGREES)}=N or sp")
            try:
                degree = int(value)
            except ValueError:
                raise OptionError(f"--parallel: {name}={value!r} is not an integer") from None
            if degree < 1:
                raise OptionError(f"--parallel: {name} must be at least 1, got {degree}")
            degrees[name] = degree
        given = {k: v for k, v in options.items() if v is not None}
        cfg = ParallelConfig(**degrees, **given)  # type: ignore[arg-type]
        cfg.check()
        return cfg

    @staticmethod
    def from_mapping(value: "ParallelConfig | Mapping[str, object] | str") -> "ParallelConfig":
        """The Python API's ``parallel=``: a config, a dict of fields, or the CLI's string."""
        if isinstance(value, ParallelConfig):
            value.check()
            return value
        if isinstance(value, str):
            return ParallelConfig.parse(value)
        fields = dict(value)
        plan = fields.get("tp_plan")
        if plan == TP_PRESET:
            fields["tp_plan"], fields["vocab_parallel"] = (), True
        elif isinstance(plan, Mapping):
            fields["tp_plan"] = tuple(plan.items())
        try:
            cfg = ParallelConfig(**fields)  # type: ignore[arg-type]
        except TypeError as exc:
            raise OptionError(f"parallel: {exc}") from None
        cfg.check()
        return cfg

    # -- validation that needs no model ----------------------------------------------------------
    def check(self) -> None:
        for name in DEGREES:
            if getattr(self, name) < 1:
                raise OptionError(f"--parallel: {name} must be at least 1, got {getattr(self, name)}")
        product = self.degree_product
        world = self.world
        if product != world:
            raise OptionError(
                f"--parallel: dp_replicate x dp_shard x tp x pp = {self.dp_replicate} x {self.dp_shard} x "
                f"{self.tp} x {self.pp} = {product} ranks, but the world is {self.nodes} node(s) x "
                f"{self.gpus_per_node_or_product} GPUs = {world}"
            )
        try:
            get_network(self.network)
        except UnknownNetworkError as exc:
            raise OptionError(f"--network: {exc}") from None
        if self.pp_schedule not in SCHEDULES:
            raise OptionError(f"--pp-schedule: {self.pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.microbatches is not None and self.microbatches < 1:
            raise OptionError(f"--microbatches must be at least 1, got {self.microbatches}")
        if self.pp > 1 and self.pp_schedule != "gpipe" and self.num_microbatches < self.pp:
            raise OptionError(
                f"--pp-schedule {self.pp_schedule} needs at least pp={self.pp} micro-batches, "
                f"got {self.num_microbatches}"
            )
        if self.pp_stages_per_rank is not None and self.pp_stages_per_rank < 1:
            raise OptionError(f"--pp-stages-per-rank must be at least 1, got {self.pp_stages_per_rank}")
        if self.pp_stages_per_rank not in (None, 1) and self.pp_schedule != "interleaved_1f1b":
            raise OptionError(f"--pp-stages-per-rank {self.pp_stages_per_rank}: more than one stage per rank needs "
                              f"--pp-schedule interleaved_1f1b")
        if self.pp > 1 and self.pp_schedule == "interleaved_1f1b" and self.num_microbatches % self.pp:
            raise OptionError(f"--pp-schedule interleaved_1f1b needs micro-batches in whole rounds of pp={self.pp}, "
                              f"got {self.num_microbatches}")
        if self.vocab_parallel and self.tp == 1:
            raise OptionError(f"--tp-plan {TP_PRESET} needs tp > 1")
        if self.loss_parallel and not self.vocab_parallel:
            raise OptionError(f"--loss-parallel true needs a vocabulary-parallel head (--tp-plan {TP_PRESET})")
        if self.sp and self.tp == 1:
            raise OptionError("--parallel: sp (sequence parallelism) needs tp > 1")
        if self.bucket_cap_mb <= 0:
            raise OptionError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}")
        for name in ("fsdp_param_dtype", "fsdp_reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise OptionError(f"--{name.replace('_', '-')}: {value!r} is not one of {', '.join(DTYPES)}")
        for pattern, style in self.tp_plan:
            if style not in TP_STYLES:
                raise OptionError(f"--tp-plan: {pattern}={style!r}: the style must be one of {', '.join(TP_STYLES)}")
        if self.fsdp_wrap not in FSDP_WRAPS:
            raise OptionError(f"--fsdp-wrap: {self.fsdp_wrap!r} is not one of {', '.join(FSDP_WRAPS)}")
        if (self.fsdp_param_dtype or self.fsdp_reduce_dtype) and self.dp_shard == 1:
            raise OptionError("--fsdp-param-dtype/--fsdp-reduce-dtype: FSDP's mixed precision needs dp_shard > 1 "
                              "(use --amp for autocast)")
        reason = self.not_modelled()
        if reason:
            raise OptionError(reason)

    def not_modelled(self) -> Optional[str]:
        """Why the per-rank programs of this combination are not built (None: they are). Asked before any
        rewrite runs, so ``--search`` counts such plans without tracing anything."""
        if self.is_single_device:
            return None
        if self.pp == 1:
            return None
        if self.pp_schedule == "interleaved_1f1b" and self.dp_replicate > 1:
            return ("--pp-schedule interleaved_1f1b with dp_replicate: torch 2.13's DistributedDataParallel fails "
                    "under ScheduleInterleaved1F1B (its reducer's bucket rebuild asserts at the second step's first "
                    "forward, seen on gloo); gpipe and 1f1b with dp_replicate are modelled")
        return None

    # -- derived ---------------------------------------------------------------------------------
    @property
    def degree_product(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def gpus_per_node_or_product(self) -> int:
        """GPUs per node; without ``gpus_per_node`` the degrees spread evenly over ``nodes``."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return max(1, self.degree_product // self.nodes)

    @property
    def world(self) -> int:
        if self.gpus_per_node is None and self.degree_product % self.nodes == 0:
            return self.degree_product
        return self.nodes * self.gpus_per_node_or_product

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.pp

    @property
    def accumulation_steps(self) -> int:
        """Gradient-accumulation micro-batches of a step without pipelining (1: none); with ``pp`` the
        micro-batches are the pipeline's."""
        return self.num_microbatches if self.pp == 1 else 1

    @property
    def stages_per_rank(self) -> int:
        """Model chunks each pipeline rank holds: 1, or ``pp_stages_per_rank`` (2) for interleaved 1F1B."""
        if self.pp_schedule != "interleaved_1f1b":
            return 1
        return self.pp_stages_per_rank if self.pp_stages_per_rank is not None else 2

    @property
    def reshards_after_forward(self) -> bool:
        """``reshard_after_forward`` as given, else torchtitan's default policy: not with pp, else yes."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.pp == 1

    @property
    def is_single_device(self) -> bool:
        return self.degree_product == 1

    def global_batch(self, batch_per_rank: int) -> int:
        return batch_per_rank * self.dp

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (``[pp, dp_replicate, dp_shard, tp]``, tp last)."""
        out: dict[str, int] = {}
        rest = rank
        for name in reversed(("pp", "dp_replicate", "dp_shard", "tp")):
            size = getattr(self, name)
            out[name] = rest % size
            rest //= size
        return out

    def describe(self) -> str:
        parts = [f"{n}={getattr(self, n)}" for n in DEGREES if getattr(self, n) > 1] + (
            ["sp"] if self.sp else []
        )
        text = ",".join(parts) or "single device"
        return text + (f", {self.accumulation_steps} accumulated micro-batches" if self.accumulation_steps > 1 else "")

    def with_options(self, **changes: object) -> "ParallelConfig":
        cfg = replace(self, **changes)  # type: ignore[arg-type]
        cfg.check()
        return cfg


@dataclass(frozen=True)
class ModelShape:
    """What validation needs to know of the model: its layer count and attention heads per layer
    (found in the export by boomfx/distributed/tensor_parallel.py)."""

    layers: int
    heads: Optional[int] = None
    kv_heads: Optional[int] = None
    hidden: Optional[int] = None
    projected: Mapping[str, tuple[str, int]] = field(default_factory=dict)  # fqn -> (style, split dim size)


def check_against_model(cfg: ParallelConfig, shape: ModelShape) -> None:
    """The model-dependent errors: TP must divide heads and split dimensions, PP needs a layer per stage."""
    if cfg.pp > 1 and cfg.pp > shape.layers:
        raise OptionError(
            f"--parallel: pp={cfg.pp} stages but the model has {shape.layers} layers "
            f"(at most one stage per layer)"
        )
    if cfg.pp > 1 and cfg.pp * cfg.stages_per_rank > shape.layers:
        raise OptionError(
            f"--pp-schedule interleaved_1f1b: pp={cfg.pp} x {cfg.stages_per_rank} stages per rank = "
            f"{cfg.pp * cfg.stages_per_rank} stages but the model has {shape.layers} layers "
            f"(at most one stage per layer; --pp-stages-per-rank sets the chunks per rank)"
        )
    if cfg.tp > 1:
        for what, count in (
            ("attention heads", shape.heads),
            ("key/value heads", shape.kv_heads),
            ("hidden size", shape.hidden),
        ):
            if count is not None and count % cfg.tp:
                raise OptionError(f"--parallel: tp={cfg.tp} does not divide the model's {count} {what}")
        for fqn, (style, size) in shape.projected.items():
            if size % cfg.tp:
                raise OptionError(
                    f"--parallel: tp={cfg.tp} does not divide {fqn} ({style}: dimension {size})"
                )
