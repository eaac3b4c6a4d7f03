"""Shared fixtures: small models exported once per session (on meta for analysis, on CPU for real runs)."""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.export import Dim

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from models import GPT, MLP, Llama, SmallCNN  # noqa: E402

TOKEN_DIMS = {"idx": {0: Dim("batch", min=1, max=512), 1: Dim("seq", min=2, max=256)}}


def make_model(name: str, device: str = "cpu", layers: int = 2) -> tuple[torch.nn.Module, tuple, dict]:
    """(model, example inputs, dynamic shapes) for one of the test models (``layers``: gpt/llama)."""
    torch.manual_seed(0)
    with torch.device(device):
        if name == "mlp":
            return MLP(), (torch.randn(4, 64),), {"x": {0: Dim("batch", min=1, max=4096)}}
        if name == "cnn":
            return SmallCNN(), (torch.randn(2, 3, 16, 16),), {"x": {0: Dim("batch", min=1, max=512)}}
        if name in ("gpt", "llama"):
            model = (GPT(vocab=128, d=32, layers=layers, heads=4, max_seq=256) if name == "gpt" else
                     Llama(vocab=128, d=32, layers=layers, heads=4, kv_heads=2, hidden=64))
            return model, (torch.randint(0, 128, (2, 8)),), TOKEN_DIMS
        if name in ("hf_gpt2", "hf_bert"):
            return _transformers_model(name)
    raise KeyError(name)


def export_meta(name: str, layers: int) -> torch.export.ExportedProgram:
    """A meta-device export of the gpt/llama test model with ``layers`` layers (the depth-free tests)."""
    model, inputs, dynamic = make_model(name, "meta", layers)
    return torch.export.export(model, inputs, dynamic_shapes=dynamic)


def _transformers_model(name: str) -> tuple[torch.nn.Module, tuple, dict]:
    """A `transformers` model built from a small config (random weights, no hub download)."""
    transformers = pytest.importorskip("transformers")
    if name == "hf_gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=256,
                                      bos_token_id=0, eos_token_id=0)
        cfg.use_cache = False
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=128, max_position_embeddings=256)
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    model.eval()
    return model, (torch.randint(0, 128, (2, 8)),), {"input_ids": TOKEN_DIMS["idx"]}


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory):
    """Factory: exported(name, device="meta") -> (ExportedProgram, path of the saved .pt2)."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("exports")

    def get(name: str, device: str = "meta"):
        key = (name, device)
        if key not in cache:
            model, inputs, dynamic = make_model(name, device)
            if name == "cnn":
                model.eval()
            if name.startswith("hf_"):
                ep = torch.export.export(model, (), {"input_ids": inputs[0]}, dynamic_shapes=dynamic, strict=False)
            else:
                ep = torch.export.export(model, inputs, dynamic_shapes=dynamic)
            path = root / f"{name}-{device}.pt2"
            torch.export.save(ep, str(path))
            cache[key] = (ep, str(path))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def examples_dir() -> Path:
    return ROOT / "examples"


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("BOOMFX_NO_PROGRESS", "1")


# Under pytest-xdist (-n) each test file is one unit of work, so its module-scoped fixtures (captures,
# gloo truth runs) are built once; files that share a session fixture share a unit. (xdist's own
# --dist loadgroup reads marks into node ids that pytest 9 no longer uses, hence this scheduler.)
_SHARED_UNITS = {name: "gloo" for name in ("test_distributed_memory.py", "test_distributed_pp.py",
                                           "test_distributed_tp.py")}


# The longest units first (durations of a 2-worker run, 2026-12-01), so the short files fill the other
# worker while they run instead of one long file finishing last; xdist's default orders units by test count.
_LONGEST_FIRST = ("test_distributed_pp.py", "test_distributed_tp.py", "test_distributed_memory.py",
                  "test_first_contact.py", "test_amp_work.py", "test_parallel_search.py",
                  "test_gpu_validation_script.py", "test_fast_training.py", "test_memory_flat.py",
                  "test_resident_grads.py", "test_checkpoint_layers.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):   # a worker's collection is what the scheduler orders
        rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: file order kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False   # keep the order above

    class FileUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _SHARED_UNITS.get(Path(path).name, path)

    return FileUnits(config, log)


_last_module: list = [None]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At each new test file, collect the garbage once, then freeze what is left (gc.freeze): the session's
    exported programs and captures (millions of objects) stay out of every later collection. Truth
    measurements call gc.collect() before each profiled step, and over that heap each call cost seconds:
    a validate test took 26 s in the suite and 4 s alone. Unfrozen at the next file, so nothing that
    dies with a file's fixtures outlives it by more than one file."""
    module = getattr(item, "module", None)
    if module is not _last_module[0]:
        _last_module[0] = module
        gc.unfreeze()
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory):
    """Factory: zoo(name, device="meta") -> (ExportedProgram, path of the saved .pt2) for a model of
    tests/hf_zoo.py (small transformers models, exported as users do), built once per session."""
    pytest.importorskip("transformers")
    import hf_zoo
    cache: dict = {}
    root = tmp_path_factory.mktemp("zoo")

    def get(name: str, device: str = "meta"):
        key = (name, device)
        if key not in cache:
            ep = hf_zoo.export(name, device)
            path = root / f"{name}-{device}.pt2"
            torch.export.save(ep, str(path))
            cache[key] = (ep, str(path))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def two_rank_gloo_runs():
    """The 2-rank gloo truth runs of data (test_distributed_memory.py), pipeline (test_distributed_pp.py)
    and tensor parallelism (test_distributed_tp.py), by name, in one spawn."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import distributed_truth as truth
    from gloo_checks import MEMORY_TWO_RANKS, PP_TWO_RANKS, TP_TWO_RANKS

    return {r.config.name: r for r in truth.run_configs(MEMORY_TWO_RANKS + PP_TWO_RANKS + TP_TWO_RANKS)}


@pytest.fixture(scope="session")
def four_rank_gloo_runs():
    """The 4-rank gloo truth runs of HSDP (test_distributed_memory.py), TP x FSDP
    (test_distributed_tp.py), PP x TP, PP x DDP (also with gradient_as_bucket_view), PP x FSDP, also
    with FSDP mixed precision and resharding after forward, PP x torchtitan's TP plan and a tied GPT under PP x FSDP
    and PP x TP (test_distributed_pp.py), by name, in one
    start of 4 processes (forked from distributed_truth's forkserver)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import distributed_truth as truth
    from gloo_checks import (MEMORY_FOUR_RANKS, PP_FSDP_INTERLEAVED, PP_FSDP_INTERLEAVED_RESHARDING,
                             PP_FSDP_MIXED_PRECISION, PP_FSDP_RESHARD, PP_FSDP_WRAP_ROOT, PP_TIED_FOUR_RANKS,
                             PP_TP_VOCAB)

    configs = [truth.TruthConfig(model, parallel, 4, timed_steps=0)
               for parallel in ("tp_fsdp", "pp_tp", "pp_ddp") for model in ("llama", "gpt")]
    configs += [truth.TruthConfig(model, "pp_fsdp", 4, reshard_after_forward=False, timed_steps=0)
                for model in ("llama", "gpt")]
    configs += [truth.TruthConfig(model, "pp_ddp", 4, seq=8, gradient_as_bucket_view=True, timed_steps=0)
                for model in ("llama", "gpt")]
    configs += PP_FSDP_MIXED_PRECISION + PP_FSDP_RESHARD + PP_FSDP_INTERLEAVED + PP_FSDP_INTERLEAVED_RESHARDING
    configs += PP_FSDP_WRAP_ROOT + PP_TP_VOCAB + PP_TIED_FOUR_RANKS + MEMORY_FOUR_RANKS
    return {r.config.name: r for r in truth.run_configs(configs)}
