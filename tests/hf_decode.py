"""Small ``transformers`` decoders for the serving tests: the plain ``model(input_ids)`` export, the
decode-step export that carries a ``DynamicCache``, and a real CPU decode loop (the truth)."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.export import Dim

VOCAB = 256
MAX_BATCH = 64
MAX_PAST = 510          # the decode-step export's cache range is [2, MAX_PAST]


def llama(layers: int = 2) -> Any:
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).eval()


def sliding(kind: str, window: int) -> Any:
    """A Mistral (every layer slides) or a Gemma-3 text model (5 sliding : 1 full) of 6 layers."""
    import transformers
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=VOCAB, max_position_embeddings=512, sliding_window=window)
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(num_hidden_layers=2, **common)).eval()
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(num_hidden_layers=6, head_dim=16,
                                                                        **common)).eval()


def gemma2(layers: int = 2, window: Optional[int] = 8) -> Any:
    """A Gemma-2 text model: transformers runs its attention written out (``_supports_sdpa = False``: logit
    soft-capping), every other layer sliding over ``window`` tokens (None: every layer full), the final
    logits soft-capped."""
    import transformers
    torch.manual_seed(0)
    types = {} if window is not None else {"layer_types": ["full_attention"] * layers}
    cfg = transformers.Gemma2Config(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                                    max_position_embeddings=512, sliding_window=window or 4096, **types)
    return transformers.Gemma2ForCausalLM(cfg).eval()


def export_plain(model: Any) -> torch.export.ExportedProgram:
    model.config.use_cache = False
    ep = torch.export.export(model, (), {"input_ids": torch.randint(0, VOCAB, (2, 16))},
                             dynamic_shapes={"input_ids": {0: Dim("batch", min=1, max=MAX_BATCH),
                                                           1: Dim("seq", min=2, max=512)}}, strict=False)
    model.config.use_cache = True
    return ep


class DecodeStep(torch.nn.Module):
    """``model(input_ids, past_key_values)`` returning logits and the grown cache: a decode step."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, past_key_values: Any) -> Any:
        out = self.model(input_ids=input_ids, past_key_values=past_key_values, use_cache=True)
        return out.logits, out.past_key_values


def prefilled_cache(model: Any, batch: int, tokens: int) -> Any:
    """A real ``DynamicCache`` after a prefill of ``tokens`` random tokens."""
    import transformers
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (batch, tokens)), past_key_values=cache, use_cache=True)
    return cache


def export_decode_step(model: Any) -> torch.export.ExportedProgram:
    """The decode step with the cache as inputs ([batch, kv_heads, past, head_dim] per layer)."""
    from transformers.integrations.executorch import register_dynamic_cache_export_support
    register_dynamic_cache_export_support()
    batch, past = Dim("batch", min=1, max=MAX_BATCH), Dim("past", min=2, max=MAX_PAST)
    layers = model.config.num_hidden_layers
    per_layer = {0: batch, 2: past}
    # examples of 2 new tokens and 7 cached: 0/1-sized examples would specialise the dims
    return torch.export.export(DecodeStep(model), (), {"input_ids": torch.randint(0, VOCAB, (3, 2)),
                                                       "past_key_values": prefilled_cache(model, 3, 7)},
                               dynamic_shapes={"input_ids": {0: batch, 1: Dim("seq", min=1, max=512)},
                                               "past_key_values": [[per_layer] * layers, [per_layer] * layers]},
                               strict=False)


def decode_loop(model: Any, batch: int, prompt: int, steps: int) -> Any:
    """A greedy CPU decode loop as ``generate`` runs it: prefill, then ``steps`` one-token steps."""
    import transformers
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.randint(0, VOCAB, (batch, prompt))
    with torch.no_grad():
        for _ in range(steps + 1):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            ids = out.logits[:, -1:].argmax(-1)
    return cache


def cache_bytes(cache: Any) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
