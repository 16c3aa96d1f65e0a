"""dspark_ops.models.cpu_linear: the few-row products equal ``linear`` at every row count and
shape the rule covers (and around its edges), with bias, batch dimensions, non-contiguous inputs
and gradients; the rule engages only where it was measured; :class:`CpuLinears` routes a model's
layers inside its block only and leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dspark_ops.models import cpu_linear
from dspark_ops.models.cpu_linear import (NARROW_ROWS, WIDE_OUT, WIDE_ROWS, CpuLinears, engages,
                                          few_row_linear, uses_rule)

MKL = torch.backends.mkl.is_available()
needs_mkl = pytest.mark.skipif(not MKL, reason="the rule engages only with torch on MKL")


def test_the_rule_covers_decodings_row_counts():
    narrow, wide = 1536, WIDE_OUT
    assert [r for r in range(0, 20) if uses_rule(r, narrow)] == list(range(2, NARROW_ROWS + 1))
    assert [r for r in range(0, 20) if uses_rule(r, wide)] == list(range(1, WIDE_ROWS + 1))


@pytest.mark.parametrize("out_features", [7, 192, WIDE_OUT + 3])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 16, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_linear(rows, out_features, bias):
    gen = torch.Generator().manual_seed(rows * 31 + out_features)
    weight = torch.randn(out_features, 40, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    out = few_row_linear(x, weight, b)
    assert out.shape == (rows, out_features)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@needs_mkl
def test_batch_dimensions_and_a_non_contiguous_input():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(WIDE_OUT, 24, generator=gen)
    x = torch.randn(1, 24, 3, generator=gen).transpose(1, 2)  # [1, 3, 24], not contiguous
    assert not x.is_contiguous() and uses_rule(3, WIDE_OUT)
    torch.testing.assert_close(few_row_linear(x, weight), F.linear(x, weight),
                               rtol=1e-5, atol=1e-5)
    x1 = torch.randn(1, 1, 24, generator=gen)  # one row of a wide weight: computed as two
    out = few_row_linear(x1, weight)
    assert out.shape == (1, 1, WIDE_OUT)
    torch.testing.assert_close(out, F.linear(x1, weight), rtol=1e-5, atol=1e-5)


def test_gradients_equal_linears():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(12, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(12, generator=gen, dtype=torch.float64, requires_grad=True)
    # float64 is not a dtype the rule engages for: force it to check the rule's own graph
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_linear, "engages", lambda w: True)
        assert torch.autograd.gradcheck(few_row_linear, (x, weight, bias))


def test_engages_only_where_measured():
    assert engages(torch.zeros(2, 2)) == MKL
    assert not engages(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert not engages(torch.zeros(2, 2, dtype=torch.float64))
    if torch.cuda.is_available():
        assert not engages(torch.zeros(2, 2, device="cuda"))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.head = nn.Linear(32, WIDE_OUT, bias=False)
        self.half = nn.Linear(16, 16).to(torch.bfloat16)  # not float32: left alone

    def forward(self, x):
        return self.head(self.proj(x))


@needs_mkl
def test_routes_a_models_layers_inside_the_block_only():
    net = _Net()
    linears = CpuLinears(net)
    assert linears.layers == [net.proj, net.head]
    x = torch.randn(1, 3, 16)
    expected = net(x)
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        original = cpu_linear.few_row_linear
        patch.setattr(cpu_linear, "few_row_linear",
                      lambda *a: calls.append(a[1].shape) or original(*a))
        with linears:
            with linears:  # nested: the inner exit must not unroute the outer block
                pass
            out = net(x)
        after = net(x)
    assert calls == [net.proj.weight.shape, net.head.weight.shape]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert after is not None and len(calls) == 2  # outside the block: nn.Linear's own forward
    assert all("forward" not in layer.__dict__ for layer in (net.proj, net.head, net.half))


def test_the_benchmark_covers_every_shape_and_row_count(tmp_path):
    """bench.cpu_linear on a small model: a row per distinct weight shape and row count, the
    rule's choice as uses_rule says, and its chart drawn."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import cpu_linear as bench

    net = _Net()
    rows = bench.products(net, repeats=1)
    shapes = {tuple(r["shape"]) for r in rows}
    assert shapes == {(32, 16), (WIDE_OUT, 32), (16, 16)}
    assert len(rows) == len(shapes) * len(bench.ROWS)
    for row in rows:
        assert row["rule_uses_weight_x_t"] == uses_rule(row["rows"], row["shape"][0])
        assert row["linear_ms"] > 0 and row["weight_x_t_ms"] > 0
    pytest.importorskip("matplotlib")
    steps = [{"width": w, "linear_ms": 2.0 * w, "few_row_ms": 1.0 + w} for w in bench.WIDTHS]
    path = tmp_path / "chart.png"
    bench.chart({"products": rows, "steps": steps}, str(path))
    assert path.stat().st_size > 0
