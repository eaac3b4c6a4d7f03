"""Inductor's pool of dead buffers (``passes/buffer_reuse.py``) against Inductor itself on this CPU.

Truth is Inductor's own wrapper and the real step: while ``boomfx.validate`` compiles and runs the step in
a fresh process (Inductor's caches off, so it generates code), its ``AllocateLine.plan`` decisions are
recorded, and the step's profiler peak is compared with the prediction.

- transformers' OPT (ReLU MLP, output head tied to the embedding) with a 1000-token vocabulary: Inductor's
  backward holds the last layer's 2 MiB MLP-gradient buffer through that layer's backward for the first
  layer's; without the pool our prediction was 8.8% under;
- transformers' RoBERTa encoder in inference: the same hold ties Inductor's estimate exactly and Inductor
  refuses it (taken, our prediction was 50% over).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from boomfx.core.program import META_BUFFER_REUSE, ProgramOptions
from boomfx.frontend.capture import capture
from boomfx.passes.liveness import liveness_pass
from boomfx.passes.peak_memory_order import compiled_graph_runs

BATCH, SEQ, VOCAB = 4, 128, 1000
MLP_GRAD = BATCH * SEQ * 1024 * 4          # [tokens, ffn] fp32: the held buffer

# Per compiled graph, the byte sizes of the buffers Inductor's wrapper takes from its pool, then the step's
# memory error (argv: file, train|inference).
_RECORD = r"""
import json, sys
import torch._inductor.codegen.wrapper as W
from boomfx.validate import validate
graphs = []
plan = W.AllocateLine.plan
def recording(self, state):
    line = plan(self, state)
    if isinstance(line, W.ReuseLine):
        size = W.V.graph.sizevars.optimization_hint(W.V.graph.get_allocation_storage_size(self.node), fallback=0)
        graphs[-1].append(int(size) * W.get_dtype_size(self.node.get_dtype()))
    return line
W.AllocateLine.plan = recording
estimate = W.EfficientPeakEstimate.__init__
def new_graph(self):
    estimate(self)
    graphs.append([])
W.EfficientPeakEstimate.__init__ = new_graph
train = sys.argv[2] == "train"
r = validate(sys.argv[1], train=train, compile=True, db="none", repeats=1, warmup=0, threads=1,
             **({"loss": "cross_entropy"} if train else {}))
print(json.dumps({"graphs": graphs, "error": r.memory_error, "predicted": r.predicted_peak_above_start_bytes,
                  "measured": r.measured_peak_above_start_bytes}))
"""


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _export(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "opt":
        cfg = transformers.OPTConfig(num_hidden_layers=2, hidden_size=256, ffn_dim=1024, num_attention_heads=4,
                                     vocab_size=VOCAB, max_position_embeddings=512, word_embed_proj_dim=256,
                                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, use_cache=False)
        model = transformers.OPTForCausalLM(cfg).train()
    else:
        cfg = transformers.RobertaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                                         intermediate_size=1024, vocab_size=VOCAB, max_position_embeddings=514,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model = transformers.RobertaModel(cfg, add_pooling_layer=False).eval()
    return torch.export.export(_Logits(model), (torch.randint(3, VOCAB, (BATCH, SEQ)),), strict=False)


def _real(ep, tmp_path, mode: str) -> dict:
    path = tmp_path / "model.pt2"
    torch.export.save(ep, str(path))
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    out = subprocess.run([sys.executable, "-c", _RECORD, str(path), mode], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _program(ep, train: bool):
    options = dict(train=train, compile=True, target_kind="cpu")
    if train:
        options["loss"] = "cross_entropy"
    return capture(ep, options=ProgramOptions(**options))


def _planned_reuse_sizes(program) -> dict[str, list[int]]:
    """Per compiled graph, the byte sizes of the outputs ``plan_buffer_reuse`` gave a pooled buffer."""
    info = liveness_pass(program)
    size_of = {iv.storage_id: iv.nbytes for iv in info.intervals}
    out: dict[str, list[int]] = {}
    for graph, run in compiled_graph_runs(program).items():
        sizes = []
        for node in run:
            marks = node.meta.get(META_BUFFER_REUSE) or ()
            sids = info.node_storages.get(node.name, ())
            sizes.extend(int(size_of[sids[i]]) for i, mark in enumerate(marks) if mark is not None)
        out[graph] = sorted(sizes)
    return out


def test_decoder_backward_holds_the_mlp_gradient_buffer_as_inductor_does(tmp_path):
    """Inductor's backward takes exactly one pooled buffer of the MLP gradient's size, so do we, and the
    predicted peak is the real step's within 2% (8.8% under without the pool)."""
    ep = _export("opt")
    real = _real(ep, tmp_path, "train")
    backward = real["graphs"][-1]                # the training step's backward, compiled last
    assert backward.count(MLP_GRAD) == 1
    assert _planned_reuse_sizes(_program(ep, True))["backward"].count(MLP_GRAD) == 1
    assert abs(real["error"]) <= 0.02, real


def test_encoder_inference_refuses_the_hold_its_estimate_ties(tmp_path):
    """Neither Inductor nor we hold an MLP-sized buffer in RoBERTa's inference graph, and the predicted
    peak is the real one within 1%."""
    ep = _export("roberta")
    real = _real(ep, tmp_path, "inference")
    assert MLP_GRAD not in real["graphs"][-1]
    assert MLP_GRAD not in _planned_reuse_sizes(_program(ep, False))["forward"]
    assert abs(real["error"]) <= 0.01, real


def test_reused_storage_lives_from_its_first_writer_to_the_reusing_outputs_last_reader():
    """The liveness gives a reusing output the held storage, live without a gap through the reuse."""
    program = _program(_export("opt"), True)
    info = liveness_pass(program)
    by_name = {n.name: n for n in program.graph.nodes}
    order = {n.name: i for i, n in enumerate(program.graph.nodes)}
    marked = [(n, i, mark) for n in program.graph.nodes if n.op == "call_function"
              for i, mark in enumerate(n.meta.get(META_BUFFER_REUSE) or ()) if mark is not None]
    assert marked
    for node, index, (held_name, held_index) in marked:
        held_sid = info.node_storages[held_name][held_index]
        assert info.node_storages[node.name][index] == held_sid          # one storage, no fresh allocation
        interval = info.intervals[held_sid]
        # held from its first writer (earlier, when the held buffer took a pooled one itself) through the reuse
        assert interval.start_step <= order[held_name] < order[node.name] <= interval.end_step
        if not isinstance(node.meta["val"], (list, tuple)):       # one output: its readers are its users
            assert interval.end_step >= max((order[u.name] for u in node.users), default=order[node.name])
        assert by_name[held_name].op == "call_function"               # a kernel's buffer, never a graph input
    # without the marks every output has a storage of its own
    plain = liveness_pass(program, buffer_reuse=False)
    assert len(plain.intervals) == len(info.intervals) + len(marked)


def _shared_storages(program) -> list[tuple[str, str, str]]:
    """(kernel, input, input) where two inputs of one kernel that are different values (storages of their
    own without the pool) were given one storage by the pool: two live values in one buffer."""
    pooled = liveness_pass(program)
    plain = liveness_pass(program, buffer_reuse=False)
    clashes = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = [n for n in node.all_input_nodes if plain.node_storages.get(n.name)]
        for i, a in enumerate(inputs):
            for b in inputs[i + 1:]:
                if set(plain.node_storages[a.name]) & set(plain.node_storages[b.name]):
                    continue                     # views of one value
                if set(pooled.node_storages[a.name]) & set(pooled.node_storages[b.name]):
                    clashes.append((node.name, a.name, b.name))
    return clashes


def test_a_storage_written_over_in_place_is_not_pooled_while_its_chain_lives(tmp_path):
    """A residual stream is one storage written over in place by each add + norm kernel. The links of that
    chain are values of their own; pooling one at its last reader handed the live storage to the next
    matching allocation: in BART's compiled inference a decoder layer's key and value projections got one
    buffer (our peak 13% under the real step's; 0.1% under since)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BartConfig(encoder_layers=2, decoder_layers=2, d_model=256, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                                  vocab_size=VOCAB, max_position_embeddings=512, dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, use_cache=False)
    model = transformers.BartModel(cfg).eval()

    class _Decoded(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, decoder_input_ids=decoder_ids).last_hidden_state

    ep = torch.export.export(_Decoded(), (torch.randint(3, VOCAB, (BATCH, SEQ)),
                                          torch.randint(3, VOCAB, (BATCH, SEQ // 2))), strict=False)
    program = _program(ep, False)
    assert any(n.meta.get(META_BUFFER_REUSE) for n in program.graph.nodes)     # the pool is in use
    assert _shared_storages(program) == []
    assert _shared_storages(_program(_export("opt"), True)) == []
    real = _real(ep, tmp_path, "inference")       # with passes/cpu_sdpa.py's float masks: 0.1% under
    assert abs(real["error"]) <= 0.01, real
