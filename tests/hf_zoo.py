"""Small `transformers` models a new user would bring, built from configs (no hub download) and exported
as people export them: on the meta device (or the CPU), ``strict=False``, dynamic batch and length dims.

Used by the first-contact tests (``tests/test_first_contact.py``, ``tests/test_tied_weights.py``,
``tests/test_amp_work.py``) through a cached fixture, and runnable as a script to write the .pt2 files::

    python tests/hf_zoo.py OUT_DIR [NAME ...]        # default: every model, meta device

Every config is tiny (1-2 layers, hidden 64) so the whole zoo exports in seconds on two cores.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.export import Dim

_HIDDEN = 64
_HEADS = 4
_VOCAB = 256


@dataclass(frozen=True)
class ZooModel:
    """How to build, feed and export one model."""

    build: Callable[[Any], torch.nn.Module]   # transformers module -> model (eval mode)
    inputs: Callable[[], dict[str, torch.Tensor]]
    dynamic: Callable[[], dict[str, Any]]


def _tokens(batch: int = 2, seq: int = 8) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, _VOCAB, (batch, seq))}


def _token_dims() -> dict[str, Any]:
    return {"input_ids": {0: Dim("batch", min=1, max=512), 1: Dim("seq", min=2, max=512)}}


def _image(size: int) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {"pixel_values": torch.randn(2, 3, size, size)}


def _image_dims() -> dict[str, Any]:
    return {"pixel_values": {0: Dim("batch", min=1, max=1024)}}


def _decoder_lm(config_name: str, model_name: str, **extra: Any) -> Callable[[Any], torch.nn.Module]:
    def build(T: Any) -> torch.nn.Module:
        cfg = getattr(T, config_name)(vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=_HEADS,
                                      max_position_embeddings=512, use_cache=False, **extra)
        return getattr(T, model_name)(cfg)
    return build


def _gpt2(T: Any) -> torch.nn.Module:
    cfg = T.GPT2Config(n_layer=2, n_embd=_HIDDEN, n_head=_HEADS, vocab_size=_VOCAB, n_positions=512,
                       bos_token_id=0, eos_token_id=0, use_cache=False)
    return T.GPT2LMHeadModel(cfg)


def _t5(T: Any) -> torch.nn.Module:
    # T5's shared embedding is read by the encoder, the decoder and (tied) the LM head.
    cfg = T.T5Config(vocab_size=_VOCAB, d_model=_HIDDEN, d_kv=16, d_ff=128, num_layers=1, num_decoder_layers=1,
                     num_heads=_HEADS, use_cache=False, decoder_start_token_id=0, tie_word_embeddings=True)
    return T.T5ForConditionalGeneration(cfg)


def _t5_inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, _VOCAB, (2, 8)), "decoder_input_ids": torch.randint(0, _VOCAB, (2, 6))}


def _t5_dims() -> dict[str, Any]:
    batch = Dim("batch", min=1, max=512)
    return {"input_ids": {0: batch, 1: Dim("seq", min=2, max=512)},
            "decoder_input_ids": {0: batch, 1: Dim("dec_seq", min=2, max=512)}}


def _whisper(T: Any) -> torch.nn.Module:
    cfg = T.WhisperConfig(vocab_size=_VOCAB, num_mel_bins=16, d_model=_HIDDEN, encoder_layers=1, decoder_layers=1,
                          encoder_attention_heads=_HEADS, decoder_attention_heads=_HEADS, encoder_ffn_dim=128,
                          decoder_ffn_dim=128, max_source_positions=32, max_target_positions=64, use_cache=False,
                          decoder_start_token_id=0, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return T.WhisperForConditionalGeneration(cfg)


def _whisper_inputs() -> dict[str, torch.Tensor]:
    # the encoder's two convolutions halve the frames: 64 mel frames -> 32 source positions
    return {"input_features": torch.randn(2, 16, 64), "decoder_input_ids": torch.randint(0, _VOCAB, (2, 6))}


def _whisper_dims() -> dict[str, Any]:
    batch = Dim("batch", min=1, max=512)
    return {"input_features": {0: batch}, "decoder_input_ids": {0: batch, 1: Dim("dec_seq", min=2, max=64)}}


def _vit(T: Any) -> torch.nn.Module:
    cfg = T.ViTConfig(hidden_size=_HIDDEN, num_hidden_layers=2, num_attention_heads=_HEADS, intermediate_size=128,
                      image_size=32, patch_size=8, num_labels=10)
    return T.ViTForImageClassification(cfg)


def _resnet(T: Any) -> torch.nn.Module:
    cfg = T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="bottleneck",
                         num_labels=10)
    return T.ResNetForImageClassification(cfg)


def _mixtral(experts: str) -> Callable[[Any], torch.nn.Module]:
    def build(T: Any) -> torch.nn.Module:
        kwargs = {} if experts == "default" else {"experts_implementation": experts}
        cfg = T.MixtralConfig(vocab_size=_VOCAB, hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=_HEADS, num_key_value_heads=2, num_local_experts=4,
                              num_experts_per_tok=2, max_position_embeddings=512, use_cache=False, **kwargs)
        return T.MixtralForCausalLM(cfg)
    return build


def _mobilenet(T: Any) -> torch.nn.Module:
    cfg = T.MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_labels=10)
    return T.MobileNetV2ForImageClassification(cfg)


def _swin(T: Any) -> torch.nn.Module:
    cfg = T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4,
                       num_labels=10)
    return T.SwinForImageClassification(cfg)


def _efficientnet(T: Any) -> torch.nn.Module:
    cfg = T.EfficientNetConfig(image_size=32, width_coefficient=0.25, depth_coefficient=0.2, num_labels=10,
                               hidden_dim=320)  # round_filters(1280 x 0.25)
    return T.EfficientNetForImageClassification(cfg)


class TiedLM(torch.nn.Module):
    """The smallest tied model: an embedding whose weight is also the output head's."""

    def __init__(self, vocab: int = _VOCAB, d: int = _HIDDEN) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.mix = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mix(self.embed(input_ids))))


ZOO: dict[str, ZooModel] = {
    "tied": ZooModel(lambda T: TiedLM(), _tokens, _token_dims),
    "gpt2": ZooModel(_gpt2, _tokens, _token_dims),
    "mistral": ZooModel(_decoder_lm("MistralConfig", "MistralForCausalLM", num_key_value_heads=2), _tokens, _token_dims),
    "phi": ZooModel(_decoder_lm("PhiConfig", "PhiForCausalLM"), _tokens, _token_dims),
    "phi3": ZooModel(_decoder_lm("Phi3Config", "Phi3ForCausalLM", pad_token_id=0,
                                            bos_token_id=0, eos_token_id=0), _tokens, _token_dims),
    "t5": ZooModel(_t5, _t5_inputs, _t5_dims),
    "whisper": ZooModel(_whisper, _whisper_inputs, _whisper_dims),
    "vit": ZooModel(_vit, _image(32), _image_dims),
    "resnet": ZooModel(_resnet, _image(32), _image_dims),
    "mixtral": ZooModel(_mixtral("default"), _tokens, _token_dims),
    "mixtral_batched": ZooModel(_mixtral("batched_mm"), _tokens, _token_dims),
    "mobilenet_v2": ZooModel(_mobilenet, _image(32), _image_dims),
    "swin": ZooModel(_swin, _image(32), _image_dims),
    "efficientnet": ZooModel(_efficientnet, _image(32), _image_dims),
}


def build(name: str, device: str = "meta") -> tuple[torch.nn.Module, dict[str, torch.Tensor], dict[str, Any]]:
    """(model in eval mode on ``device``, example keyword inputs on ``device``, dynamic shapes)."""
    import transformers

    spec = ZOO[name]
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.build(transformers).eval()
        inputs = spec.inputs()
    return model, inputs, spec.dynamic()


def graph_args(ep: torch.export.ExportedProgram, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The flat arguments of ``ep``'s graph (or of a program captured from it): its weights, buffers and
    constants by name, the user's ``inputs`` by input name, in the signature's order."""
    state = {**ep.state_dict, **ep.constants}
    return [state[spec.target] if spec.target is not None else inputs[spec.arg.name]
            for spec in ep.graph_signature.input_specs]


def export(name: str, device: str = "meta") -> torch.export.ExportedProgram:
    """``torch.export.export(model, (), inputs, dynamic_shapes=..., strict=False)`` of one zoo model."""
    model, inputs, dynamic = build(name, device)
    return torch.export.export(model, (), inputs, dynamic_shapes=dynamic, strict=False)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name in argv[1:] or list(ZOO):
        path = out / f"{name}.pt2"
        torch.export.save(export(name), str(path))
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
