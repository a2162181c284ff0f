"""How the analysis read each onnxruntime contrib op (`com.microsoft`, or any other custom domain) of a file.

Reported per op under `contrib_ops`: **unfused** (Skip(Simplified)LayerNormalization,
onnx/unfuse_skip_norm.py), **stream root** (EmbedLayerNormalization: its embedding sum, when
returned, is the chain's root, onnx/view.py FUSED_SUMS), or **opaque** (one node; the sublayer
ops in SUBLAYER hide no part of the stream, and for other ops the report says a residual add
inside them is not seen).
"""

from __future__ import annotations

from collections import Counter

import onnx

from .function import DOMAIN as OWN_DOMAIN
from .unfuse_skip_norm import DOMAIN as ORT_DOMAIN
from .unfuse_skip_norm import RULES, Unfused
from .view import STANDARD_DOMAINS

EMBED = "EmbedLayerNormalization"
EMBED_SUM = 2  # EmbedLayerNormalization's optional output `embedding_sum`
SUBLAYER = {
    **dict.fromkeys(("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention",
                     "PackedMultiHeadAttention", "SparseAttention", "PagedAttention", "QAttention",
                     "DecoderMaskedMultiHeadAttention", "DecoderMaskedSelfAttention", "LongformerAttention",
                     "RelativePositionBias", "GatedRelativePositionBias"), "attention"),
    **dict.fromkeys(("RotaryEmbedding", "GemmaRotaryEmbedding"), "rotary embedding"),
    **dict.fromkeys(("MatMulNBits", "MatMulBnb4", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "FusedMatMul",
                     "QGemm", "FusedGemm", "GatherBlockQuantized", "QLinearMatMul"), "matrix product"),
    **dict.fromkeys(("Gelu", "FastGelu", "BiasGelu", "QuickGelu", "GemmFastGelu", "BiasSoftmax"), "activation"),
    **dict.fromkeys(("MoE", "QMoE", "SparseMixer"), "mixture of experts"),
    **dict.fromkeys(("DynamicQuantizeLSTM",), "recurrent layer"),
    **dict.fromkeys(("QLinearConv", "ConvTransposeWithDynamicPads", "FusedConv", "NhwcConv"), "convolution"),
}


def embed_roots(model: onnx.ModelProto) -> list[dict]:
    """{"node", "root", "read"} for each EmbedLayerNormalization of the main graph: the value a stream starts from."""
    rows = []
    for node in model.graph.node:
        if node.op_type == EMBED and node.domain not in STANDARD_DOMAINS and node.output and node.output[0]:
            has_sum = len(node.output) > EMBED_SUM and node.output[EMBED_SUM]
            rows.append({"node": node.name or node.output[0], "root": node.output[EMBED_SUM if has_sum else 0],
                         "read": "its output 2, the embedding sum (output 0 read as its LayerNorm)" if has_sum else
                         "its output 0, the normed embedding sum (it returns no sum)"})
    return rows


def contrib_ops(model: onnx.ModelProto, unfused: Unfused, roots: dict[str, int] | None = None) -> list[dict]:
    """One row per contrib op type of `model`'s main graph (after `unfuse`) and per op `unfused` unfused:
    {"op", "count", "read": "unfused" | "stream root" | "opaque", "reason", "nodes"?}; `roots`: the chains'
    roots and their indices."""
    roots = roots or {}
    rows = [{"op": f"{ORT_DOMAIN}.{op}", "count": n, "read": "unfused",
             "reason": "its residual add unfused into Add + norm before the analysis"} for op, n in unfused.counts.items()]
    counts = Counter(f"{n.domain}.{n.op_type}" for n in model.graph.node
                     if n.domain not in (*STANDARD_DOMAINS, OWN_DOMAIN))
    for op, count in sorted(counts.items()):
        name = op.rsplit(".", 1)[1]
        row = {"op": op, "count": count}
        if name == EMBED:
            embeds = embed_roots(model)
            row.update(read="stream root", nodes=[e["node"] for e in embeds], reason="; ".join(
                f"{e['node']}: {e['read']}" + (f" is the root of chain {roots[e['root']]}" if e["root"] in roots
                                               else " starts no chain") for e in embeds))
        elif name in SUBLAYER:
            row.update(read="opaque", reason=f"a sublayer op ({SUBLAYER[name]}) inside a branch, read whole: fine")
        elif name in RULES and unfused.kept:  # only Skip*LayerNormalization nodes are kept
            node, why = unfused.kept[0]
            row.update(read="opaque", reason=f"kept fused (e.g. {node}: {why}): its residual add is not analysed")
        else:
            row.update(read="opaque", reason="not known to the analysis: read whole; a residual add it computes "
                       "inside is not seen")
        rows.append(row)
    return rows


def notes(rows: list[dict]) -> list[str]:
    """The report's lines on the stream roots and the ops read whole (the unfused ones have their own note)."""
    def name(row: dict) -> str:
        return row["op"].rsplit(".", 1)[1]

    roots = [r["reason"] for r in rows if r["read"] == "stream root"]
    opaque = [r for r in rows if r["read"] == "opaque"]
    fine = [f"{r['count']} {name(r)}" for r in opaque if name(r) in SUBLAYER]
    unseen = [f"{r['op']} ({r['reason']})" for r in opaque if name(r) not in SUBLAYER]
    out = [f"EmbedLayerNormalization read as the embedding sum: {t}" for t in roots]
    if fine:
        out.append(f"contrib ops read whole as sublayer ops (inside branches; fine): {', '.join(fine)}")
    if unseen:
        out.append(f"contrib ops not seen through: {'; '.join(unseen)}")
    return out
