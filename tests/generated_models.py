"""Random residual models whose ground truth is known: every add they execute is tagged.

A `ModelSpec` (drawn by the hypothesis strategy `model_specs`, or written by hand) describes
one or two residual streams; `build(spec)` turns it into an `nn.Module` and `record(model,
inputs)` runs it eagerly once and returns a `Recording`: every add the forward executes, in
execution order, with its value and its ground-truth role:

  - part of residual link `lid` (its root, the last add of the link, or an inner add of an
    n-ary sum), with the link's skip value, branch values and the chain it belongs to;
  - or not a residual link, with the expected reason (`REASONS`).

Frontends (torch.export here, ONNX later) keep the adds in execution order, so the i-th add
node of a traced graph is the i-th recorded add; tests check that alignment by value, which
maps every graph add to its role rigorously (see tests/test_generated.py).

What a spec can hold (DESIGN.md §2):
  - streams: `[B, T, D]` ("seq", feature axis -1) or NCHW ("nchw", feature axis 1); the root is
    the raw input, a projection/stem, or a projection plus a position table (a non-residual add);
  - links of 1 to 3 branches (parallel links are one n-ary sum) built as `x + f`, `f + x`,
    `torch.add`, `x.add(f)`, `x += f`, and for parallel links the grouped/tail/chain orders;
  - branch kinds: MLP, attention (with an optional additive mask input), cross-attention to
    the first stream (encoder-decoder), conv, near-identity (1e-3 * linear), nested (a branch
    containing its own residual chain), shared (one module instance used by several branches);
    pre-norms LayerNorm/GroupNorm, a hand-written RMSNorm (an eps add) or none; explicit bias
    adds; a scaling `y + y` (not a residual); eval dropout on the branch output;
  - value-preserving ops on the skip path: same-dtype casts, contiguous, clone, eval dropout,
    identity; layout toggles `[B, T, D] <-> [B*T, D]` between links;
  - post-norm (`LN(x + f)`) and post-activation (`relu(x + f)`) links, which split the chain;
  - several outputs: each stream's output and optionally an intermediate hidden state.

In-place adds (`x += f`) are only drawn where the eager model stays well defined: never on a
graph input, on a returned hidden state, or right after a layout toggle (a view).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

# expected reason (a substring of the report's reason) per kind of non-residual add
REASONS = {
    "constant": "is a constant",                                   # bias add, position table
    "scalar": "adds a scalar constant",                            # eps
    "not_a_skip": "no operand that every other operand depends on",  # attention mask
    "same_value": "two operands are the same value",               # y + y
}

B, T, T_DEC, HW = 2, 3, 4, 3
SEQ_IN, IMG_IN = 5, 3
OUT_SCALE = 0.5       # last layer of every branch: keeps a 40-link stream O(1)-O(10)
NEAR_ID_SCALE = 1e-3

SEQ_KINDS = ("mlp", "attn", "near_id", "nested", "shared", "xattn")
NCHW_KINDS = ("conv", "mlp", "near_id", "nested", "shared")
SKIP_OPS = ("to", "float", "type_as", "contiguous", "clone", "dropout", "fdropout", "identity")
FORMS_1 = ("x+f", "f+x", "add", "add_rev", "method", "iadd")
FORMS_N = ("chain", "f_first", "grouped", "tail", "iadd")


# ----------------------------------------------------------------------------- specs

@dataclass
class BranchSpec:
    kind: str                 # see SEQ_KINDS / NCHW_KINDS
    norm: str = "none"        # seq: ln | rms | none; nchw: gn | rms | none
    bias_add: bool = False    # explicit `lin(x) + bias` adds (non-residual)
    double: bool = False      # `y + y` inside the branch (non-residual)
    out_dropout: bool = False  # eval dropout on the branch output
    inner_links: int = 0      # nested: links of the inner chain
    inner_width: int = 0      # nested: width of the inner chain (0: same as the stream)
    shared: int = -1          # shared: index into the model's pool for this layout/width (the pooled
    #                           module is a LN/GN + MLP/conv branch; the other fields are ignored)


@dataclass
class LinkSpec:
    branches: list[BranchSpec]
    form: str = "x+f"
    skip_ops: tuple[str, ...] = ()
    post: str | None = None        # ln | relu: the stream continues through a non-linear op
    toggle_layout: bool = False    # seq: reshape [B,T,D] <-> [B*T,D] before this link


@dataclass
class StreamSpec:
    layout: str                     # seq | nchw
    width: int
    root: str = "embed"             # input | embed | pos
    links: list[LinkSpec] = field(default_factory=list)
    final_norm: bool = False
    head: bool = False
    return_hidden: int | None = None  # also return the hidden state after this many links


@dataclass
class ModelSpec:
    streams: list[StreamSpec]
    mask: bool = False    # an additive attention-mask input, used by every attention branch
    seed: int = 0

    @property
    def decoder(self) -> bool:
        """Stream 1 cross-attends to stream 0's output."""
        return len(self.streams) == 2 and all(s.layout == "seq" for s in self.streams)


# ----------------------------------------------------------------------------- recording

@dataclass
class AddRecord:
    role: str                # "link" or "other"
    value: torch.Tensor
    lid: int = -1            # link id (role "link")
    reason: str = ""         # key of REASONS (role "other")


@dataclass
class LinkRecord:
    lid: int
    chain: int               # ground-truth chain key
    skip: torch.Tensor
    branches: list[torch.Tensor]
    adds: list[int]          # indices into Recording.adds, in execution order (root last)
    width: int
    feature_axis: int
    info: str = ""           # what generated it, for failure messages


@dataclass
class Recording:
    adds: list[AddRecord] = field(default_factory=list)
    links: list[LinkRecord] = field(default_factory=list)
    next_chain: int = 0
    stream_of: dict[int, int] = field(default_factory=dict)  # chain key -> outer stream index
    nonlinear_streams: set[int] = field(default_factory=set)  # streams with a post-norm/-activation join

    def chains(self, allow_nonlinear: bool = False) -> list[list[int]]:
        """Expected chains: lists of link ids in execution order.

        By default a stream is cut at every non-linear join (post-norm, post-activation);
        with `allow_nonlinear` each outer stream is one chain. Nested inner chains stand alone.
        """
        by_key: dict[tuple, list[int]] = {}
        for link in self.links:
            stream = self.stream_of.get(link.chain)
            key = ("stream", stream) if allow_nonlinear and stream is not None else ("chain", link.chain)
            by_key.setdefault(key, []).append(link.lid)
        return list(by_key.values())

    def nonlinear(self, lid: int) -> bool:
        """Whether link `lid` belongs to a stream that continues through a non-linear op."""
        return self.stream_of.get(self.links[lid].chain) in self.nonlinear_streams


class Ctx:
    """Shared by every module of one model (a plain object, not a Module): the recording, if any."""

    def __init__(self):
        self.rec: Recording | None = None

    def new_chain(self, stream: int | None = None) -> int:
        if self.rec is None:
            return -1
        self.rec.next_chain += 1
        if stream is not None:
            self.rec.stream_of[self.rec.next_chain] = stream
        return self.rec.next_chain

    def nonlinear_stream(self, stream: int) -> None:
        if self.rec is not None:
            self.rec.nonlinear_streams.add(stream)

    def other(self, value: torch.Tensor, reason: str) -> torch.Tensor:
        assert reason in REASONS
        if self.rec is not None:
            self.rec.adds.append(AddRecord("other", value.detach().clone(), reason=reason))
        return value

    def snap(self, value: torch.Tensor) -> torch.Tensor | None:
        return value.detach().clone() if self.rec is not None else None

    def link(self, chain: int, skip, branches, adds, feature_axis: int, info: str = "") -> None:
        if self.rec is None:
            return
        lid = len(self.rec.links)
        first = len(self.rec.adds)
        for value in adds:
            self.rec.adds.append(AddRecord("link", value, lid=lid))
        width = skip.shape[feature_axis]
        self.rec.links.append(LinkRecord(
            lid, chain, skip, [b.detach().clone() for b in branches],
            list(range(first, first + len(adds))), width, feature_axis, info,
        ))


def record(model: nn.Module, inputs: tuple) -> tuple[Recording, object]:
    """Run `model` once eagerly with recording on; returns the recording and the outputs."""
    ctx = model.ctx
    ctx.rec = Recording()
    try:
        with torch.no_grad():
            out = model(*inputs)
        return ctx.rec, out
    finally:
        ctx.rec = None


# ----------------------------------------------------------------------------- modules

def _scale_(module: nn.Module, factor: float) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(factor)
    return module


class RMS(nn.Module):
    """Hand-written RMSNorm over `dim`: its `mean(x^2) + eps` is a scalar (eps) add."""

    def __init__(self, ctx: Ctx, width: int, dim: int):
        super().__init__()
        self.ctx, self.dim = ctx, dim
        shape = [width] if dim == -1 else [width, 1, 1]
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(*shape))

    def forward(self, x):
        var = self.ctx.other(x.pow(2).mean(self.dim, keepdim=True) + 1e-6, "scalar")
        return x * torch.rsqrt(var) * self.gain


def _norm(ctx: Ctx, kind: str, layout: str, width: int) -> nn.Module:
    if kind == "none":
        return nn.Identity()
    if kind == "rms":
        return RMS(ctx, width, -1 if layout == "seq" else 1)
    return nn.LayerNorm(width) if layout == "seq" else nn.GroupNorm(1, width)


class Proj(nn.Module):
    """A linear map (seq) or 1x1 conv (nchw); with `bias_add`, its bias is an explicit add."""

    def __init__(self, ctx: Ctx, layout: str, d_in: int, d_out: int, bias_add: bool, kernel: int = 1):
        super().__init__()
        self.ctx, self.bias_add, self.layout = ctx, bias_add, layout
        if layout == "seq":
            self.op = nn.Linear(d_in, d_out, bias=not bias_add)
        else:
            self.op = nn.Conv2d(d_in, d_out, kernel, padding=kernel // 2, bias=not bias_add)
        if bias_add:
            self.bias = nn.Parameter(0.1 * torch.randn(d_out))

    def forward(self, x):
        y = self.op(x)
        if not self.bias_add:
            return y
        bias = self.bias if self.layout == "seq" else self.bias.view(1, -1, 1, 1)
        return self.ctx.other(y + bias, "constant")


class Branch(nn.Module):
    """One branch f(h) of a residual link; see `BranchSpec`."""

    def __init__(self, ctx: Ctx, spec: BranchSpec, layout: str, width: int, mem_width: int = 0):
        super().__init__()
        self.ctx, self.spec, self.layout, self.width = ctx, spec, layout, width
        self.norm = _norm(ctx, spec.norm, layout, width)
        kind, d, ba = spec.kind, width, spec.bias_add
        if kind == "mlp":
            self.fc1 = Proj(ctx, layout, d, 2 * d, ba)
            self.fc2 = _scale_(Proj(ctx, layout, 2 * d, d, ba), OUT_SCALE)
        elif kind == "conv":
            self.fc1 = Proj(ctx, layout, d, d, ba, kernel=3)
            self.fc2 = _scale_(Proj(ctx, layout, d, d, ba), OUT_SCALE)
        elif kind == "near_id":
            self.fc1 = Proj(ctx, layout, d, d, ba)
        elif kind in ("attn", "xattn"):
            kv = mem_width if kind == "xattn" else d
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(kv, d), nn.Linear(kv, d)
            self.fc2 = _scale_(Proj(ctx, layout, d, d, ba), OUT_SCALE)
        elif kind == "nested":
            inner = spec.inner_width or d
            self.fc1 = Proj(ctx, layout, d, inner, ba)
            self.inner_norms = nn.ModuleList(_norm(ctx, "ln" if layout == "seq" else "gn", layout, inner)
                                             for _ in range(spec.inner_links))
            self.inner = nn.ModuleList(_scale_(Proj(ctx, layout, inner, inner, False), OUT_SCALE)
                                       for _ in range(spec.inner_links))
            self.fc2 = _scale_(Proj(ctx, layout, inner, d, ba), OUT_SCALE)
        else:
            raise ValueError(kind)
        if spec.out_dropout:
            self.drop = nn.Dropout(0.1)

    def _double(self, y):
        return self.ctx.other(y + y, "same_value") if self.spec.double else y

    def forward(self, h, memory=None, mask=None):
        kind = self.spec.kind
        n = self.norm(h)
        if kind in ("mlp", "conv"):
            y = self.fc2(F.gelu(self._double(self.fc1(n))))
        elif kind == "near_id":
            y = NEAR_ID_SCALE * self._double(self.fc1(n))
        elif kind in ("attn", "xattn"):
            flat = n.dim() == 2
            if flat:
                n = n.reshape(B, -1, self.width)
            src = memory if kind == "xattn" else n
            scores = self.q(n) @ self.k(src).transpose(-1, -2) * (self.width ** -0.5)
            if mask is not None and kind == "attn":
                scores = self.ctx.other(scores + mask, "not_a_skip")
            y = self.fc2(self._double(scores.softmax(-1) @ self.v(src)))
            if flat:
                y = y.reshape(-1, self.width)
        else:  # nested: its own residual chain, one chain per call
            chain = self.ctx.new_chain()
            u = self.fc1(n)
            for norm, fc in zip(self.inner_norms, self.inner):
                f = fc(F.gelu(norm(u)))
                skip = self.ctx.snap(u)
                u = u + f
                self.ctx.link(chain, skip, [f], [self.ctx.snap(u)], -1 if self.layout == "seq" else 1, "inner link of a nested branch")
            y = self.fc2(self._double(u))
        if self.spec.out_dropout:
            y = self.drop(y)
        return y


class Link(nn.Module):
    """`h + f_1(h) + ... + f_k(h)` in the form `spec.form`, then the optional post op."""

    def __init__(self, ctx: Ctx, spec: LinkSpec, layout: str, width: int, branches: list[nn.Module]):
        super().__init__()
        self.ctx, self.spec, self.layout = ctx, spec, layout
        self.branches = nn.ModuleList(branches)
        self.skip_mods = nn.ModuleDict()
        for i, op in enumerate(spec.skip_ops):
            if op == "dropout":
                self.skip_mods[str(i)] = nn.Dropout(0.1)
            elif op == "identity":
                self.skip_mods[str(i)] = nn.Identity()
        if spec.post == "ln":
            self.post = nn.LayerNorm(width) if layout == "seq" else nn.GroupNorm(1, width)

    def _skip(self, h):
        s = h
        for i, op in enumerate(self.spec.skip_ops):
            if op in ("dropout", "identity"):
                s = self.skip_mods[str(i)](s)
            elif op == "to":
                s = s.to(s.dtype)
            elif op == "float":
                s = s.float()
            elif op == "type_as":
                s = s.type_as(h)
            elif op == "contiguous":
                s = s.contiguous()
            elif op == "clone":
                s = s.clone()
            elif op == "fdropout":
                s = F.dropout(s, 0.1, training=False)
        return s

    def forward(self, h, chain: int, memory=None, mask=None):
        ctx, form = self.ctx, self.spec.form
        fs = [b(h, memory, mask) for b in self.branches]
        if len(fs) > 1:
            form = {"x+f": "chain", "f+x": "f_first"}.get(form, form)
        skip = ctx.snap(h)
        adds = []

        def add(a, b):
            r = a + b
            adds.append(ctx.snap(r))
            return r

        if form == "iadd":
            assert not self.spec.skip_ops
            t = fs[0]
            for f in fs[1:]:
                t = add(t, f)
            h += t
            adds.append(ctx.snap(h))
            r = h
        else:
            s = self._skip(h)
            if len(fs) == 1:
                f = fs[0]
                if form == "x+f":
                    r = s + f
                elif form == "f+x":
                    r = f + s
                elif form == "add":
                    r = torch.add(s, f)
                elif form == "add_rev":
                    r = torch.add(f, s)
                elif form == "method":
                    r = s.add(f)
                else:
                    raise ValueError(form)
                adds.append(ctx.snap(r))
            elif form in ("chain", "f_first"):
                r = add(s, fs[0]) if form == "chain" else add(fs[0], s)
                for f in fs[1:]:
                    r = add(r, f)
            elif form in ("grouped", "tail"):
                t = fs[0]
                for f in fs[1:]:
                    t = add(t, f)
                r = add(s, t) if form == "grouped" else add(t, s)
            else:
                raise ValueError(form)
        ctx.link(chain, skip, fs, adds, -1 if self.layout == "seq" else 1, repr(self.spec))
        if self.spec.post == "ln":
            r = self.post(r)
        elif self.spec.post == "relu":
            r = torch.relu(r)
        return r


class Stream(nn.Module):
    def __init__(self, ctx: Ctx, spec: StreamSpec, pool: dict, mem_width: int = 0, decoder: bool = False):
        super().__init__()
        self.ctx, self.spec = ctx, spec
        d, layout = spec.width, spec.layout
        d_in = (SEQ_IN if layout == "seq" else IMG_IN) if spec.root != "input" else d
        if spec.root != "input":
            self.embed = nn.Linear(d_in, d) if layout == "seq" else nn.Conv2d(d_in, d, 3, padding=1)
        if spec.root == "pos":
            self.pos = nn.Parameter(torch.randn(T_DEC if decoder else T, d) if layout == "seq" else torch.randn(d, HW, HW))
        links = []
        for ls in spec.links:
            branches = []
            for bs in ls.branches:
                if bs.kind == "shared":
                    key = (layout, d, bs.shared)
                    if key not in pool:
                        pool[key] = Branch(ctx, BranchSpec("mlp" if layout == "seq" else "conv", norm="ln" if layout == "seq" else "gn"), layout, d)
                    branches.append(pool[key])
                else:
                    branches.append(Branch(ctx, bs, layout, d, mem_width))
            links.append(Link(ctx, ls, layout, d, branches))
        self.links = nn.ModuleList(links)
        if spec.final_norm:
            self.final = nn.LayerNorm(d) if layout == "seq" else nn.GroupNorm(1, d)
        if spec.head:
            self.head = nn.Linear(d, 3)
        self.d_in = d_in

    def forward(self, x, index: int, memory=None, mask=None):
        ctx, spec = self.ctx, self.spec
        h = x if spec.root == "input" else self.embed(x)
        if spec.root == "pos":
            pos = self.pos if spec.layout == "seq" else self.pos.unsqueeze(0)
            h = ctx.other(h + pos, "constant")
        chain = ctx.new_chain(index)
        if any(ls.post for ls in spec.links[:-1]):
            ctx.nonlinear_stream(index)
        hidden = h if spec.return_hidden == 0 else None
        seq_len = x.shape[1] if spec.layout == "seq" else None
        for k, (ls, link) in enumerate(zip(spec.links, self.links), start=1):
            if ls.toggle_layout:
                h = h.reshape(-1, spec.width) if h.dim() == 3 else h.reshape(B, seq_len, spec.width)
            h = link(h, chain, memory, mask)
            if ls.post is not None:
                chain = ctx.new_chain(index)
            if spec.return_hidden == k:
                hidden = h
        if spec.layout == "seq" and h.dim() == 2:
            h = h.reshape(B, seq_len, spec.width)
        if spec.final_norm:
            h = self.final(h)
        out = h
        if spec.head:
            out = self.head(h if spec.layout == "seq" else h.mean((2, 3)))
        return out, h, hidden


class GeneratedModel(nn.Module):
    """Inputs: one tensor per stream, then the mask if `spec.mask`. Outputs: a tuple."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        torch.manual_seed(spec.seed)
        self.ctx = Ctx()
        self.spec = spec
        pool: dict = {}
        streams = []
        for i, s in enumerate(spec.streams):
            dec = spec.decoder and i == 1
            streams.append(Stream(self.ctx, s, pool, spec.streams[0].width if dec else 0, decoder=dec))
        self.streams = nn.ModuleList(streams)

    def forward(self, *inputs):
        spec = self.spec
        mask = inputs[len(spec.streams)] if spec.mask else None
        outs = []
        memory = None
        for i, (s, x) in enumerate(zip(self.streams, inputs)):
            dec = spec.decoder and i == 1
            m = mask if (spec.mask and i == 0) else None  # the mask is [B, T, T]: encoder self-attention only
            out, h, hidden = s(x, i, memory if dec else None, m)
            if spec.decoder and i == 0:
                memory = h
            outs.append(out)
            if hidden is not None:
                outs.append(hidden)
        return tuple(outs)


def build(spec: ModelSpec) -> GeneratedModel:
    return GeneratedModel(spec).eval()


def make_inputs(spec: ModelSpec, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate(spec.streams):
        dec = spec.decoder and i == 1
        d_in = s.width if s.root == "input" else (SEQ_IN if s.layout == "seq" else IMG_IN)
        shape = (B, T_DEC if dec else T, d_in) if s.layout == "seq" else (B, d_in, HW, HW)
        out.append(torch.randn(*shape, generator=g))
    if spec.mask:
        out.append(torch.zeros(B, T, T).masked_fill(torch.rand(B, T, T, generator=g) > 0.6, -1e4))
    return tuple(out)


# ----------------------------------------------------------------------------- ground truth

# ----------------------------------------------------------------------------- strategy

def _branch(draw, layout: str, width: int, kinds: tuple[str, ...]) -> BranchSpec:
    kind = draw(st.sampled_from(kinds))
    norms = ("ln", "rms", "none") if layout == "seq" else ("gn", "rms", "none")
    spec = BranchSpec(kind, norm=draw(st.sampled_from(norms)))
    if kind == "shared":
        spec.shared = draw(st.integers(0, 1))
        return spec
    spec.bias_add = draw(st.booleans())
    spec.double = draw(st.integers(0, 5)) == 0
    spec.out_dropout = draw(st.integers(0, 5)) == 0
    if kind == "nested":
        spec.inner_links = draw(st.integers(1, 3))
        spec.inner_width = draw(st.sampled_from(sorted({width, 4, 6, 8, 12})))
    return spec


@st.composite
def model_specs(draw, max_links: int = 40) -> ModelSpec:
    """Random ModelSpecs of 1 to `max_links` outer links in 1 or 2 streams."""
    n_streams = draw(st.sampled_from([1, 1, 1, 2]))
    total = draw(st.integers(1, max_links))
    layouts = [draw(st.sampled_from(["seq", "seq", "nchw"])) for _ in range(n_streams)]
    if n_streams == 2:
        first = draw(st.integers(1, max(1, total - 1)))
        depths = [first, max(1, total - first)]
    else:
        depths = [total]
    decoder = n_streams == 2 and layouts == ["seq", "seq"]
    mask = layouts[0] == "seq" and draw(st.booleans())
    streams = []
    for i, (layout, depth) in enumerate(zip(layouts, depths)):
        width = draw(st.sampled_from([4, 6, 8, 16] if layout == "seq" else [4, 6]))
        root = draw(st.sampled_from(["input", "embed", "pos"]))
        kinds = SEQ_KINDS if layout == "seq" else NCHW_KINDS
        if not (decoder and i == 1):
            kinds = tuple(k for k in kinds if k != "xattn")
        ret = draw(st.none() | st.integers(0, depth))
        links = []
        fresh = root != "input"   # the current hidden state may be mutated in place
        for k in range(1, depth + 1):
            nb = draw(st.sampled_from([1, 1, 1, 1, 2, 2, 3]))
            branches = [_branch(draw, layout, width, kinds) for _ in range(nb)]
            toggle = layout == "seq" and draw(st.integers(0, 9)) == 0
            forms = FORMS_1 if nb == 1 else FORMS_N
            if not fresh or toggle or ret == k - 1:
                forms = tuple(f for f in forms if f != "iadd")
            form = draw(st.sampled_from(forms))
            skip_ops = () if form == "iadd" else tuple(draw(st.lists(st.sampled_from(SKIP_OPS), max_size=2)))
            post = draw(st.sampled_from([None] * 8 + ["ln", "relu"]))
            links.append(LinkSpec(branches, form, skip_ops, post, toggle))
            fresh = True
        streams.append(StreamSpec(
            layout, width, root, links,
            final_norm=draw(st.booleans()), head=draw(st.booleans()), return_hidden=ret,
        ))
    return ModelSpec(streams, mask=mask, seed=draw(st.integers(0, 2**16)))
