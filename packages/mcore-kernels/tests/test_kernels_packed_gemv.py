"""packed_gemv: the Triton kernel (interpreted on CPU) against the torch reference and against
decode_gemv, the operand checks, dispatch, the custom op; on a GPU under programmatic dependent
launch in a CUDA graph."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.packed_gemv import (
    PackedGemvConfig,
    packed_gemv,
    packed_gemv_supports,
    packed_gemv_triton,
)
from mcore_kernels.reference import decode_gemv_reference, packed_gemv_reference

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")

N, K = 22, 72
"""Neither a multiple of the tiles (4-8 columns; 36 words of a 64-word tile)."""


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _problem(rows, *, norm=False, swiglu=False, residual=False, n=N, k=K, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(torch.bfloat16).to(_device())

    return dict(
        x=rand(rows, k, scale=3.0),
        weight=rand(2 * n if swiglu else n, k, scale=k**-0.5),
        norm_weight=(1 + rand(k, scale=0.1)) if norm else None,
        swiglu=swiglu,
        residual=rand(rows, n) if residual else None,
    )


FLAGS = {
    "plain": {},
    "norm_swiglu": {"norm": True, "swiglu": True},
    "norm_residual": {"norm": True, "residual": True},
    "swiglu_residual": {"swiglu": True, "residual": True},
}


def _close(got, expected):
    # float32 sums in another order: at most about one bfloat16 rounding step apart.
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-6)


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
@pytest.mark.parametrize("block_n", [4, 8])
def test_packed_gemv_matches_reference(rows, flags, block_n):
    problem = _problem(rows, **flags)
    got = packed_gemv_triton(**problem, config=PackedGemvConfig(block_n=block_n), pdl=False)
    if rows == 1 and block_n == 8:
        # The public entry point (Triton backend on CUDA or under the interpreter) agrees.
        torch.testing.assert_close(packed_gemv(**problem, config=PackedGemvConfig(block_n=8)), got)
    expected = packed_gemv_reference(**problem)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    _close(got, expected)


@needs_triton
@pytest.mark.interpreter
def test_packed_gemv_matches_decode_gemv_of_the_decoder_shape(monkeypatch):
    # The gate/up projection of a layer (norm + SwiGLU), K not a power of two: decode_gemv's
    # Triton path computes the same roundings.
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    problem = _problem(1, norm=True, swiglu=True, n=12, k=96, seed=3)
    got = packed_gemv(**problem)
    expected = decode_gemv(**problem)
    _close(got, expected)
    assert (got != expected).float().mean() < 0.1


def test_packed_gemv_reference_is_decode_gemv_reference():
    problem = _problem(2, norm=True, swiglu=True, residual=True)
    torch.testing.assert_close(packed_gemv_reference(**problem), decode_gemv_reference(**problem))


def test_packed_gemv_dispatches_to_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    problem = _problem(2, norm=True, residual=True)
    torch.testing.assert_close(packed_gemv(**problem), packed_gemv_reference(**problem))


def test_packed_gemv_supports():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    weight = torch.zeros(6, 8, dtype=torch.bfloat16)
    assert packed_gemv_supports(x, weight)
    assert not packed_gemv_supports(x.float(), weight.float())
    assert not packed_gemv_supports(torch.zeros(5, 8, dtype=torch.bfloat16), weight)
    assert not packed_gemv_supports(x[:, :7], weight[:, :7])
    assert not packed_gemv_supports(x, weight.t().contiguous().t())
    assert not packed_gemv_supports(x, weight[:, :6])


def test_packed_gemv_rejects_bad_arguments(monkeypatch):
    problem = _problem(2, norm=True, swiglu=True, residual=True)
    with pytest.raises(KernelShapeError, match="x"):
        packed_gemv(problem["x"], problem["weight"][:, :-2])
    with pytest.raises(KernelShapeError, match="swiglu"):
        packed_gemv(problem["x"], problem["weight"][:-1], swiglu=True)
    with pytest.raises(KernelShapeError, match="norm_weight"):
        packed_gemv(problem["x"], problem["weight"], norm_weight=problem["norm_weight"][:-1])
    with pytest.raises(KernelShapeError, match="residual"):
        packed_gemv(problem["x"], problem["weight"], residual=problem["residual"])
    with pytest.raises(KernelDtypeError, match="x"):
        packed_gemv(problem["x"].float(), problem["weight"])
    with pytest.raises(KernelValueError, match="block_n"):
        PackedGemvConfig(block_n=3)
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    with pytest.raises(KernelDtypeError, match="bfloat16"):
        packed_gemv_triton(problem["x"].float(), problem["weight"].float())
    with pytest.raises(KernelShapeError, match="rows"):
        packed_gemv_triton(problem["x"].repeat(3, 1), problem["weight"])


@needs_triton
@pytest.mark.interpreter
def test_packed_gemv_custom_op_matches(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    problem = _problem(1, norm=True, swiglu=True)
    op = torch.ops.mcore_kernels.packed_gemv
    args = (problem["x"], problem["weight"], problem["norm_weight"], 1e-6, True, None, 8, 4, False)
    got = op(*args)
    _close(got, packed_gemv_reference(**problem))


def test_opcheck_packed_gemv(monkeypatch):
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    problem = _problem(2, norm=True, swiglu=True, residual=True)
    args = (problem["x"], problem["weight"], problem["norm_weight"], 1e-6, True)
    torch.library.opcheck(
        torch.ops.mcore_kernels.packed_gemv, (*args, problem["residual"], 4, 4, None)
    )
    torch.library.opcheck(
        torch.ops.mcore_kernels.packed_gemv, (*args[:2], None, 1e-6, False, None, 8, 4, False)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packed_gemv_in_a_graph_with_pdl():
    from mcore_kernels.pdl import programmatic_dependent_launch

    problem = _problem(1, norm=True, swiglu=True, n=4864, k=896)
    with programmatic_dependent_launch(True):
        eager = packed_gemv(**problem)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = packed_gemv(**problem)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, captured)
    _close(eager, packed_gemv_reference(**problem))


@needs_triton
@pytest.mark.interpreter
def test_packed_gemv_long_reduction_with_residual():
    # The down projection's shape class: K past 4096 (4864: 2432 of 4096 words), one column
    # per program, the residual add.
    problem = _problem(1, residual=True, n=3, k=4864, seed=5)
    got = packed_gemv_triton(**problem, config=PackedGemvConfig(block_n=1), pdl=False)
    _close(got, packed_gemv_reference(**problem))
