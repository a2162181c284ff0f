"""Sample residual models, each with a `*_factory()` returning `(model, example_inputs)`.

These are what `attnres-compile rewrite samples.models:gpt_factory ...` loads, and what the
tests rewrite next to the HF transformers models.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """PreNorm block; `style` picks how the residual is written: "plus", "iadd" or "torch_add"."""

    def __init__(self, dim: int, heads: int, style: str = "plus"):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = CausalSelfAttention(dim, heads), MLP(dim, 4 * dim)
        self.style = style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "iadd":
            x += self.attn(self.ln1(x))
            x += self.mlp(self.ln2(x))
        elif self.style == "torch_add":
            x = torch.add(self.attn(self.ln1(x)), x)
            x = torch.add(x, self.mlp(self.ln2(x)))
        else:
            x = x + self.attn(self.ln1(x))
            x = self.mlp(self.ln2(x)) + x
        return x


class ParallelBlock(nn.Module):
    """GPT-J / PaLM style: x + attn(ln(x)) + mlp(ln(x)), one link with two branches."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn, self.mlp = CausalSelfAttention(dim, heads), MLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn(h) + self.mlp(h)


class GPT(nn.Module):
    """A PreNorm GPT: token + position embeddings, `layers` blocks, final LayerNorm, linear head."""

    def __init__(self, vocab: int = 96, dim: int = 64, layers: int = 4, heads: int = 4, max_len: int = 64,
                 style: str = "plus", parallel: bool = False):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        make = (lambda: ParallelBlock(dim, heads)) if parallel else (lambda: Block(dim, heads, style))
        self.blocks = nn.ModuleList(make() for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _tokens(batch: int = 2, length: int = 16, vocab: int = 96) -> tuple[torch.Tensor]:
    return (torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0)),)


def gpt_factory(layers: int = 4, **kwargs):
    """A small PreNorm GPT in eval mode and example token ids."""
    torch.manual_seed(0)
    return GPT(layers=layers, **kwargs).eval(), _tokens()


def parallel_gpt_factory():
    return gpt_factory(parallel=True)


def iadd_gpt_factory():
    return gpt_factory(style="iadd")


def torch_add_gpt_factory():
    return gpt_factory(style="torch_add")


def long_chain(links: int, width: int = 4) -> fx.GraphModule:
    """A synthetic residual chain `h = h + tanh(w * h)` of `links` links, built as an fx graph directly
    (one weight `w` of size `width` shared by every branch: a branch holds a learned op)."""
    root = nn.Module()
    root.w = nn.Parameter(torch.linspace(0.5, 1.5, width))
    g = fx.Graph()
    h = g.placeholder("x")
    w = g.get_attr("w")
    for _ in range(links):
        h = g.call_function(operator.add, (h, g.call_function(torch.tanh, (g.call_function(operator.mul, (w, h)),))))
    g.output(h)
    return fx.GraphModule(root, g)


def onnx_chain(path, links: int, width: int = 8):
    """An ONNX file of `h = h + h @ W_k` for `links` links (a residual chain whose branches are MatMuls),
    written to `path`; returns `path`."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng, nodes, inits, prev = np.random.default_rng(0), [], [], "x"
    for k in range(1, links + 1):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) * 0.1).astype(np.float32), f"w{k}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{k}"], [f"v{k}"]), helper.make_node("Add", [prev, f"v{k}"], [f"h{k}"])]
        prev = f"h{k}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", width])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["b", width])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path
