"""What a decoder grown from a shallow trace shares across formats (hf/replicate.py grows a torch.fx
graph, onnx/replicate.py an ONNX one): how many layers are traced, which one is copied, and how the
graph's calls, each tagged with its layer by its module path, are cut into layers."""

from __future__ import annotations

SHALLOW = 3   # layers traced: the first, the template and its shifted copy
TEMPLATE = 1


class Mismatch(Exception):
    """The shallow graph is not a template and its shift: the model is traced or exported whole."""


def layer_span(tags: list[int | None]) -> tuple[int, int, list[int | None]]:
    """(first, last, tags) for a graph's calls in order, each tagged with its layer or None: the span
    from the first tagged call to the last, an untagged call inside it joining the next layer.
    Mismatch where no call is tagged or the layers interleave."""
    tagged = [i for i, t in enumerate(tags) if t is not None]
    if not tagged:
        raise Mismatch
    first, last = tagged[0], tagged[-1]
    tags = list(tags)
    following = None
    for i in range(last, first - 1, -1):
        following = tags[i] if tags[i] is not None else following
        tags[i] = following
    if any(a > b for a, b in zip(tags[first:last], tags[first + 1:last + 1])):
        raise Mismatch  # the layers interleave
    return first, last, tags
