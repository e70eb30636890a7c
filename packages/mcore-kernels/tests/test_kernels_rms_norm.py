"""Fused residual add + RMSNorm: Triton (through the interpreter on CPU) against the torch reference."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import mcore_kernels
from mcore_kernels import RMSNorm, rms_norm
from mcore_kernels._triton_utils import jit, tl
from mcore_kernels.errors import (
    KernelBackendError,
    KernelDeviceError,
    KernelDtypeError,
    KernelShapeError,
    KernelValueError,
)
from mcore_kernels.reference import rms_norm_reference

# Every CPU test here may run the Triton kernels through the interpreter (see conftest.py).
pytestmark = pytest.mark.interpreter

# A single row, odd 3-D shapes (the issue's (5, 123, 123) is interpreted once per dtype family
# below, as 615 programs are slow to interpret) and a row wider than MAX_BLOCK (looped variant).
SHAPES = [(1, 64), (2, 7, 123), (3, 9000)]
ISSUE_SHAPE = (5, 123, 123)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Output tolerances: float32 differs only by reduction order; half dtypes by one rounding step.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def torch_backend(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")


def _inputs(shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * scale).to(dtype)
    residual = (torch.randn(shape, generator=gen) * scale).to(dtype)
    weight = (1.0 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [(shape, dtype) for shape in SHAPES for dtype in DTYPES] + [(ISSUE_SHAPE, torch.bfloat16)],
    ids=str,
)
def test_triton_forward_matches_reference(triton_backend, shape, dtype):
    x, residual, weight = _inputs(shape, dtype)
    y, hidden = rms_norm(x, weight, 1e-6, residual=residual)
    y_ref, hidden_ref = rms_norm_reference(x, weight, 1e-6, residual=residual)
    assert y.dtype == dtype and hidden.dtype == dtype and y.shape == x.shape
    # x + residual is rounded once to the input dtype, exactly as torch does it.
    assert torch.equal(hidden, hidden_ref)
    torch.testing.assert_close(y, y_ref, atol=ATOL[dtype], rtol=ATOL[dtype])
    y_plain = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(
        y_plain, rms_norm_reference(x, weight, 1e-6), atol=ATOL[dtype], rtol=ATOL[dtype]
    )


@pytest.mark.parametrize(
    ("shape", "with_residual"),
    [(shape, True) for shape in [*SHAPES, ISSUE_SHAPE]] + [(shape, False) for shape in SHAPES],
    ids=str,
)
def test_triton_gradients_match_reference_in_float32(triton_backend, shape, with_residual):
    x, residual, weight = _inputs(shape, torch.float32, seed=1)
    gen = torch.Generator().manual_seed(2)
    grad_y = torch.randn(shape, generator=gen)
    grad_hidden = torch.randn(shape, generator=gen)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (x, residual, weight)]
        if with_residual:
            y, hidden = fn(leaves[0], leaves[2], 1e-6, residual=leaves[1])
            # Both outputs carry gradient: the residual stream continues to the next layer.
            torch.autograd.backward([y, hidden], [grad_y, grad_hidden])
        else:
            fn(leaves[0], leaves[2], 1e-6).backward(grad_y)
        return [leaf.grad for leaf in leaves]

    grads = run(rms_norm)
    grads_ref = run(rms_norm_reference)
    for got, expected in zip(grads, grads_ref, strict=True):
        if expected is None:
            assert got is None
        else:
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_triton_handles_hidden_size_65536(triton_backend):
    x, residual, weight = (t.requires_grad_() for t in _inputs((2, 65536), torch.float32, seed=9))
    y, hidden = rms_norm(x, weight, 1e-6, residual=residual)
    (y.sum() + hidden.pow(2).sum()).backward()
    grads = [t.grad for t in (x, residual, weight)]
    leaves = [t.detach().clone().requires_grad_() for t in (x, residual, weight)]
    y_ref, hidden_ref = rms_norm_reference(leaves[0], leaves[2], 1e-6, residual=leaves[1])
    (y_ref.sum() + hidden_ref.pow(2).sum()).backward()
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    for got, leaf in zip(grads, leaves, strict=True):
        torch.testing.assert_close(got, leaf.grad, atol=1e-4, rtol=1e-4)


def test_reference_gradients_pass_gradcheck_in_float64():
    x, residual, weight = (
        t.double().requires_grad_() for t in _inputs((3, 7), torch.float32, seed=3)
    )

    def both_outputs(x, weight, residual):
        y, hidden = rms_norm_reference(x, weight, 1e-6, residual=residual)
        return y, hidden

    assert torch.autograd.gradcheck(both_outputs, (x, weight, residual))
    assert torch.autograd.gradcheck(lambda x, w: rms_norm_reference(x, w, 1e-6), (x, weight))


@pytest.mark.parametrize("hidden", [96, 9000])
def test_triton_rows_are_bitwise_batch_invariant(triton_backend, hidden):
    x, residual, weight = _inputs((6, hidden), torch.bfloat16, seed=4)
    grad = _inputs((6, hidden), torch.bfloat16, seed=5)[0]

    def forward_backward(rows):
        xs = x[:rows].clone().requires_grad_()
        y, _ = rms_norm(xs, weight, 1e-6, residual=residual[:rows])
        y.backward(grad[:rows])
        return y, xs.grad

    y_all, dx_all = forward_backward(6)
    y_few, dx_few = forward_backward(2)
    assert torch.equal(y_all[:2], y_few)
    assert torch.equal(dx_all[:2], dx_few)


def test_triton_weight_gradient_is_deterministic(triton_backend):
    x, residual, weight = _inputs((37, 80), torch.float32, seed=6)

    def weight_grad():
        w = weight.clone().requires_grad_()
        y, hidden = rms_norm(x, w, 1e-6, residual=residual)
        (y * hidden).sum().backward()
        return w.grad

    assert torch.equal(weight_grad(), weight_grad())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_extreme_values_accumulate_in_float32(monkeypatch, backend):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", backend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Squares of these overflow float16; a zero row exercises the eps floor.
    x = torch.tensor([[60000.0, -60000.0, 30000.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float16)
    weight = torch.ones(4, dtype=torch.float16)
    y = rms_norm(x, weight, 1e-6)
    expected = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), expected, atol=2e-3, rtol=2e-3)


def test_rms_norm_module_matches_hugging_face_llama_rmsnorm(torch_backend):
    from transformers.models.llama import modeling_llama as llama

    hf = llama.LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(1.0 + 0.1 * torch.randn(48))
    ours = RMSNorm(48, eps=1e-5)
    assert list(ours.state_dict()) == list(hf.state_dict()) == ["weight"]
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(2, 5, 48)
    residual = torch.randn(2, 5, 48)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=1e-6)
    y, hidden = ours(x, residual)
    torch.testing.assert_close(hidden, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(y, hf(x + residual), atol=1e-6, rtol=1e-6)


def test_rms_norm_module_triton_path_matches_torch_path(monkeypatch):
    module = RMSNorm(40, eps=1e-6)
    x = torch.randn(3, 40)
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    expected = module(x)
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.testing.assert_close(module(x), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("hidden", [96, 3000, 9000])
def test_launch_config_is_chosen_by_row_width_and_rstd_kept_only_for_looped_rows(
    triton_backend, hidden
):
    rms_module = importlib.import_module("mcore_kernels.rms_norm")
    block, single, config, programs_cap, _, _ = rms_module._launch(hidden, -1)  # -1: the CPU
    width = min(1 << (hidden - 1).bit_length(), rms_module.MAX_BLOCK)
    entry = rms_module.LAUNCH_CONFIGS[min(w for w in rms_module.LAUNCH_CONFIGS if w >= width)]
    assert block == width and single == (hidden <= rms_module.MAX_BLOCK)
    # Rows wider than MAX_BLOCK stream one row at a time; the grid cap follows the entry.
    expected_rows = 1 if not single else entry.bwd_rows
    assert (config.bwd_rows, config.bwd_warps) == (expected_rows, entry.bwd_warps)
    assert programs_cap == 4 * entry.bwd_programs_per_sm  # 4 interpreter "multiprocessors"
    x, residual, weight = _inputs((2, hidden), torch.float32, seed=hidden)
    y, h, rstd = rms_module._forward(x, weight, 1e-6, residual, True)
    # Rows held in registers recompute rstd in the backward: the forward stores it only for
    # the looped variant, where it equals the reference's.
    if single:
        assert rstd is None
    else:
        expected = torch.rsqrt(h.double().pow(2).mean(-1) + 1e-6).float()
        torch.testing.assert_close(rstd, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(y, rms_norm_reference(x, weight, 1e-6, residual=residual)[0])


@pytest.mark.parametrize("rows", [5, 8])
def test_rows_exactly_one_block_wide_load_without_masks_and_match_the_reference(
    triton_backend, rows
):
    # Width 256 holds 4 rows per forward program: 8 rows take the unmasked variant, 5 the
    # masked one (a partial last row block).
    rms_module = importlib.import_module("mcore_kernels.rms_norm")
    assert rms_module._launch(256, -1).exact
    x, residual, weight = _inputs((rows, 256), torch.bfloat16, seed=rows)
    for res in (None, residual):
        got = rms_norm(x, weight, 1e-6, residual=res)
        expected = rms_norm_reference(x, weight, 1e-6, residual=res)
        if res is None:
            got, expected = (got,), (expected,)
        for value, reference in zip(got, expected, strict=True):
            torch.testing.assert_close(value.float(), reference.float(), atol=1e-2, rtol=1e-2)


def test_empty_leading_dimension_returns_empty(triton_backend):
    x = torch.randn(0, 16, requires_grad=True)
    weight = torch.ones(16, requires_grad=True)
    y, hidden = rms_norm(x, weight, residual=torch.zeros(0, 16))
    assert y.shape == (0, 16) and hidden.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(weight.grad, torch.zeros(16))


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"weight": torch.ones(7)}, KernelShapeError, "weight.shape=(7,)"),
        ({"weight": torch.ones(2, 8)}, KernelShapeError, "weight.shape=(2, 8)"),
        ({"residual": torch.ones(3, 4)}, KernelShapeError, "residual.shape=(3, 4)"),
        (
            {"residual": torch.ones(2, 8, dtype=torch.float16)},
            KernelDtypeError,
            "residual.dtype=torch.float16",
        ),
        ({"x": torch.ones(2, 8, dtype=torch.int32)}, KernelDtypeError, "x.dtype=torch.int32"),
        ({"x": [1.0] * 8}, KernelDtypeError, "x must be a torch.Tensor"),
        ({"eps": -1.0}, KernelValueError, "eps=-1.0"),
        ({"eps": float("nan")}, KernelValueError, "eps=nan"),
        ({"weight": torch.ones(8, device="meta")}, KernelDeviceError, "weight on meta"),
        ({"x": torch.ones(2, 0)}, KernelShapeError, "x.shape=(2, 0)"),
    ],
)
def test_bad_arguments_raise_typed_errors_naming_them(kwargs, error, fragment):
    args = {"x": torch.ones(2, 8), "weight": torch.ones(8), "eps": 1e-6, "residual": None}
    args.update(kwargs)
    with pytest.raises(error) as info:
        rms_norm(args["x"], args["weight"], args["eps"], residual=args["residual"])
    assert fragment in str(info.value)


def test_module_rejects_bad_hidden_size():
    with pytest.raises(KernelValueError, match="hidden_size=0"):
        RMSNorm(0)


def test_unknown_backend_variable_raises(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "cuda-please")
    with pytest.raises(KernelBackendError, match="MCORE_KERNELS_BACKEND='cuda-please'"):
        rms_norm(torch.ones(2, 8), torch.ones(8))


def test_triton_backend_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelBackendError, match="TRITON_INTERPRET=1"):
        rms_norm(torch.ones(2, 8), torch.ones(8))


def test_public_names_are_exported():
    assert mcore_kernels.rms_norm is rms_norm
    assert mcore_kernels.RMSNorm is RMSNorm
    assert mcore_kernels.reference.rms_norm_reference is rms_norm_reference


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(4096, 4096), (7, 65536), (5, 123, 123)], ids=str)
def test_cuda_triton_matches_reference(shape):
    x, residual, weight = (t.cuda() for t in _inputs(shape, torch.bfloat16, seed=7))
    y, hidden = rms_norm(x, weight, 1e-6, residual=residual)
    y_ref, hidden_ref = rms_norm_reference(x, weight, 1e-6, residual=residual)
    assert torch.equal(hidden, hidden_ref)
    torch.testing.assert_close(y, y_ref, atol=1.6e-2, rtol=1.6e-2)
    xs, rs, ws = (t.float().requires_grad_() for t in (x, residual, weight))
    grad = torch.randn_like(xs)
    rms_norm(xs, ws, 1e-6, residual=rs)[0].backward(grad)
    xr, rr, wr = (t.float().requires_grad_() for t in (x, residual, weight))
    rms_norm_reference(xr, wr, 1e-6, residual=rr)[0].backward(grad)
    torch.testing.assert_close(xs.grad, xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ws.grad, wr.grad, atol=1e-2, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hidden", [2048, 4096, 8192, 9000])
def test_cuda_rows_are_bitwise_batch_invariant(hidden):
    # Launch parameters may follow the number of rows (grid, pipelining, rows per program for
    # small calls): a row's output and input gradient must not.
    x, residual, weight = (t.cuda() for t in _inputs((4096, hidden), torch.bfloat16, seed=8))
    grad = torch.randn_like(x)

    def forward_backward(rows):
        xs = x[:rows].clone().requires_grad_()
        y, _ = rms_norm(xs, weight, 1e-6, residual=residual[:rows])
        y.backward(grad[:rows])
        return y.detach(), xs.grad

    y_full, dx_full = forward_backward(4096)
    for rows in (1, 3, 256):
        y, dx = forward_backward(rows)
        assert torch.equal(y_full[:rows], y), rows
        assert torch.equal(dx_full[:rows], dx), rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cached_launches_match_the_first_launch():
    module = importlib.import_module("mcore_kernels.rms_norm")
    x, residual, weight = (t.cuda() for t in _inputs((5, 3000), torch.bfloat16, seed=9))
    grad = torch.randn_like(x)
    results = []
    for _ in range(3):  # the first call compiles, the later ones take the cached launch
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y, hidden = rms_norm(xs, ws, 1e-6, residual=residual)
        y.backward(grad)
        results.append((y, hidden, xs.grad, ws.grad))
    assert module._FORWARD._fast and module._BACKWARD._fast
    for later in results[1:]:
        for first, again in zip(results[0], later, strict=True):
            assert torch.equal(first, again)
    y_ref, hidden_ref = rms_norm_reference(x, weight, 1e-6, residual=residual)
    assert torch.equal(results[0][1], hidden_ref)
    torch.testing.assert_close(results[0][0], y_ref, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1, 2048), (1, 8192), (1, 9000), (3, 64)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_cuda_repeated_calls_take_the_fast_path_with_the_first_calls_results(shape, with_residual):
    launch = importlib.import_module("mcore_kernels.rms_norm")
    x, residual, weight = (t.cuda() for t in _inputs(shape, torch.bfloat16, seed=shape[1]))
    residual = residual if with_residual else None
    grads = [torch.randn_like(x) for _ in range(2)]
    results = []
    for _ in range(3):  # the first call fills the fast-path tables, the later ones use them
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = rms_norm(xs, ws, 1e-6, residual=residual)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, grads[: len(outs)])
        with torch.no_grad():
            no_grad = rms_norm(x, weight, 1e-6, residual=residual)
        no_grad = no_grad if isinstance(no_grad, tuple) else (no_grad,)
        results.append((*outs, *no_grad, xs.grad, ws.grad))
    # The last entry: launched without programmatic dependent launch (outside its context).
    forward_key = (shape[0], shape[1], x.get_device(), x.dtype, weight.dtype, with_residual, False)
    assert forward_key in launch._FAST_FORWARD
    if shape[1] <= launch.MAX_BLOCK and shape[0] == 1:
        assert any(tuple(key[0]) == shape for key in launch._FAST_BACKWARD)
    for later in results[1:]:
        for first, again in zip(results[0], later, strict=True):
            assert torch.equal(first, again)
    reference = rms_norm_reference(x, weight, 1e-6, residual=residual)
    reference = reference if isinstance(reference, tuple) else (reference,)
    torch.testing.assert_close(results[0][0], reference[0], atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(4, 1024), (8, 256), (3, 2048)], ids=str)
def test_specialised_forward_is_bitwise_the_general_kernel(
    triton_backend, monkeypatch, rows, hidden, dtype
):
    # Whole row blocks of rows exactly one block wide run the specialised kernel (no masks, no
    # strides): its bits must be the general kernel's, and its values the reference's.
    launch = importlib.import_module("mcore_kernels.rms_norm")
    plan = launch._launch(hidden, -1)
    assert plan.exact and not rows % plan.config.fwd_rows
    launched = []
    exact_launcher = launch._FORWARD_EXACT

    class Spy:
        def keyed(self, *args):
            launched.append(args[0])
            return exact_launcher.keyed(*args)

        def entry(self, key):
            return exact_launcher.entry(key)

    monkeypatch.setattr(launch, "_FORWARD_EXACT", Spy())
    x, residual, weight = _inputs((rows, hidden), dtype, seed=rows + hidden, scale=3.0)
    for res in (None, residual):
        launched.clear()
        special = launch._forward(x, weight, 1e-6, res, False)
        assert launched, "the specialised kernel did not run"
        general = launch._forward(x, weight, 1e-6, res, False, specialise=False)
        for got, expected in zip(special[:2], general[:2], strict=True):
            assert torch.equal(got, expected)
        reference = rms_norm_reference(x, weight, 1e-6, residual=res)
        y_ref = reference if res is None else reference[0]
        torch.testing.assert_close(special[0], y_ref, atol=ATOL[dtype], rtol=ATOL[dtype])
        if res is not None:
            assert torch.equal(special[1], reference[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [2048, 8192])
def test_one_row_kernel_is_bitwise_the_general_kernel(triton_backend, monkeypatch, hidden, dtype):
    # One row exactly one block wide runs on row_programs programs, each reducing the whole
    # row and storing its share: the general kernel's bits, the reference's values.
    launch = importlib.import_module("mcore_kernels.rms_norm")
    config = launch._launch(hidden, -1).config
    assert config.row_programs > 1
    launched = []
    row_launcher = launch._FORWARD_ROW

    class Spy:
        def keyed(self, *args):
            launched.append(args[1])  # the grid
            return row_launcher.keyed(*args)

        def entry(self, key):
            return row_launcher.entry(key)

    monkeypatch.setattr(launch, "_FORWARD_ROW", Spy())
    x, residual, weight = _inputs((1, hidden), dtype, seed=hidden, scale=3.0)
    for res in (None, residual):
        launched.clear()
        special = launch._forward(x, weight, 1e-6, res, False)
        assert launched == [config.row_programs]
        general = launch._forward(x, weight, 1e-6, res, False, specialise=False)
        for got, expected in zip(special[:2], general[:2], strict=True):
            assert torch.equal(got, expected)
        reference = rms_norm_reference(x, weight, 1e-6, residual=res)
        y_ref = reference if res is None else reference[0]
        torch.testing.assert_close(special[0], y_ref, atol=ATOL[dtype], rtol=ATOL[dtype])
        if res is not None:
            assert torch.equal(special[1], reference[1])
    # Two rows take the specialised many-row kernel.
    launched.clear()
    launch._forward(x.expand(2, hidden).contiguous(), weight, 1e-6, None, False)
    assert not launched


_row_sum_of_squares = importlib.import_module("mcore_kernels.rms_norm")._row_sum_of_squares


@jit
def _row_sum_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, WARPS: tl.constexpr, VECTOR: tl.constexpr):
    h = tl.load(x_ptr + tl.arange(0, 1)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :])
    tl.store(out_ptr + tl.arange(0, 1), _row_sum_of_squares(h, BLOCK, WARPS, VECTOR))


@pytest.mark.parametrize(
    ("block", "warps", "vector"), [(2048, 8, 8), (8192, 16, 8), (2048, 4, 8), (256, 4, 2)]
)
def test_gathered_row_sum_of_squares_sums_the_row(triton_backend, block, warps, vector):
    # The one-barrier reduction of one row (the warps' sums gathered in every warp) computes
    # the row's sum of squares for one chunk per thread and several (2048 on 4 warps); its bits
    # against tl.sum are checked on the GPU (test_cuda_gathered_sum_keeps_the_general_bits).
    x = torch.randn(1, block, generator=torch.Generator().manual_seed(block + warps))
    out = torch.empty(1)
    _row_sum_kernel[(1,)](x, out, BLOCK=block, WARPS=warps, VECTOR=vector)
    expected = (x.double() ** 2).sum()
    torch.testing.assert_close(out[0].double(), expected, rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("hidden", "warps"), [(2048, 4), (2048, 8), (2048, 16), (4096, 8),
                                               (4096, 16), (4096, 32), (8192, 8), (8192, 16),
                                               (8192, 32)])  # fmt: skip
def test_cuda_gathered_sum_keeps_the_general_bits(hidden, warps, dtype):
    # One row per program (the specialised kernel, the one-row kernel) sums the squares with the
    # warps' sums gathered in every warp; the general kernel with tl.sum. Same tree, same bits,
    # for the table's warps and others.
    launch = importlib.import_module("mcore_kernels.rms_norm")
    config = dataclasses.replace(launch._launch(hidden, 0).config, fwd_warps=warps)
    x, residual, weight = (
        t.cuda() for t in _inputs((256, hidden), dtype, seed=hidden + warps, scale=3.0)
    )
    x *= torch.exp2(torch.randint(-8, 9, (256, 1), device="cuda")).to(dtype)
    general = launch._forward(x, weight, 1e-6, residual, False, config, specialise=False)
    special = launch._forward(x, weight, 1e-6, residual, False, config)
    assert torch.equal(special[0], general[0])
    for row in (0, 77, 255):
        one = launch._forward(
            x[row : row + 1], weight, 1e-6, residual[row : row + 1], False, config
        )
        assert torch.equal(one[0][0], general[0][row])
        assert torch.equal(one[1][0], general[1][row])


def test_launch_rejects_a_register_cap_out_of_range():
    launch = importlib.import_module("mcore_kernels.rms_norm")
    base = launch.LAUNCH_CONFIGS[8192]
    with pytest.raises(KernelValueError, match="fwd_max_registers=8"):
        dataclasses.replace(base, fwd_max_registers=8)
    assert dataclasses.replace(base, fwd_max_registers=0).fwd_max_registers == 0


def test_register_capped_specialised_forward_keeps_the_general_bits(triton_backend):
    # The 8192 entry caps the specialised forward's registers (a ptxas option: the schedule
    # changes, not the arithmetic); its launcher compiles with maxnreg, the bits are the
    # general kernel's.
    launch = importlib.import_module("mcore_kernels.rms_norm")
    cap = launch._launch(8192, -1).config.fwd_max_registers
    assert cap == 64
    x, residual, weight = _inputs((3, 8192), torch.bfloat16, seed=64, scale=3.0)
    special = launch._forward(x, weight, 1e-6, residual, False)
    assert launch._FORWARD_EXACT_CAPPED[cap]._options == {"maxnreg": cap}
    general = launch._forward(x, weight, 1e-6, residual, False, specialise=False)
    for got, expected in zip(special[:2], general[:2], strict=True):
        assert torch.equal(got, expected)
    assert launch._exact_launcher(0) is launch._FORWARD_EXACT


def test_launch_rejects_row_programs_not_a_power_of_two():
    launch = importlib.import_module("mcore_kernels.rms_norm")
    with pytest.raises(KernelValueError, match="row_programs=3"):
        launch.RMSNormLaunch(
            fwd_rows=1,
            fwd_warps=8,
            bwd_rows=1,
            bwd_warps=8,
            bwd_programs_per_sm=1,
            bwd_stages=1,
            row_programs=3,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 2048), (4, 256), (2, 1024)], ids=str)
def test_specialised_backward_is_bitwise_the_general_kernel(triton_backend, rows, hidden, dtype):
    # A call that is one row block of rows exactly one block wide runs the specialised
    # one-program backward: the general kernel's bits, the reference's values.
    launch = importlib.import_module("mcore_kernels.rms_norm")
    x, residual, weight = _inputs((rows, hidden), dtype, seed=rows * hidden, scale=2.0)
    gen = torch.Generator().manual_seed(rows)
    dy, dh = (torch.randn(rows, hidden, generator=gen).to(dtype) for _ in range(2))
    hidden_states = x + residual
    for dhidden in (None, dh):
        special = launch._backward(dy, dhidden, hidden_states, weight, None, 1e-6)
        general = launch._backward(dy, dhidden, hidden_states, weight, None, 1e-6, specialise=False)
        for got, expected in zip(special, general, strict=True):
            assert torch.equal(got, expected)
        leaves = hidden_states.float().requires_grad_(), weight.float().requires_grad_()
        y_ref = rms_norm_reference(leaves[0], leaves[1], 1e-6)
        dx_ref, dw_ref = torch.autograd.grad(y_ref, leaves, dy.float())
        if dhidden is not None:
            dx_ref = dx_ref + dhidden.float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(special[0].float(), dx_ref, atol=tol, rtol=tol)
        torch.testing.assert_close(special[1].float(), dw_ref, atol=tol * 4, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hidden", [2048, 4096, 8192])
@pytest.mark.parametrize("rows", [1, 2, 256, 4096])
def test_cuda_specialised_kernels_are_bitwise_the_general_ones(rows, hidden):
    launch = importlib.import_module("mcore_kernels.rms_norm")
    x, residual, weight = (
        t.cuda() for t in _inputs((rows, hidden), torch.bfloat16, seed=rows + hidden, scale=3.0)
    )
    dy, dh = torch.randn_like(x), torch.randn_like(x)
    for res in (None, residual):
        for _ in range(2):  # the second call takes the cached fast launch
            special = launch._forward(x, weight, 1e-6, res, False)
            general = launch._forward(x, weight, 1e-6, res, False, specialise=False)
            for got, expected in zip(special[:2], general[:2], strict=True):
                assert torch.equal(got, expected)
    h = x + residual
    for dhidden in (None, dh):
        for _ in range(2):
            special = launch._backward(dy, dhidden, h, weight, None, 1e-6)
            general = launch._backward(dy, dhidden, h, weight, None, 1e-6, specialise=False)
            for got, expected in zip(special, general, strict=True):
                assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_general_kernel_calls_leave_the_fast_tables_alone(triton_backend, device):
    # A call with specialise=False (the tests' and benchmarks' comparison) must not put the
    # general kernel into the table that later default calls launch from.
    launch = importlib.import_module("mcore_kernels.rms_norm")
    x, residual, weight = (t.to(device) for t in _inputs((1, 512), torch.float32, seed=3))
    before = (dict(launch._FAST_FORWARD), dict(launch._FAST_BACKWARD))
    launch._forward(x, weight, 1e-6, residual, False, specialise=False)
    launch._backward(x, residual, x, weight, None, 1e-6, specialise=False)
    assert before == (launch._FAST_FORWARD, launch._FAST_BACKWARD)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hidden", [2048, 3000])
def test_cuda_one_token_backward_takes_the_cached_launch(monkeypatch, hidden):
    module = importlib.import_module("mcore_kernels.rms_norm")
    taken = []
    cached = module._backward_cached

    def counting(*args):
        result = cached(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(module, "_backward_cached", counting)
    x, residual, weight = (t.cuda() for t in _inputs((1, hidden), torch.bfloat16, seed=hidden))
    grads = [torch.randn_like(x) for _ in range(2)]
    results = []
    for _ in range(3):
        leaves = [t.clone().requires_grad_() for t in (x, residual, weight)]
        outs = rms_norm(leaves[0], leaves[2], 1e-6, residual=leaves[1])
        results.append(torch.autograd.grad(outs, leaves, grads))
    # The first backward may have been cached by another test; the later two are.
    assert taken[-2:] == [True, True]
    for later in results[1:]:
        for first, again in zip(results[0], later, strict=True):
            assert torch.equal(first, again)


class _RecordedLaunches:
    """Stand-in of a CachedLauncher: records each launch, and its "compiled" entries record too.

    The interpreter caches no compiled launch, so the CPU test of the backward's fast table
    gives it entries whose ``run`` records the grid and runtime arguments it is called with
    (an empty constexpr tail: the recorded arguments are what the kernel receives).
    """

    def __init__(self, name, launches):
        self.name, self.launches, self.entries = name, launches, {}

    def _run(self, grid, _y, _z, _stream, _function, _metadata, *rest):
        self.launches.append((self.name, grid, rest[3:]))

    def keyed(self, key, programs, args, addresses, constexprs, num_warps, device_index):
        self.launches.append((self.name, programs, addresses))
        self.entries[key] = (self._run, None, None, ())

    def entry(self, key):
        return self.entries.get(key)

    def __call__(self, grid, args, constexprs, num_warps, device_index):
        self.launches.append((self.name, grid[0], "untuned"))


def test_multi_program_backward_fast_table_launches_what_the_general_path_launched(monkeypatch):
    # A backward of several programs (each writes float32 partials, a second kernel sums them)
    # seen before runs from the fast table: the same two kernels with the same grids and
    # arguments as the general path's launches, so the same bits (the GPU test below compares
    # them); inputs the entry was not built for fall back to the general path.
    launch = importlib.import_module("mcore_kernels.rms_norm")
    launches: list = []
    monkeypatch.setattr(launch, "_BACKWARD", _RecordedLaunches("bwd", launches))
    monkeypatch.setattr(launch, "_SUM_PARTIALS", _RecordedLaunches("sum", launches))
    monkeypatch.setattr(launch, "_FAST_BACKWARD", {})
    monkeypatch.setattr(launch, "_current_device", lambda: -1)
    monkeypatch.setattr(launch, "_current_stream", lambda device_index: 0)
    rows, hidden = 64, 2048  # 16 row blocks over the CPU's cap of 4 programs
    x, residual, weight = _inputs((rows, hidden), torch.bfloat16, seed=11)
    h = x + residual
    dy, dh = torch.randn_like(h), torch.randn_like(h)
    for dhidden in (None, dh):
        launches.clear()
        general = launch._backward(dy, dhidden, h, weight, None, 1e-6)
        (_, programs, first), (_, columns, sums) = launches
        assert programs > 1 and columns == -(-hidden // launch._PARTIAL_SUM_COLS)
        template = launch._FAST_BACKWARD[
            (h.shape, -1, dy.dtype, dy.dtype, h.dtype, weight.dtype, dhidden is not None)
        ][-1][-1]
        partial = torch.empty_like(template)
        assert partial.shape == (programs, hidden) and partial.dtype == torch.float32
        assert partial.is_contiguous()
        launches.clear()
        fast = launch._backward_cached(dy, dhidden, h, weight, 1e-6)
        assert fast is not None
        (name, grid, again), (sum_name, sum_grid, sums_again) = launches
        assert (name, grid, sum_name, sum_grid) == ("bwd", programs, "sum", columns)
        assert again[:5] == first[:5] and again[7:] == first[7:]
        assert again[5] == fast[0].data_ptr() and again[6] == sums_again[0]
        assert sums_again[1] == fast[1].data_ptr() and sums_again[2:] == sums[2:]
        assert sums[:2] == (first[6], general[1].data_ptr())
        # Misaligned, non-contiguous, another dtype: not the entry's call.
        misaligned = torch.empty(rows * hidden + 1, dtype=dy.dtype)[1:].view(rows, hidden)
        misaligned.copy_(dy)
        strided = dy.t().contiguous().t()
        for other in (misaligned, strided, dy.float()):
            launches.clear()
            assert launch._backward_cached(other, dhidden, h, weight, 1e-6) is None
            assert not launches
    # The general path of a misaligned call launches without a key (nothing cached).
    launches.clear()
    launch._backward(misaligned, None, h, weight, None, 1e-6)
    assert launches[0][2] == "untuned"


def test_backward_fast_table_starts_again_past_its_limit(monkeypatch):
    launch = importlib.import_module("mcore_kernels.rms_norm")
    launches: list = []
    monkeypatch.setattr(launch, "_BACKWARD", _RecordedLaunches("bwd", launches))
    monkeypatch.setattr(launch, "_SUM_PARTIALS", _RecordedLaunches("sum", launches))
    monkeypatch.setattr(launch, "_FAST_BACKWARD", {})
    monkeypatch.setattr(launch, "_FAST_BACKWARD_LIMIT", 2)
    weight = torch.ones(256)
    for rows in (16, 24, 32):  # three shapes of several programs
        h = torch.randn(rows, 256)
        launch._backward(h, None, h, weight, None, 1e-6)
    assert [key[0][0] for key in launch._FAST_BACKWARD] == [32]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("rows", "hidden"), [(256, 4096), (4096, 2048), (300, 3000)], ids=str)
def test_cuda_multi_program_backward_fast_table_gives_the_general_paths_bits(
    monkeypatch, rows, hidden
):
    launch = importlib.import_module("mcore_kernels.rms_norm")
    monkeypatch.setattr(launch, "_FAST_BACKWARD", {})
    x, residual, weight = (t.cuda() for t in _inputs((rows, hidden), torch.bfloat16, seed=rows))
    h = x + residual
    dy, dh = torch.randn_like(h), torch.randn_like(h)
    for dhidden in (None, dh):
        general = launch._backward(dy, dhidden, h, weight, None, 1e-6)
        key = (h.shape, h.get_device(), *(torch.bfloat16,) * 4, dhidden is not None)
        assert launch._FAST_BACKWARD[key][-1] is not None  # the entry of several programs
        for _ in range(2):
            fast = launch._backward_cached(dy, dhidden, h, weight, 1e-6)
            assert fast is not None
            for got, expected in zip(fast, general, strict=True):
                assert torch.equal(got, expected)
        leaves = h.float().requires_grad_(), weight.float().requires_grad_()
        dx_ref, dw_ref = torch.autograd.grad(rms_norm_reference(*leaves, 1e-6), leaves, dy.float())
        if dhidden is not None:
            dx_ref = dx_ref + dhidden.float()
        torch.testing.assert_close(fast[0].float(), dx_ref, atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(fast[1].float(), dw_ref, atol=0.5, rtol=2e-2)
