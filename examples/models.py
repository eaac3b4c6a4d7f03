"""Small plain-PyTorch models used by the examples and the tests (no external packages needed)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 256, d_out: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, stride=2)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """GPT-2-style decoder: learned positions, pre-LN blocks, causal SDPA, an LM head of its own or, with
    ``tied``, GPT-2's (``lm_head.weight`` is ``wte.weight``)."""

    def __init__(self, vocab: int = 512, d: int = 64, layers: int = 2, heads: int = 4, max_seq: int = 256,
                 tied: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_seq, d)
        self.h = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.input_norm = RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.post_norm = RMSNorm(d)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.input_norm(x)
        # sizes from the norm's output, not x: under sequence parallelism x holds seq / tp positions
        # and h the gathered sequence
        b, t, c = h.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them
        q = self.q(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama-style decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP."""

    def __init__(self, vocab: int = 512, d: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 hidden: int = 176) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.head_dim = d // heads

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=idx.device).float() / self.head_dim))
        freqs = torch.outer(torch.arange(t, device=idx.device).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def gpt2_small() -> GPT:
    """GPT-2 small's dimensions: 12 layers, width 768, 12 heads, vocab 50257, 1024 positions."""
    return GPT(vocab=50257, d=768, layers=12, heads=12, max_seq=1024)


__all__ = ["MLP", "SmallCNN", "GPT", "Llama", "gpt2_small", "math"]
