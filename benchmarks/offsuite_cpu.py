"""Off-suite CPU accuracy: models written the way users write them, none of them used to build or tune boomfx.

Hand-written ``nn.Module`` models (an LSTM language model, a bidirectional GRU classifier, a Conv1d audio
net, a small U-Net with GroupNorm and transposed convolutions, ``nn.TransformerEncoder`` with its default
dropout, an MLP-Mixer, a DLRM-like model with ``EmbeddingBag``, a convolutional VAE), GPT-2 and BERT with
transformers' default dropouts, and twenty ``transformers`` architectures no other benchmark or test builds
(``_architecture_cases``; small configs, random weights), each exported with a dynamic batch twice: in eval
mode for the inference step, in training mode (dropouts and batch norms active) for the training step. Each
step is predicted and run for real by ``boomfx.validate`` at torch's default thread count, wall clock, the
CLI's defaults (no kernel database: this host's probe); a crash or refusal is a result (its line in the
table). Writes ``benchmarks/results/offsuite_cpu.{json,md}``.

    python benchmarks/offsuite_cpu.py [--models lstm,gru] [--repeats 8] [--stem offsuite_cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# the nn.Module models written here: their training step reduces the output by its mean (transformers'
# models take the CLI's "auto" loss: cross-entropy over a language model's logits, else the mean)
HAND_WRITTEN = frozenset({"lstm", "gru", "audio1d", "unet", "torchtf", "mixer", "dlrm", "vae"})


class LSTMLM(nn.Module):
    def __init__(self, vocab=5000, d=256, layers=2):
        super().__init__(); self.emb = nn.Embedding(vocab, d); self.rnn = nn.LSTM(d, d, layers, batch_first=True); self.out = nn.Linear(d, vocab)
    def forward(self, x):
        h, _ = self.rnn(self.emb(x)); return self.out(h)

class GRUClassifier(nn.Module):
    def __init__(self, d_in=80, d=192, classes=30):
        super().__init__(); self.rnn = nn.GRU(d_in, d, 2, batch_first=True, bidirectional=True); self.fc = nn.Linear(2 * d, classes)
    def forward(self, x):
        h, _ = self.rnn(x); return self.fc(h.mean(1))

class AudioConv1d(nn.Module):
    def __init__(self):
        super().__init__()
        chans = [1, 32, 64, 128, 128]
        self.body = nn.Sequential(*[nn.Sequential(nn.Conv1d(a, b, 9, stride=2, padding=4), nn.BatchNorm1d(b), nn.ReLU()) for a, b in zip(chans, chans[1:])])
        self.head = nn.Linear(128, 35)
    def forward(self, x):
        return self.head(self.body(x).mean(-1))

class TinyUNet(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        blk = lambda a, b: nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.GroupNorm(8, b), nn.SiLU(), nn.Conv2d(b, b, 3, padding=1), nn.GroupNorm(8, b), nn.SiLU())
        self.d1, self.d2, self.mid = blk(3, c), blk(c, 2 * c), blk(2 * c, 4 * c)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2); self.u2 = blk(4 * c, 2 * c)
        self.up1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2); self.u1 = blk(2 * c, c)
        self.out = nn.Conv2d(c, 3, 1)
    def forward(self, x):
        a = self.d1(x); b = self.d2(F.max_pool2d(a, 2)); m = self.mid(F.max_pool2d(b, 2))
        b = self.u2(torch.cat([self.up2(m), b], 1)); a = self.u1(torch.cat([self.up1(b), a], 1))
        return self.out(a)

class TorchTransformer(nn.Module):
    def __init__(self, vocab=8000, d=256, layers=4):
        super().__init__(); self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True, norm_first=True), layers)
        self.out = nn.Linear(d, vocab)
    def forward(self, x):
        return self.out(self.enc(self.emb(x)))

class Mixer(nn.Module):
    def __init__(self, patches=64, d=256, layers=4):
        super().__init__()
        self.proj = nn.Conv2d(3, d, 8, stride=8)
        self.tok = nn.ModuleList([nn.Sequential(nn.Linear(patches, 2 * patches), nn.GELU(), nn.Linear(2 * patches, patches)) for _ in range(layers)])
        self.ch = nn.ModuleList([nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(layers)])
        self.n1 = nn.ModuleList([nn.LayerNorm(d) for _ in range(layers)]); self.n2 = nn.ModuleList([nn.LayerNorm(d) for _ in range(layers)])
        self.head = nn.Linear(d, 100)
    def forward(self, x):
        x = self.proj(x).flatten(2).transpose(1, 2)
        for t, c, a, b in zip(self.tok, self.ch, self.n1, self.n2):
            x = x + t(a(x).transpose(1, 2)).transpose(1, 2)
            x = x + c(b(x))
        return self.head(x.mean(1))

class DLRMish(nn.Module):
    def __init__(self, tables=8, rows=20000, d=64):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, d, mode="sum") for _ in range(tables)])
        self.bot = nn.Sequential(nn.Linear(13, 256), nn.ReLU(), nn.Linear(256, d), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(d * (tables + 1), 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 1))
    def forward(self, dense, idx):
        feats = [self.bot(dense)] + [bag(idx[:, i, :]) for i, bag in enumerate(self.bags)]
        return self.top(torch.cat(feats, 1))

class ConvVAE(nn.Module):
    def __init__(self, z=64):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(32, 64, 4, 2, 1), nn.BatchNorm2d(64), nn.LeakyReLU(0.2), nn.Conv2d(64, 128, 4, 2, 1), nn.LeakyReLU(0.2))
        self.mu = nn.Linear(128 * 8 * 8, z); self.lv = nn.Linear(128 * 8 * 8, z); self.dec_in = nn.Linear(z, 128 * 8 * 8)
        self.dec = nn.Sequential(nn.ConvTranspose2d(128, 64, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(64, 32, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(32, 3, 4, 2, 1), nn.Sigmoid())
    def forward(self, x):
        h = self.enc(x).flatten(1); mu, lv = self.mu(h), self.lv(h)
        zz = mu + torch.randn_like(mu) * torch.exp(0.5 * lv)
        return self.dec(self.dec_in(zz).view(-1, 128, 8, 8))

def cases():
    B = torch.export.Dim("batch", min=2, max=256)
    yield "lstm", LSTMLM(), (torch.randint(0, 5000, (8, 64)),), ({0: B},)
    yield "gru", GRUClassifier(), (torch.randn(8, 100, 80),), ({0: B},)
    yield "audio1d", AudioConv1d(), (torch.randn(16, 1, 16000),), ({0: B},)
    yield "unet", TinyUNet(), (torch.randn(4, 3, 64, 64),), ({0: B},)
    yield "torchtf", TorchTransformer(), (torch.randint(0, 8000, (8, 128)),), ({0: B},)
    yield "mixer", Mixer(), (torch.randn(16, 3, 64, 64),), ({0: B},)
    yield "dlrm", DLRMish(), (torch.randn(64, 13), torch.randint(0, 20000, (64, 8, 4))), ({0: B}, {0: B})
    yield "vae", ConvVAE(), (torch.randn(16, 3, 64, 64),), ({0: B},)
    yield from _transformers_cases(B)
    yield from _architecture_cases(B)


def _transformers_cases(batch: torch.export.Dim):
    """GPT-2 and BERT as people fine-tune them: small configs with transformers' default dropouts (0.1)."""
    try:
        import transformers as tf
    except ImportError:
        return
    ids = torch.randint(0, 4096, (4, 128))
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, n_positions=512,
                                            bos_token_id=0, eos_token_id=0, use_cache=False))
    bert = tf.BertForMaskedLM(tf.BertConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                                            intermediate_size=1024, vocab_size=4096))
    for name, model in (("gpt2-dropout", gpt2), ("bert-dropout", bert)):
        model.train()
        yield name, model, (ids,), ({0: batch},)


def _architecture_cases(batch: torch.export.Dim):
    """transformers architectures none of the other benchmarks or tests build (small configs, random
    weights): encoders with relative or disentangled attention (DeBERTa-v2, XLNet, Funnel, ConvBERT),
    factorised embeddings (ALBERT, ELECTRA), an encoder-decoder (BART), CLIP's towers, ESM with rotary
    positions, DINOv2 and BEiT (relative position bias), SegFormer and MobileViT (convolutions and attention),
    RegNet (grouped convolutions, squeeze-excitation), Gemma-2 (soft-capping, sliding windows), and the
    state-space and recurrent families run on their slow paths (Mamba, Falcon-Mamba, Jamba, RWKV)."""
    try:
        import transformers as tf
    except ImportError:
        return
    common = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512, vocab_size=1000)
    ids = torch.randint(0, 1000, (4, 64))
    image = torch.randn(4, 3, 64, 64)
    vision = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, image_size=64,
                  patch_size=8)
    makers = {
        "deberta": lambda: tf.DebertaV2ForMaskedLM(tf.DebertaV2Config(**common, max_position_embeddings=128)),
        "albert": lambda: tf.AlbertForMaskedLM(tf.AlbertConfig(**common, embedding_size=64)),
        "electra": lambda: tf.ElectraForSequenceClassification(tf.ElectraConfig(**common, embedding_size=64)),
        "bart": lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, use_cache=False)),
        "clip-text": lambda: tf.CLIPTextModel(tf.CLIPTextConfig(
            vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512)),
        "clip-vision": lambda: tf.CLIPVisionModel(tf.CLIPVisionConfig(**vision)),
        "esm": lambda: tf.EsmForMaskedLM(tf.EsmConfig(
            vocab_size=33, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
            pad_token_id=1, mask_token_id=32, position_embedding_type="rotary")),
        "dinov2": lambda: tf.Dinov2Model(tf.Dinov2Config(**vision)),
        "beit": lambda: tf.BeitForImageClassification(tf.BeitConfig(**vision, use_relative_position_bias=True,
                                                                      num_labels=10)),
        "segformer": lambda: tf.SegformerForSemanticSegmentation(tf.SegformerConfig(
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[4, 2], hidden_sizes=[32, 64], num_attention_heads=[1, 2],
            decoder_hidden_size=64, num_labels=5)),
        "mobilevit": lambda: tf.MobileViTForImageClassification(tf.MobileViTConfig(
            image_size=64, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 80], num_labels=10)),
        "regnet": lambda: tf.RegNetForImageClassification(tf.RegNetConfig(
            hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], groups_width=16, num_labels=10)),
        "xlnet": lambda: tf.XLNetLMHeadModel(tf.XLNetConfig(vocab_size=1000, d_model=128, n_layer=2, n_head=4,
                                                             d_inner=512, use_mems_train=False)),
        "convbert": lambda: tf.ConvBertForMaskedLM(tf.ConvBertConfig(**common, embedding_size=128)),
        "funnel": lambda: tf.FunnelForMaskedLM(tf.FunnelConfig(vocab_size=1000, block_sizes=[1, 1], d_model=128,
                                                                n_head=4, d_head=32, d_inner=512)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, num_key_value_heads=2, head_dim=32,
                                                                sliding_window=32, use_cache=False)),
        "mamba": lambda: tf.MambaForCausalLM(tf.MambaConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2,
                                                             state_size=16, use_cache=False)),
        "falcon-mamba": lambda: tf.FalconMambaForCausalLM(tf.FalconMambaConfig(
            vocab_size=1000, hidden_size=128, num_hidden_layers=2, state_size=16, use_cache=False)),
        "jamba": lambda: tf.JambaForCausalLM(tf.JambaConfig(
            **common, num_key_value_heads=2, num_experts=4, expert_layer_period=2, attn_layer_period=2,
            attn_layer_offset=1, use_cache=False, use_mamba_kernels=False)),
        "rwkv": lambda: tf.RwkvForCausalLM(tf.RwkvConfig(
            vocab_size=1000, hidden_size=128, num_hidden_layers=2, attention_hidden_size=128, intermediate_size=512,
            context_length=128, use_cache=False)),
    }
    inputs = {"bart": (ids, ids), "clip-vision": (image,), "dinov2": (image,), "beit": (image,),
              "segformer": (image,), "mobilevit": (image,), "regnet": (image,)}
    for name, make in makers.items():
        args = inputs.get(name, (ids,))
        yield name, make(), args, tuple({0: batch} for _ in args)


def run(models: list[str], repeats: int, directory: str) -> list[dict]:
    import boomfx
    rows = []
    for name, model, args, dynamic in cases():
        if models and name not in models:
            continue
        for train in (False, True):
            path = os.path.join(directory, f"{name}-{'train' if train else 'eval'}.pt2")
            try:     # inference as people export it (eval mode), training with its dropouts and batch norms active
                model.train(train)
                torch.export.save(torch.export.export(model, args, dynamic_shapes=dynamic, strict=False), path)
                r = boomfx.validate(path, train=train, db="none", repeats=repeats,
                                    loss="mean" if train and name in HAND_WRITTEN else "auto")
            except Exception as exc:        # a failure is a result here: reported, not hidden
                rows.append({"model": name, "mode": "train" if train else "inference", "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            rows.append({"model": name, "mode": r.mode, "bindings": r.bindings,
                         "predicted_ms": r.predicted_time_ns / 1e6, "measured_ms": r.measured_time_ns / 1e6,
                         "time_error": r.predicted_time_ns / r.measured_time_ns - 1,
                         "predicted_peak_mib": r.predicted_peak_above_start_bytes / 2**20,
                         "measured_peak_mib": r.measured_peak_above_start_bytes / 2**20,
                         "memory_error": (r.predicted_peak_above_start_bytes / r.measured_peak_above_start_bytes - 1
                                          if r.measured_peak_above_start_bytes else None),
                         # page faults: charged (pages glibc maps afresh), estimated after trims (not
                         # charged), and the real step's (a median over its timed steps)
                         "predicted_fault_pages": r.predicted_fault_pages,
                         "predicted_refault_pages": r.predicted_refault_pages,
                         "measured_faults_per_step": r.measured_faults_per_step})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def render(payload: dict) -> str:
    lines = ["# Off-suite CPU accuracy: hand-written models nobody tuned for", "",
             f"{payload['host']}; {payload['when']}; `{payload['command']}`. Predicted: `boomfx.validate(..., db=\"none\")` "
             "(this host's probe, the CLI's default); real: the export's module at torch's default threads, wall clock, "
             "median of the timed steps after warm-up; memory: the profiler's peak above the step's start. "
             "Errors signed (predicted / real - 1).", "",
             "| model | mode | sizes | predicted | real | time err | pred peak | real peak | mem err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | - | failed: {r['error'][:120]} | | | | | |")
            continue
        mem = "-" if r["memory_error"] is None else f"{r['memory_error']:+.1%}"
        lines.append(f"| {r['model']} | {r['mode']} | {r['bindings']} | {r['predicted_ms']:.2f} ms | {r['measured_ms']:.2f} ms | "
                     f"{r['time_error']:+.1%} | {r['predicted_peak_mib']:.2f} MiB | {r['measured_peak_mib']:.2f} MiB | {mem} |")
    errors = [abs(r["time_error"]) for r in payload["rows"] if "error" not in r]
    if errors:
        signed = [r["time_error"] for r in payload["rows"] if "error" not in r]
        lines += ["", f"Time: median |error| {statistics.median(errors):.1%}, mean signed {statistics.mean(signed):+.1%}, "
                  f"worst {max(signed, key=abs):+.1%} over {len(errors)} steps."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--stem", default="offsuite_cpu")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        rows = run([m for m in a.models.split(",") if m], a.repeats, directory)
    payload = {"host": f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}",
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python benchmarks/offsuite_cpu.py " + " ".join(sys.argv[1:]), "rows": rows}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{a.stem}.json"), "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.join(RESULTS, f"{a.stem}.md"), "w") as f:
        f.write(render(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
