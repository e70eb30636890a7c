"""decode_gemv: the Triton kernel (interpreted on CPU) against the torch reference, which is
checked against the unfused torch ops it stands for; dispatch, errors, the custom op; and a GPU
run in bfloat16 (eager, split-K determinism, CUDA graph replay)."""

import importlib
import os

import torch

if not torch.cuda.is_available():
    # Must precede the kernel module's import: triton.jit reads it when decorating.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

from mcore_kernels.decode_gemv import GemvConfig, decode_gemv, decode_gemv_triton, gemv_config
from mcore_kernels.errors import KernelDtypeError, KernelShapeError, KernelValueError
from mcore_kernels.reference import decode_gemv_reference

_RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not _RUNS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")

N, K = 24, 72
"""Neither a multiple of the tiles below (16 columns, 32 reduction elements)."""

FLAGS = {
    "plain": {},
    "bias": {"bias": True},
    "norm_bias_residual": {"bias": True, "norm": True, "residual": True},
    "norm_swiglu_residual": {"norm": True, "swiglu": True, "residual": True, "bias": True},
}
CONFIGS = {
    "vector": GemvConfig(block_n=16, block_k=32),
    "vector_ticket": GemvConfig(block_n=8, block_k=32, split_k=3),
    "vector_second_pass": GemvConfig(block_n=16, block_k=32, split_k=3, reduce="second_pass"),
    "dot_ticket": GemvConfig(block_n=16, block_k=32, split_k=2, use_dot=True),
}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _problem(rows, flags, dtype, *, n=N, k=K, seed=0, device=None):
    generator = torch.Generator().manual_seed(seed)
    swiglu = bool(flags.get("swiglu"))
    weight_rows = 2 * n if swiglu else n

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=generator) * scale).to(dtype).to(device or _device())

    return dict(
        x=rand(rows, k),
        weight=rand(weight_rows, k, scale=k**-0.5),
        bias=rand(weight_rows) if flags.get("bias") else None,
        norm_weight=(1 + rand(k, scale=0.1)) if flags.get("norm") else None,
        swiglu=swiglu,
        residual=rand(rows, n) if flags.get("residual") else None,
    )


def _unfused(x, weight, bias, norm_weight, swiglu, residual, eps=1e-6):
    """The float64 torch ops the fused projection replaces (RMSNorm, linear, SwiGLU, add)."""
    x, weight = x.double(), weight.double()
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    y = F.linear(x, weight, None if bias is None else bias.double())
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.double()
    return y


@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
def test_reference_matches_the_unfused_ops(flags):
    problem = _problem(3, flags, torch.float64, device="cpu")
    expected = _unfused(**problem)
    torch.testing.assert_close(decode_gemv_reference(**problem), expected)


FLOAT32_CASES = [
    *((name, "norm_swiglu_residual", 3) for name in CONFIGS),
    ("vector", "plain", 1),
    ("vector_ticket", "norm_bias_residual", 1),
    ("dot_ticket", "bias", 1),
    ("vector_second_pass", "norm_bias_residual", 3),
]


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize(("config", "flags", "rows"), FLOAT32_CASES)
def test_triton_matches_reference_float32(config, flags, rows):
    problem = _problem(rows, FLAGS[flags], torch.float32)
    out = decode_gemv_triton(**problem, config=CONFIGS[config])
    expected = decode_gemv_reference(**problem)
    assert out.shape == (rows, N)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("config", ["vector", "dot_ticket"])
def test_reduction_shorter_than_one_tile(config):
    # K = 20 < block_k = 32: the first (and only) tile is the masked tail.
    problem = _problem(3, FLAGS["norm_swiglu_residual"], torch.float32, k=20)
    out = decode_gemv_triton(**problem, config=CONFIGS[config])
    torch.testing.assert_close(out, decode_gemv_reference(**problem), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("flags", ["plain", "norm_swiglu_residual"])
@pytest.mark.parametrize("rows", [1, 3])
def test_early_tail_is_the_same_sum(monkeypatch, flags, rows):
    # K = 50: one full tile of 32 and a tail of 18, both requested before the products.
    gemv_module = importlib.import_module("mcore_kernels.decode_gemv")

    problem = _problem(rows, FLAGS[flags], torch.float32, k=50)
    config = GemvConfig(block_n=8, block_k=32)
    early = decode_gemv_triton(**problem, config=config)
    monkeypatch.setattr(gemv_module, "EARLY_TAIL", False)
    late = decode_gemv_triton(**problem, config=config)
    assert torch.equal(early, late)
    torch.testing.assert_close(early, decode_gemv_reference(**problem), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.interpreter
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_triton_matches_reference_bfloat16(config):
    problem = _problem(3, FLAGS["norm_swiglu_residual"], torch.bfloat16, seed=1)
    out = decode_gemv_triton(**problem, config=config)
    expected = decode_gemv_reference(**problem)
    # float32 sums in another order: at most one bfloat16 rounding step apart.
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=2**-7)
    assert (out == expected).float().mean() > 0.9


@needs_triton
@pytest.mark.interpreter
def test_default_config_and_dispatch(monkeypatch):
    problem = _problem(2, FLAGS["norm_bias_residual"], torch.float32)
    expected = decode_gemv_reference(**problem)
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "triton")
    torch.testing.assert_close(decode_gemv(**problem), expected, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("MCORE_KERNELS_BACKEND", "torch")
    assert torch.equal(decode_gemv(**problem), expected)


def test_gemv_config_choice():
    # Narrow output, long reduction: one weight row per program, the whole row as one tile of
    # a power of two plus the tail (both requested before the PDL wait), or as one tile.
    one_row = gemv_config(1, 896, 4864, multiprocessors=132)
    assert not one_row.use_dot and one_row.split_k == 1 and one_row.block_n == 1
    assert one_row.block_k == 4096 and one_row.num_warps == 4
    whole = gemv_config(1, 896, 8192, multiprocessors=132)
    assert whole.block_k == 8192 and whole.num_warps == 8
    # Enough outputs for two rows per program (Llama-3.2-1B's down projection).
    wide = gemv_config(1, 2048, 8192, multiprocessors=132)
    assert wide.block_n == 2 and wide.block_k == 2048
    assert gemv_config(2, 1152, 896, multiprocessors=132).block_k == 1024
    down = gemv_config(16, 896, 4864, multiprocessors=132)
    assert down.use_dot and down.split_k == 4 and down.block_n == 16
    # Wide projections: wide tiles, and no split when the tiles fill the device.
    head = gemv_config(16, 151936, 896, multiprocessors=132)
    assert head.use_dot and head.block_n == 64 and head.split_k == 1
    assert gemv_config(16, 896, 4864, multiprocessors=8).split_k == 1


def test_zero_rows_give_an_empty_result():
    problem = _problem(0, FLAGS["bias"], torch.float32)
    assert decode_gemv(**problem).shape == (0, N)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"weight": torch.zeros(N, K + 1)}, KernelShapeError, "expected \\[M, K\\] and \\[N, K\\]"),
        ({"bias": torch.zeros(N + 1)}, KernelShapeError, "bias has shape"),
        ({"norm_weight": torch.zeros(K - 1)}, KernelShapeError, "norm_weight has shape"),
        ({"residual": torch.zeros(2, N - 1)}, KernelShapeError, "residual has shape"),
        ({"residual": torch.zeros(2, N, dtype=torch.float64)}, KernelDtypeError, "residual"),
        ({"weight": torch.zeros(N, K, dtype=torch.float64)}, KernelDtypeError, "one float"),
        ({"weight": torch.zeros(N - 1, K), "swiglu": True}, KernelShapeError, "even count"),
    ],
)
def test_bad_arguments_raise(change, error, match):
    args = dict(x=torch.zeros(2, K), weight=torch.zeros(N, K))
    args.update(change)
    if args.get("swiglu"):
        args["residual"] = None
    with pytest.raises(error, match=match):
        decode_gemv(**args)


@pytest.mark.parametrize(
    "fields",
    [
        {"block_n": 12},
        {"block_k": 8},
        {"split_k": 0},
        {"reduce": "atomic"},
        {"use_dot": True, "block_n": 8},
    ],
)
def test_config_validation(fields):
    with pytest.raises(KernelValueError, match="GemvConfig"):
        GemvConfig(**fields)


def test_custom_op_under_torch_compile():
    problem = _problem(2, FLAGS["norm_swiglu_residual"], torch.float32, device="cpu")
    compiled = torch.compile(lambda p: decode_gemv(**p), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(problem), decode_gemv_reference(**problem))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("rows", [1, 3, 16, 64])
@pytest.mark.parametrize("flags", FLAGS.values(), ids=FLAGS.keys())
def test_gpu_bfloat16_default_config_eager_and_graph(flags, rows):
    problem = _problem(rows, flags, torch.bfloat16, n=896, k=4864, device="cuda")
    expected = decode_gemv_reference(**problem)
    out = decode_gemv(**problem)
    diff = (out.float() - expected.float()).abs()
    bound = 2**-7 * (1.0 + expected.float().abs())
    # Rows past the vector path run tensor-core dots on the bf16-rounded (normalised) input,
    # as a separate norm kernel followed by cuBLAS would: on the H100 2 of 57344 elements of
    # the fused norm + SwiGLU + residual case at 64 rows landed a few ulps beyond the bound.
    assert (diff > bound).float().mean().item() <= 1e-3, diff.max()
    assert diff.max().item() <= 2**-4
    # The split-K sum runs in a fixed order: repeated launches agree bit for bit.
    assert torch.equal(decode_gemv(**problem), out)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_gemv(**problem)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = decode_gemv(**problem)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)
