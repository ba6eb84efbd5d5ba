"""The lookups' compiled backward (``worker/lookup_kernels.py``) gives torch's gradients,
bit for bit, for every shape of ids and both index dtypes; other dtypes keep torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardps import kernels
from shardps.worker import lookup_kernels
from shardps.worker.lookup_kernels import lookup


def _grads(rows: torch.Tensor, inverse: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ours = rows.clone().requires_grad_(True)
    lookup(ours, inverse).backward(grad)
    theirs = rows.clone().requires_grad_(True)
    F.embedding(inverse, theirs).backward(grad)
    return ours.grad, theirs.grad


@pytest.mark.parametrize("shape", [(7,), (64, 26), (3, 5, 40), (1024,)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_the_backward_sums_each_rows_gradients_as_torch_does(shape, index_dtype):
    g = torch.Generator().manual_seed(sum(shape))
    num_rows = 11
    inverse = torch.randint(0, num_rows - 1, shape, generator=g).to(index_dtype)    # the last row gets none
    rows = torch.randn(num_rows, 16, generator=g)
    grad = torch.randn(*shape, 16, generator=g)
    ours, theirs = _grads(rows, inverse, grad)
    assert torch.equal(ours, theirs)
    assert not ours[-1].any()               # a row no id names gets a zero gradient


def test_a_gradient_that_is_not_contiguous_is_summed_alike():
    g = torch.Generator().manual_seed(3)
    inverse = torch.randint(0, 20, (40, 6), generator=g)
    rows = torch.randn(20, 8, generator=g)
    grad = torch.randn(6, 40, 8, generator=g).transpose(0, 1)      # a view with other strides
    assert not grad.is_contiguous()
    ours, theirs = _grads(rows, inverse, grad)
    assert torch.equal(ours, theirs)


def test_the_compiled_backward_is_the_one_that_runs(monkeypatch):
    """On the CPU with float32 rows the gradient comes from the compiled pass (a fault in it
    would show), other dtypes from torch's own backward."""
    if not kernels.AVAILABLE:
        pytest.skip("numba is not installed: torch's backward runs everywhere")
    calls = []
    real = lookup_kernels._sum_bags
    monkeypatch.setattr(lookup_kernels, "_sum_bags", lambda *a: (calls.append(1), real(*a)))
    inverse = torch.tensor([[0, 1], [1, 2]]).repeat(lookup_kernels.MIN_IDS // 4, 1)
    rows32 = torch.randn(3, 4).requires_grad_(True)
    lookup(rows32, inverse).sum().backward()
    assert calls == [1]
    counts = torch.tensor([[1.0], [2.0], [1.0]]) * (lookup_kernels.MIN_IDS // 4)
    assert torch.equal(rows32.grad, counts.expand(3, 4))
    rows64 = torch.randn(3, 4, dtype=torch.float64).requires_grad_(True)
    lookup(rows64, inverse).sum().backward()
    assert calls == [1]
    assert torch.equal(rows64.grad, counts.expand(3, 4).double())
    lookup(torch.randn(3, 4).requires_grad_(True), inverse[:1]).sum().backward()    # a few ids: torch's
    assert calls == [1]


def test_without_gradients_it_is_a_plain_lookup():
    rows = torch.randn(5, 3)
    inverse = torch.tensor([4, 0, 4])
    out = lookup(rows, inverse)
    assert torch.equal(out, rows[inverse]) and out.grad_fn is None
    with torch.no_grad():
        assert lookup(rows.requires_grad_(True), inverse).grad_fn is None


def _bag_grads(rows, inverse, offsets, mode, weights, last, padding, grad=None, create_graph=False):
    ours = rows.clone().requires_grad_(True)
    out = lookup_kernels.bag_lookup(ours, inverse, offsets, mode, weights, last, padding)
    theirs = rows.clone().requires_grad_(True)
    expected = F.embedding_bag(inverse, theirs, offsets, mode=mode, per_sample_weights=weights,
                               include_last_offset=last, padding_idx=padding)
    assert torch.equal(out, expected)            # torch's forward
    grad = torch.randn_like(expected) if grad is None else grad
    (got,) = torch.autograd.grad(out, ours, grad, create_graph=create_graph)
    expected.backward(grad)
    return got.detach(), theirs.grad


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("layout", ["2d", "offsets", "offsets+last"])
@pytest.mark.parametrize("padding", [None, 3])
@pytest.mark.parametrize("create_graph", [False, True])
def test_the_bags_backward_sums_each_rows_gradients_as_torch_does(mode, weighted, layout, padding, create_graph):
    """Torch sums in the order of its (unstable) sort of the ids, this in the order of the
    ids: equal to float32 rounding; every row, padding, weights, empty bags and the mean's
    divisor alike (``create_graph``: the same sums as differentiable torch operations)."""
    g = torch.Generator().manual_seed(len(layout) + (padding or 0))
    num_rows = 40
    if layout == "2d":
        inverse, offsets = torch.randint(0, num_rows, (64, 12), generator=g), None
    else:
        inverse = torch.randint(0, num_rows, (900,), generator=g)
        cuts = torch.sort(torch.randint(0, 900, (99,), generator=g)).values     # empty bags among them
        offsets = torch.cat([torch.tensor([0]), cuts] + ([torch.tensor([900])] if layout == "offsets+last" else []))
    weights = torch.rand(inverse.shape, generator=g) if weighted else None
    rows = torch.randn(num_rows, 8, generator=g)
    ours, theirs = _bag_grads(rows, inverse, offsets, mode, weights, layout == "offsets+last", padding,
                              create_graph=create_graph)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    if padding is not None:
        assert not ours[padding].any()


def test_the_bags_compiled_backward_runs_and_sums_exactly_where_the_order_cannot_matter(monkeypatch):
    """Gradients of whole numbers: any order of the sums gives the same bits, so the compiled
    pass (counted) must give torch's exactly. Max bags and weights that take a gradient keep
    torch's backward."""
    if not kernels.AVAILABLE:
        pytest.skip("numba is not installed: torch's backward runs everywhere")
    calls = []
    real = lookup_kernels._sum_bags
    monkeypatch.setattr(lookup_kernels, "_sum_bags", lambda *a: (calls.append(1), real(*a)))
    inverse = torch.arange(1024).remainder(7).reshape(128, 8)
    rows = torch.randn(7, 4)
    grad = torch.randint(-3, 4, (128, 4)).float()
    ours, theirs = _bag_grads(rows, inverse, None, "sum", None, False, None, grad)
    assert calls == [1] and torch.equal(ours, theirs)
    _bag_grads(rows, inverse, None, "max", None, False, None, grad)
    weights = torch.ones(128, 8).requires_grad_(True)
    _bag_grads(rows, inverse, None, "sum", weights, False, None, grad)
    assert calls == [1]


@pytest.mark.parametrize("bags", [None, "sum", "mean"])
def test_a_second_derivative_through_a_lookup_is_torchs(bags):
    """``create_graph=True`` (a gradient penalty): the backward is then taken by torch's
    differentiable operations, and the second derivative equals torch's own (for bags,
    whose backward torch cannot differentiate, that of the same sums written with
    ``F.embedding``)."""
    g = torch.Generator().manual_seed(5)
    inverse = torch.randint(0, 30, (64, 12), generator=g)
    rows = torch.randn(30, 4, generator=g)
    results = []
    for fn in ("ours", "torch"):
        r = rows.clone().requires_grad_(True)
        if bags is None:
            out = lookup(r, inverse) if fn == "ours" else F.embedding(inverse, r)
        else:
            pooled = F.embedding(inverse, r)
            out = (lookup_kernels.bag_lookup(r, inverse, None, bags, None, False, None) if fn == "ours"
                   else pooled.sum(1) if bags == "sum" else pooled.mean(1))
        (first,) = torch.autograd.grad((out ** 3).sum(), r, create_graph=True)
        (second,) = torch.autograd.grad((first ** 2).sum(), r)
        results.append((first.detach(), second))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-4)
