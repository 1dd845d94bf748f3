"""The AVX2 bf16 linear (model/avx2_bf16.py): F.linear's math within a bf16 rounding, rows independent of the
pass length, and a packed target's logits as close to float32 as plain bf16's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_packing import PARENTS, build, tree_pass

from draftsmith.model import avx2_bf16, packing
from draftsmith.model.packing import PackedLinear, pack_linears
from draftsmith.model.target import Target
from draftsmith.testing.models import TINY_ARCHITECTURES

pytestmark = pytest.mark.skipif(not avx2_bf16.available(),
                                reason="no AVX2+FMA here, or the kernel could not be compiled (C++ compiler, ninja)")

SHAPES = [(20, 7), (33, 64), (1536, 576)]  # N not a multiple of the 16-column panel, K odd, a SmolLM2 MLP
ROWS = [1, 2, 5, 6, 7, 13, 16]  # below, at and past the 6-row tile


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact result in float64, and the bound on what fp32 sums in any order and one bf16 rounding allow."""
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    magnitude = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0 ** -126))) - 7)  # one bf16 ulp
    return exact, ulp + 1e-5 * magnitude


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_kernel_is_f_linear_within_a_bf16_rounding(n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    packed = avx2_bf16.pack(w)
    for m in ROWS:
        x = torch.randn(m, k, generator=g).bfloat16()
        got = avx2_bf16.linear(x, packed, b, n)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        exact, bound = reference(x, w, b)
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), f"rows={m}: {int((err > bound).sum())} outputs off by more than a bf16 rounding"


def test_a_row_gets_the_same_bits_in_a_pass_of_any_length():
    """No row's sums depend on the other rows: verify passes of any length agree row by row."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(100, 96, generator=g).bfloat16()
    packed = avx2_bf16.pack(w)
    x = torch.randn(16, 96, generator=g).bfloat16()
    together = avx2_bf16.linear(x, packed, None, 100)
    for i in range(16):
        assert torch.equal(avx2_bf16.linear(x[i:i + 1], packed, None, 100)[0], together[i])
    assert torch.equal(avx2_bf16.linear(x.view(2, 8, 96), packed, None, 100), together.view(2, 8, 100))


def test_the_reference_bound_catches_a_wrong_weight():
    """The bound above is tight enough to fail a kernel fed a weight off by one bf16 step in one element."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(33, 64, generator=g).bfloat16()
    x = torch.randn(6, 64, generator=g).bfloat16()
    bad = w.clone()
    bad[5, 7] = bad[5, 7] * 1.5
    exact, bound = reference(x, w, None)
    assert ((avx2_bf16.linear(x, avx2_bf16.pack(bad), None, 33).double() - exact).abs() > bound).any()


def max_error(target: Target, truth: tuple[torch.Tensor, ...]) -> float:
    return max((got.double() - want.double()).abs().max().item() for got, want in zip(tree_pass(target), truth,
                                                                                         strict=True))


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_a_target_on_the_kernel_is_as_close_to_float32_as_plain_bf16(arch):
    """bf16 logits differ from float32's by bf16 rounding anyway; packed on the kernel they must not drift further
    than F.linear's bf16 does (a dropped bias or a stale weight moves them by far more)."""
    truth = tuple(t.double() for t in tree_pass(Target(build(arch))))
    plain = Target(build(arch, torch.bfloat16))
    kernel = Target(build(arch, torch.bfloat16))
    assert pack_linears(kernel.model, backend="avx2_bf16") > 0
    assert all(m.backend == "avx2_bf16" for m in kernel.model.modules() if isinstance(m, PackedLinear))
    scale = max(t.abs().max().item() for t in truth)
    plain_err, kernel_err = max_error(plain, truth), max_error(kernel, truth)
    assert kernel_err <= 2 * plain_err + 1e-3 * scale, (kernel_err, plain_err)
    assert len(PARENTS) == tree_pass(kernel)[1].shape[1]


def test_a_packed_linear_on_the_kernel_follows_its_weight_and_autograd_falls_back():
    lin = torch.nn.Linear(40, 24).bfloat16()
    packed = PackedLinear(lin, backend="avx2_bf16")
    assert packed.backend == "avx2_bf16"
    x = torch.randn(3, 40).bfloat16()
    with torch.no_grad():
        first = packed(x)
        lin.weight.mul_(2)  # in place: the packed copy is rebuilt
        second = packed(x)
    exact, bound = reference(x, lin.weight, lin.bias.float())
    assert ((second.double() - exact).abs() <= bound).all() and not torch.equal(first, second)
    with torch.no_grad():  # one row is a GEMV and stays on F.linear; two or more run the kernel
        assert torch.equal(packed(x[:1]), F.linear(x[:1], lin.weight, lin.bias))
        assert torch.equal(packed(x), avx2_bf16.linear(x, packed._packed, lin.bias.float(), 24))
    x.requires_grad_(True)
    F.linear(x, lin.weight, lin.bias).sum().backward()  # the reference path autograd takes
    y = packed(x)
    assert y.requires_grad


def test_where_onednn_cannot_pack_bf16_the_kernel_does(monkeypatch):
    """An AVX2-only CPU: oneDNN refuses bf16, so pack_backend hands bf16 to the kernel and float32 to oneDNN."""
    monkeypatch.setattr(packing, "dtype_packable", lambda dtype: dtype == torch.float32)
    assert packing.pack_backend(torch.bfloat16) == "avx2_bf16"
    assert packing.pack_backend(torch.float32) == "onednn"
    assert packing.pack_backend(torch.float16) is None
    target = Target(build("qwen2", torch.bfloat16))
    assert target.pack() > 0
    assert {m.backend for m in target.model.modules() if isinstance(m, PackedLinear)} == {"avx2_bf16"}


def test_where_the_kernel_cannot_be_built_bf16_stays_plain_with_one_line_said(tmp_path):
    """No usable compiler: the build fails, one line says so, and packing leaves bf16 on F.linear."""
    code = ("import torch\n"
            "from draftsmith.model import avx2_bf16, packing\n"
            "packing.dtype_packable = lambda dtype: dtype == torch.float32  # an AVX2-only CPU\n"
            "print(avx2_bf16.available(), packing.pack_backend(torch.bfloat16))\n")
    env = {**os.environ, "DRAFTSMITH_HOME": str(tmp_path), "CXX": str(tmp_path / "no-such-g++")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "None"]
    said = [line for line in r.stderr.splitlines() if line.startswith("AVX2 bf16 kernel unavailable")]
    assert len(said) == 1 and len(said[0]) < 260 and said[0].endswith("bf16 linears run plain F.linear")
