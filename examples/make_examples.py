"""Export the example programs shipped in examples/ (on the meta device: no weights in the files).

    python examples/make_examples.py          # rewrites examples/*.pt2
"""
from __future__ import annotations

import os
import sys

import torch
from torch.export import Dim

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, MLP, Llama, gpt2_small  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def export_tokens(model: torch.nn.Module, path: str, max_seq: int) -> None:
    idx = torch.zeros(2, 16, dtype=torch.long, device="meta")
    dynamic = {"idx": {0: Dim("batch", min=1, max=1024), 1: Dim("seq", min=2, max=max_seq)}}
    ep = torch.export.export(model, (idx,), dynamic_shapes=dynamic)
    torch.export.save(ep, path)
    print(f"wrote {path} ({os.path.getsize(path) / 1024:.0f} KiB)")


def main() -> None:
    with torch.device("meta"):
        mlp = MLP()
        gpt = GPT(vocab=512, d=64, layers=2, heads=4, max_seq=256)
        llama = Llama()
        gpt2 = gpt2_small()
    x = torch.zeros(8, 64, device="meta")
    ep = torch.export.export(mlp, (x,), dynamic_shapes={"x": {0: Dim("batch", min=1, max=65536)}})
    torch.export.save(ep, os.path.join(HERE, "mlp.pt2"))
    export_tokens(gpt, os.path.join(HERE, "gpt_tiny.pt2"), 256)
    export_tokens(llama, os.path.join(HERE, "llama_tiny.pt2"), 4096)
    export_tokens(gpt2, os.path.join(HERE, "gpt2_small.pt2"), 1024)


if __name__ == "__main__":
    main()
