"""The invariant GEMM's launch configurations: fixed split-K and the TMA kernel stay invariant."""

import os

import pytest
import torch
import torch.nn.functional as F

from mcore_kernels import KernelShapeError
from mcore_kernels.batch_invariant import linear_batch_invariant
from mcore_kernels.batch_invariant.matmul import GemmConfig, gemm_config, launch_gemm

CONFIGS = {
    "tiles": GemmConfig(block_m=16, block_n=32, block_k=32, warps=4, stages=2),
    "split3": GemmConfig(block_m=16, block_n=32, block_k=16, warps=4, stages=2, splits=3),
    "tma": GemmConfig(block_m=32, block_n=16, block_k=32, warps=4, stages=2, tma=True),
    "tma_split2": GemmConfig(
        block_m=16, block_n=32, block_k=16, warps=4, stages=2, splits=2, tma=True
    ),
}


def _unaligned(x):
    """``x`` copied to an address 2 bytes past an aligned one."""
    buffer = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    out = buffer[1:].view(x.shape)
    out.copy_(x)
    return out


@pytest.fixture(scope="module")
def operands():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(66, 48, generator=generator).bfloat16()
    weight = torch.randn(24, 48, generator=generator).bfloat16()
    return x, weight


@pytest.mark.interpreter
@pytest.mark.parametrize("name", list(CONFIGS))
def test_rows_equal_inside_any_batch_for_each_config(operands, name):
    x, weight = operands
    config = CONFIGS[name]

    def product(rows):
        return launch_gemm(rows, weight.t()[None], None, rows.shape[0], config)

    full = product(x)
    for rows in (1, 3, 64):
        assert torch.equal(product(x[:rows]), full[:rows]), f"rows={rows}"
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    assert torch.equal(product(x[order]), full[order])
    # Rows at an address that is not 16-byte aligned (copied for TMA) give the same bits.
    assert torch.equal(product(_unaligned(x[:3])), full[:3])
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(full.double(), expected, atol=0.1, rtol=1e-2)


@pytest.mark.interpreter
def test_split_k_adds_the_float32_partials_of_the_pieces_in_order(operands):
    x, weight = operands
    x, weight = x[:5].float(), weight.float()
    tiles = dict(block_m=16, block_n=32, block_k=16, warps=4, stages=2)
    split = GemmConfig(**tiles, splits=3)
    assert split.k_per_split(48) == 16
    out = launch_gemm(x, weight.t()[None], None, 5, split)
    # Each piece of 16 columns reduced alone from zero, as the split's program does.
    pieces = [
        launch_gemm(
            x[:, i * 16 : (i + 1) * 16].contiguous(),
            weight[:, i * 16 : (i + 1) * 16].t()[None],
            None,
            5,
            GemmConfig(**tiles),
        )
        for i in range(3)
    ]
    assert torch.equal(out, (pieces[0] + pieces[1]) + pieces[2])


@pytest.mark.interpreter
def test_grouped_product_with_split_k_is_invariant(operands):
    x, weight = operands
    experts = torch.stack([weight, weight.flip(0)]).transpose(1, 2).contiguous()
    config = CONFIGS["split3"]
    ends = torch.tensor([30, 66])
    full = launch_gemm(x, experts, ends, 0, config)
    first = launch_gemm(x[:3], experts, torch.tensor([3, 3]), 0, config)
    assert torch.equal(first, full[:3])
    second = launch_gemm(x[30:34], experts, torch.tensor([0, 4]), 0, config)
    assert torch.equal(second, full[30:34])


def test_config_depends_on_width_depth_and_dtype_only():
    device = torch.device("cpu")
    assert gemm_config(2048, 8192, torch.bfloat16, device) == gemm_config(
        2048, 8192, torch.bfloat16, device
    )
    assert gemm_config(64, 64, torch.float32, device).block_m == 32


@pytest.mark.parametrize(
    ("field", "value"),
    [("block_m", 24), ("block_k", 8), ("warps", 3), ("stages", 0), ("splits", 0)],
)
def test_config_rejects_bad_values(field, value):
    fields = dict(block_m=16, block_n=16, block_k=16, warps=4, stages=2)
    fields[field] = value
    with pytest.raises(KernelShapeError, match=field):
        GemmConfig(**fields)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(512, 2048), (2048, 8192), (128256, 2048)])
def test_gpu_bf16_model_shapes_rows_equal_for_every_batch_size(shape):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compiled kernels only")
    generator = torch.Generator(device="cuda").manual_seed(0)
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features, device="cuda", generator=generator)
    x = torch.randn(300, in_features, device="cuda", generator=generator)
    weight, x = weight.bfloat16(), x.bfloat16()
    full = linear_batch_invariant(x, weight)
    for rows in (1, 3, 64, 256):
        assert torch.equal(linear_batch_invariant(x[:rows], weight), full[:rows])
    assert torch.equal(linear_batch_invariant(_unaligned(x[:3]), weight), full[:3])
    torch.testing.assert_close(
        full.float(), F.linear(x.float(), weight.float()), atol=0.5, rtol=2e-2
    )
