"""The depth_attention op: numerics, gradients, dtypes, export and compile, against both of its
implementations (the fused TVM kernels, "tvm", and the eager reference, "eager"), and the fused
kernels' dispatch and disk cache.

gradcheck needs float64, which only the eager reference computes; the fused backward is checked
in float32 (and bfloat16) against the float64 analytic gradient, with dtype-scaled tolerances."""

import contextlib
import os

import pytest
import torch

from attnres_compile.ops import depth_attention as op_module
from attnres_compile.kernels import cache as kernel_cache
from attnres_compile.kernels import fused
from attnres_compile.ops.depth_attention import depth_attention_stacked

op = torch.ops.attnres.depth_attention.default


def _float64_reference(sources, w, eps, scale, dim):
    v = torch.stack([s.double().movedim(dim, -1) for s in sources])
    k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.einsum("d,s...d->s...", w.double(), k).softmax(0)
    return (scale * torch.einsum("s...,s...d->...d", p, v)).movedim(-1, dim)


@pytest.mark.parametrize("shape,dim", [((2, 5, 16), -1), ((7, 33), -1), ((2, 6, 3, 3), 1)])
@pytest.mark.parametrize("num", [1, 3, 9])
def test_matches_float64_reference(kernel, shape, dim, num):
    g = torch.Generator().manual_seed(num)
    sources = [torch.randn(*shape, generator=g) * (i + 1) for i in range(num)]
    w = torch.randn(shape[dim], generator=g)
    out = op(sources, w, 1e-6, 2.5, dim)
    ref = _float64_reference(sources, w, 1e-6, 2.5, dim)
    assert out.shape == sources[0].shape and out.dtype == torch.float32
    # float32 sums of up to 9 sources scaled up to 9x: about 8 ulps of the output's scale (38 here)
    atol = 1e-6 * float(ref.abs().max())
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=1e-5)
    torch.testing.assert_close(depth_attention_stacked(sources, w, 1e-6, 2.5, dim).double(), ref, atol=atol, rtol=1e-5)


def test_zero_query_gives_scaled_mean_and_preserve_gives_sum(kernel):
    sources = [torch.randn(4, 8) for _ in range(5)]
    out = op(sources, torch.zeros(8), 1e-6, 5.0, -1)
    torch.testing.assert_close(out, sum(sources), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_storage_accumulates_in_float32(kernel, dtype):
    g = torch.Generator().manual_seed(0)
    sources = [(torch.randn(64, 96, generator=g) * 100).to(dtype) for _ in range(17)]
    w = torch.randn(96, generator=g)
    out = op(sources, w, 1e-6, 17.0, -1)
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    ref = _float64_reference(sources, w, 1e-6, 17.0, -1)
    # the only rounding left is the final cast to the storage dtype
    torch.testing.assert_close(out.double(), ref, atol=0, rtol=2 * torch.finfo(dtype).eps)


def test_all_zero_source_is_legal(kernel):
    sources = [torch.zeros(3, 8), torch.randn(3, 8)]
    out = op(sources, torch.randn(8), 1e-6, 1.0, -1)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dim,shape", [(-1, (2, 3, 6)), (1, (2, 4, 3, 3))])
def test_gradcheck(dim, shape):
    """float64: the eager reference (the fused kernels do not take float64)."""
    g = torch.Generator().manual_seed(1)
    sources = [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    w = torch.randn(shape[dim], generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: op(list(a[:-1]), a[-1], 1e-6, 3.0, dim), (*sources, w))


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (2, 33, 40)), (torch.bfloat16, (37, 64))])
def test_fused_backward_matches_float64_gradient(dtype, shape):
    """The fused backward in storage precision against the float64 analytic gradient. Tolerance
    per gradient, relative to its largest entry: float32 accumulation (a dot of D terms, ~D 2^-24)
    for float32; for bfloat16 the gradients' rounding to the storage dtype, eps(bf16) = 2^-7
    (the query's gradient is accumulated and returned in float32)."""
    g = torch.Generator().manual_seed(2)
    base = [torch.randn(*shape, generator=g) * (0.5 + i) for i in range(5)]
    w = torch.randn(shape[-1], generator=g) / shape[-1] ** 0.5
    grad = torch.randn(*shape, generator=g)
    leaves = [b.to(dtype).clone().requires_grad_() for b in base]
    wq = w.clone().requires_grad_()
    previous = op_module.set_kernel("tvm")
    try:
        op(leaves, wq, 1e-6, 5.0, -1).backward(grad.to(dtype))
    finally:
        op_module.set_kernel(previous)
    ref_leaves = [b.to(dtype).double().detach().requires_grad_() for b in base]
    ref_w = w.double().requires_grad_()
    op(ref_leaves, ref_w, 1e-6, 5.0, -1).backward(grad.to(dtype).double())
    tol = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    for got, ref in [(x.grad, r.grad) for x, r in zip(leaves, ref_leaves)] + [(wq.grad, ref_w.grad)]:
        assert got.dtype == (dtype if got.shape == shape else torch.float32)
        err = (got.double() - ref).abs().max() / ref.abs().max()
        assert err <= (1e-5 if got.shape != shape else tol), err


def test_opcheck(kernel):
    sources = [torch.randn(3, 5, requires_grad=True) for _ in range(3)]
    torch.library.opcheck(op, (sources, torch.randn(5, requires_grad=True), 1e-6, 3.0, -1))


def test_stays_one_node_through_export():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(8))

        def forward(self, a, b):
            return op([a, b, a * b], self.w, 1e-6, 3.0, -1)

    ep = torch.export.export(M(), (torch.randn(2, 8), torch.randn(2, 8)))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(op) == 1


def test_compile_keeps_the_op_opaque_forward_and_backward(kernel):
    """torch.compile (AOT autograd) traces both ops as single nodes and runs them."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.debugging import aot_eager

    graphs = []

    def record(gm, example_inputs):  # boxed, as AOT autograd calls it (torch's recorder is not)
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):
        return aot_eager(gm, example_inputs, fw_compiler=record, bw_compiler=record)

    w = torch.randn(8, requires_grad=True)
    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    fn = torch.compile(lambda a, b, w: op([a, b, a * b], w, 1e-6, 3.0, -1).square().sum(), backend=backend,
                       fullgraph=True)
    fn(a, b, w).backward()
    grads = [t.grad.clone() for t in (a, b, w)]
    for t in (a, b, w):
        t.grad = None
    op([a, b, a * b], w, 1e-6, 3.0, -1).square().sum().backward()
    for got, t in zip(grads, (a, b, w)):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=1e-5)
    names = [str(n.target) for g in graphs for n in g.graph.nodes]
    assert names.count("attnres.depth_attention.default") == 1
    assert names.count("attnres.depth_attention_backward.default") == 1


def test_bad_arguments_raise_clear_errors(kernel):
    with pytest.raises(ValueError, match="of one shape"):
        op([torch.randn(2, 4), torch.randn(2, 5)], torch.zeros(4), 1e-6, 2.0, -1)
    with pytest.raises(ValueError, match="floating tensors"):
        op([torch.ones(2, 4, dtype=torch.long)] * 2, torch.zeros(4), 1e-6, 2.0, -1)
    with pytest.raises(ValueError, match="query must have shape"):
        op([torch.randn(2, 4)], torch.zeros(3), 1e-6, 1.0, -1)
    with pytest.raises(ValueError, match="at least one source"):
        op([], torch.zeros(3), 1e-6, 1.0, -1)


def test_mixed_dtypes_are_promoted_as_the_sum_would_be(kernel):
    """A float32 root and bfloat16 branches (a stream under autocast): the op computes on the sources
    promoted as `+` would (float32 here), and each source's gradient comes back in its own dtype."""
    torch.manual_seed(0)
    sources = [torch.randn(3, 5, 16), *(torch.randn(3, 5, 16).bfloat16() for _ in range(3))]
    query = torch.randn(16, dtype=torch.bfloat16)
    leaves = [s.clone().requires_grad_() for s in sources]
    out = op(leaves, query, 1e-6, 4.0, -1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, op([s.float() for s in sources], query.float(), 1e-6, 4.0, -1))
    out.square().sum().backward()
    assert [s.grad.dtype for s in leaves] == [s.dtype for s in sources]
    fake = torch._subclasses.FakeTensorMode()
    with fake:
        assert op([fake.from_tensor(s) for s in sources], fake.from_tensor(query), 1e-6, 4.0, -1).dtype == torch.float32
    with torch.no_grad():  # the eager shortcut (no autograd) promotes too
        assert op(sources[1:], query, 1e-6, 3.0, -1).dtype == torch.bfloat16


def test_zero_query_paper_scale_is_the_mean(kernel):
    """At w = 0 every site weighs its sources uniformly: with c = 1 the output is their mean."""
    sources = [torch.randn(5, 8) for _ in range(6)]
    out = op(sources, torch.zeros(8), 1e-6, 1.0, -1)
    torch.testing.assert_close(out, sum(sources) / 6, atol=1e-6, rtol=1e-6)


# ---- dispatch and cache --------------------------------------------------------------------------

def test_dispatch_uses_the_fused_kernel_where_it_applies(monkeypatch):
    """Fused for float32/16-bit [.., D] CPU tensors, strided and misaligned views included; the
    eager reference for float64, another feature axis, rank 1, or ATTNRES_KERNEL=eager."""
    x = torch.randn(3, 4, 16)
    misaligned = torch.randn(3 * 64 + 1)[1:].view(3, 64)  # a view 4 bytes past an allocation
    applies = [[x, x + 1], [x.transpose(0, 1), x.transpose(0, 1) * 2], [misaligned, misaligned * 3]]
    falls_back = [([x.double(), x.double()], -1), ([x, x + 1], 1), ([x[0, 0], x[1, 1]], -1)]
    previous = op_module.set_kernel("auto")
    try:
        for i, (sources, dim) in enumerate([(s, -1) for s in applies] + falls_back):
            w = torch.randn(sources[0].shape[dim])
            assert (fused.forward(sources, w, 1e-6, 2.0, dim) is not None) == (i < len(applies))
            out = op(sources, w, 1e-6, 2.0, dim)
            torch.testing.assert_close(out.double(), _float64_reference(sources, w, 1e-6, 2.0, dim), atol=1e-5,
                                       rtol=1e-5)
        op_module.set_kernel("eager")
        monkeypatch.setattr(fused, "forward", lambda *a: pytest.fail("the fused kernel ran in mode eager"))
        op([x, x], torch.randn(16), 1e-6, 2.0, -1)
    finally:
        op_module.set_kernel(previous)
    with pytest.raises(ValueError, match="'fast' is not a depth-attention kernel"):
        op_module.set_kernel("fast")


def test_plain_eager_calls_the_kernels_without_redispatch(monkeypatch):
    """In plain eager execution (a Parameter query included, as in a rewritten model) the Autograd
    kernel calls the backend kernels itself, forward and backward; under a dispatch mode both go
    through the ops, and the gradients agree."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    sources = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    w = torch.nn.Parameter(torch.randn(8))
    assert op_module.plain_eager(sources, w)
    calls = []
    for name in ("_OP", "_BACKWARD"):
        monkeypatch.setattr(op_module, name, lambda *a, real=getattr(op_module, name), name=name:
                            calls.append(name) or real(*a))
    grads = []
    for mode in (None, Passthrough()):
        with mode or contextlib.nullcontext():
            op(sources, w, 1e-6, 3.0, -1).square().sum().backward()
        grads.append([t.grad.clone() for t in (*sources, w)])
        for t in (*sources, w):
            t.grad = None
        assert calls == ([] if mode is None else ["_OP", "_BACKWARD"])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_eager_inference_calls_skip_the_dispatcher(monkeypatch):
    """A plain eager inference call (a decode step's site) runs the backend kernel straight from the
    op's __call__, giving the dispatcher's result bitwise; a call that wants a gradient, runs
    under a mode, the profiler or torch.export, or bends the schema goes through the dispatcher."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    sources = [torch.randn(1, 1, 16) for _ in range(3)]
    w = torch.nn.Parameter(torch.randn(16))
    taken = []  # each call's decision (the shortcut's answer), in order
    monkeypatch.setattr(op_module, "_shortcut", lambda *a, real=op_module._shortcut: taken.append(real(*a)) or taken[-1])
    with torch.no_grad():
        expected = op._op(sources, w, 1e-6, 3.0, -1)  # the dispatcher's way
        assert torch.equal(op(sources, w, 1e-6, 3.0, -1), expected) and taken == [True]
    assert torch.equal(op(sources, w.detach(), 1e-6, 3.0, -1), expected) and taken == [True, True]  # no grad wanted
    through = {
        "grad wanted": lambda: op(sources, w, 1e-6, 3.0, -1),
        "keyword": lambda: op(sources, w, 1e-6, 3.0, dim=-1),
        "tuple sources": lambda: op(tuple(sources), w, 1e-6, 3.0, -1),
        "int eps": lambda: op(sources, w, 0, 3.0, -1),
    }
    for name, call in through.items():
        taken.clear()
        call()
        assert True not in taken, name
    with torch.no_grad():
        for mode in (Functions(), Dispatch()):  # the mode sees the op (its own call of it may go direct)
            with mode:
                taken.clear(), seen.clear()
                assert torch.equal(op(sources, w, 1e-6, 3.0, -1), expected) and taken[0] is False and op in seen
        with torch.profiler.profile() as prof:
            op(sources, w, 1e-6, 3.0, -1)
        assert "attnres::depth_attention" in {e.name for e in prof.events()}

    class Site(torch.nn.Module):
        def forward(self, a, b):
            return op([a, b], w, 1e-6, 2.0, -1)

    graph = torch.export.export(Site(), (sources[0], sources[1]), strict=False).graph
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [op]


def test_threads_follow_torch(one_thread):
    """The backward keeps a partial query gradient per thread: 1 and 2 threads agree."""
    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(65, 24, generator=g, requires_grad=True) for _ in range(3)]
    w = torch.randn(24, generator=g, requires_grad=True)
    grads = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        op(sources, w, 1e-6, 3.0, -1).square().sum().backward()
        grads.append(w.grad.clone())
        w.grad = None
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)


def test_small_calls_run_on_one_thread(one_thread):
    """A call with under BYTES_PER_THREAD of data per thread runs on fewer threads: waking TVM's
    worker costs more than it saves there. Idle workers sleep instead of spinning on torch's cores."""
    torch.set_num_threads(2)
    small, large = torch.empty(128, 256), torch.empty(1024, 256)  # 4 of them: 512 KiB, 4 MiB
    assert fused._threads(4, small) == 1 and fused._threads(4, large) == 2
    torch.set_num_threads(1)
    assert fused._threads(4, large) == 1
    assert fused.available() and os.environ["TVM_THREAD_POOL_SPIN_COUNT"] == "0"


def test_forward_kernel_follows_the_call_threads(one_thread):
    """A one-thread forward runs the kernel without a parallel loop (never entering TVM's pool), a
    two-thread one the parallel kernel; both agree with the reference."""
    torch.set_num_threads(2)
    w = torch.randn(256)
    for rows, threads in ((128, 1), (1024, 2)):
        sources = [torch.randn(rows, 256) for _ in range(3)]  # with the output: 512 KiB, 4 MiB
        ref = _float64_reference(sources, w, 1e-6, 3.0, -1)  # float32 accumulation: 1e-5 of the output's size
        torch.testing.assert_close(fused.forward(sources, w, 1e-6, 3.0, -1).double(), ref,
                                   atol=1e-5 * ref.abs().max().item(), rtol=0)
        keys = [k for k in fused._KERNELS if k[:2] == ("forward", 3) and k[5] == 256 and k[8] == 3.0]
        assert {k[-1] for k in keys} >= {threads}
    assert {k[-1] for k in keys} >= {1, 2}


def test_kernel_cache_on_disk(tmp_path, monkeypatch, capsys):
    """A built kernel is found on disk by a fresh memory cache (as by a second process) without a
    build; a damaged file is rebuilt and replaced, never a crash."""
    from attnres_compile.kernels import schedule

    monkeypatch.setenv("ATTNRES_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_MEMORY", {})
    spec = kernel_cache.Spec("forward", 2, 2, 8, "float32", 1e-6, 2.0, "cpu", 1)
    sources, w = [torch.randn(3, 8), torch.randn(3, 8)], torch.randn(8)
    expected = op_module.forward_reference(sources, w, 1e-6, 2.0, -1)

    def run():
        out = torch.empty(3, 8)
        kernel_cache.get(spec)(*sources, w, out)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)

    run()
    assert "compiling the fused depth-attention forward kernel" in capsys.readouterr().err
    (file,) = tmp_path.rglob("*.kernel")
    assert file == kernel_cache.path(spec) and not list(tmp_path.rglob(".tmp-*"))

    monkeypatch.setattr(kernel_cache, "_MEMORY", {})
    build = schedule.build
    monkeypatch.setattr(schedule, "build", lambda *a: pytest.fail("rebuilt a kernel that is on disk"))
    run()
    assert capsys.readouterr().err == ""

    monkeypatch.setattr(schedule, "build", build)
    monkeypatch.setattr(kernel_cache, "_MEMORY", {})
    file.write_bytes(b"\x7fELF damaged")
    run()
    assert "compiling" in capsys.readouterr().err
    assert file.stat().st_size > 1000


def test_forked_child_runs_the_fused_kernel(one_thread):
    """A child forked after the kernels ran on two threads (a DataLoader worker) computes the op
    instead of waiting for TVM's pool threads, which did not survive the fork."""
    import os
    import time

    torch.set_num_threads(2)
    sources, w = [torch.randn(64, 32) for _ in range(3)], torch.randn(32)
    expected = op(sources, w, 1e-6, 3.0, -1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            os.write(write, b"ok" if torch.equal(op(sources, w, 1e-6, 3.0, -1), expected) else b"wrong")
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in the fused kernel")
        time.sleep(0.05)
    assert os.read(read, 16) == b"ok"
