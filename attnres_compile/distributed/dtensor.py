"""DTensor sharding rules for the depth-attention ops, so `torch.ops.attnres.*` take DTensor inputs.

The ops are per row, so sources sharded off the feature axis (or Replicate) with a Replicate query
give output sharded as the sources and a Partial() query gradient; other placements are
redistributed; a sharded feature axis raises `ShardingError`. The backward uses
`register_prop_rule` rather than `register_sharding`, because for its (Tensor[], Tensor) return
the op-strategy propagator builds no output spec.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding, RuntimeSchemaInfo
from torch.distributed.tensor._ops.utils import register_prop_rule
from torch.distributed.tensor.experimental import register_sharding

from ..core.errors import ShardingError
from ..ops.depth_attention import depth_attention as _FORWARD
from ..ops.depth_attention import depth_attention_backward as _BACKWARD
from ..ops.two_phase import depth_attention_merge as _MERGE
from ..ops.two_phase import depth_attention_partial as _PARTIAL


def register_dtensor_rules() -> None:
    """Register the rules with DTensor's sharding propagator; a second call changes nothing."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    if _BACKWARD in propagator.op_to_rules:
        return
    register_sharding(_FORWARD)(_forward_shardings)
    register_sharding(_PARTIAL)(_partial_shardings)
    register_sharding(_MERGE)(_merge_shardings)
    # static_argnum 3: eps, scale and dim are part of the cache key; the sources list needs pytree
    register_prop_rule(_BACKWARD, RuntimeSchemaInfo(static_argnum=3, needs_pytree=True))(_backward_rule)


def _refuse_feature_shards(specs, feature: int, query) -> None:
    """ShardingError where a source shards the feature axis or the query is sharded at all."""
    for spec in specs:
        if any(p.is_shard(feature) for p in spec.placements):
            _refuse(f"sources sharded on their feature axis {feature} (placements {_placements(spec)})")
    if any(p.is_shard() for p in query.placements):
        _refuse(f"a sharded query (placements {_placements(query)}; the query spans the feature axis)")


def _refuse(what: str):
    raise ShardingError(f"depth_attention cannot take {what}: shard the sources on the sequence (or batch) "
                        "axis, or replicate them, and replicate the query")


def _placements(spec) -> str:
    return ", ".join(map(str, spec.placements))


def _feature(spec, dim: int) -> int:
    return dim % spec.ndim


def _row_dims(ndim: int, feature: int) -> list[int]:
    return [d for d in range(ndim) if d != feature]


def _forward_shardings(sources, query, eps, scale, dim):
    """[output, sources..., query, eps, scale, dim] per acceptable sharding of one mesh axis."""
    feature = _feature(sources[0], dim)
    _refuse_feature_shards(sources, feature, query)
    n = len(sources)
    options = [([Replicate()], [*[Replicate()] * n, Replicate(), None, None, None])]
    for d in _row_dims(sources[0].ndim, feature):
        options.append(([Shard(d)], [*[Shard(d)] * n, Replicate(), None, None, None]))
    return options


def _state_dim(d: int, feature: int) -> int:
    """The two-phase state's axis ([B, rows.., D]) that holds source axis d (d not the feature axis)."""
    return 1 + (d if d < feature else d - 1)


def _partial_shardings(history, queries, eps, dim):
    """[m, l, acc, history..., queries, eps, dim]: the state sharded as the history's rows."""
    feature = _feature(history[0], dim)
    _refuse_feature_shards(history, feature, queries)
    n = len(history)
    options = [([Replicate()] * 3, [*[Replicate()] * n, Replicate(), None, None])]
    for d in _row_dims(history[0].ndim, feature):
        s = Shard(_state_dim(d, feature))
        options.append(([s, s, s], [*[Shard(d)] * n, Replicate(), None, None]))
    return options


def _merge_shardings(m, l, acc, index, extra, query, eps, scale, dim):
    """[output, m, l, acc, index, extra..., query, eps, scale, dim]: the state as the extra's rows."""
    feature = _feature(extra[0], dim)
    _refuse_feature_shards(extra, feature, query)
    if any(p.is_shard(acc.ndim - 1) for p in acc.placements):
        _refuse(f"a two-phase state sharded on its feature axis (placements {_placements(acc)})")
    n = len(extra)
    options = [([Replicate()], [Replicate()] * 3 + [None, *[Replicate()] * n, Replicate(), None, None, None])]
    for d in _row_dims(extra[0].ndim, feature):
        s = Shard(_state_dim(d, feature))
        options.append(([Shard(d)], [s, s, s, None, *[Shard(d)] * n, Replicate(), None, None, None]))
    return options


def _backward_rule(schema: OpSchema) -> OutputSharding:
    """Each mesh axis keeps the gradient's shard of a row axis (the forward's choice, the output's
    placement), else the first source's, else replicates; the inputs are redistributed to that
    (a gradient sharded on the feature axis too: the sources are not)."""
    sources, query, grad, eps, scale, dim = schema.args_schema
    feature = _feature(sources[0], dim)
    _refuse_feature_shards(sources, feature, query)
    mesh = sources[0].mesh

    def row_shard(p) -> bool:
        return type(p) is Shard and p.dim != feature

    rows = tuple(g if row_shard(g) else s if row_shard(s) else Replicate()
                 for g, s in zip(grad.placements, sources[0].placements))
    query_grad = tuple(Partial() if p.is_shard() else Replicate() for p in rows)
    given = [*sources, query, grad]
    wanted = [DTensorSpec(mesh, rows, tensor_meta=s.tensor_meta) for s in sources]
    wanted += [DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=query.tensor_meta),
               DTensorSpec(mesh, rows, tensor_meta=grad.tensor_meta)]
    moves = any(w.placements != g.placements for w, g in zip(wanted, given))
    suggestion = OpSchema(schema.op, (wanted[:-2], *wanted[-2:], eps, scale, dim), {}) if moves else None
    outputs = (tuple(DTensorSpec(mesh, rows, tensor_meta=_contiguous(s.tensor_meta)) for s in sources),
               DTensorSpec(mesh, query_grad))  # the query gradient's meta comes from the fake kernel
    return OutputSharding(outputs, suggestion, needs_redistribute=moves)


def _contiguous(meta: TensorMeta) -> TensorMeta:
    """The meta of a gradient: the source's shape and dtype, contiguous (the kernels return it so)."""
    stride, step = [], 1
    for n in reversed(meta.shape):
        stride.append(step)
        step *= max(n, 1)
    return TensorMeta(meta.shape, tuple(reversed(stride)), meta.dtype)
