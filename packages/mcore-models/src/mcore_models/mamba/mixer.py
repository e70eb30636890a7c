"""The Mamba-2 mixer: in_proj, depthwise causal conv1d, SSD scan, gated RMSNorm, out_proj."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mcore_kernels.ssd import (
    causal_conv1d,
    causal_conv1d_update,
    ssd_scan,
    ssd_state_update,
)
from mcore_models.mamba.config import HybridConfig
from mcore_models.mamba.state import MambaStepState

__all__ = ["GatedRMSNorm", "Mamba2Mixer", "gated_rms_norm"]


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, groups: int, eps: float
) -> torch.Tensor:
    """``rms_norm(x * silu(gate))`` over ``groups`` equal slices of the last dimension.

    Args:
        x: ``[..., D]`` SSM output.
        gate: ``[..., D]`` gate (the ``z`` branch of in_proj).
        weight: ``[D]`` scale.
        groups: Number of independently normalised slices of ``D``.
        eps: Added to each slice's mean square.

    Returns:
        float32 ``[..., D]`` normalised output (cast by the caller before out_proj).
    """
    h = x.float() * F.silu(gate.float())
    h = h.unflatten(-1, (groups, -1))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.flatten(-2) * weight.float()


class GatedRMSNorm(nn.Module):
    """Holds the scale of :func:`gated_rms_norm` (one weight per channel).

    Args:
        size: Channels.
        groups: Normalised slices.
        eps: Epsilon.
        dtype: Parameter dtype.
    """

    def __init__(self, size: int, groups: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.groups = groups
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Normalise ``x * silu(gate)``.

        Args:
            x: ``[..., size]``.
            gate: ``[..., size]``.

        Returns:
            float32 ``[..., size]``.
        """
        return gated_rms_norm(x, gate, self.weight, groups=self.groups, eps=self.eps)


class Mamba2Mixer(nn.Module):
    """Mamba-2 token mixer (Dao & Gu, 2024), plain torch around the mcore-kernels SSD scan.

    ``in_proj`` maps the hidden state to ``[z | x B C | dt]``; ``x B C`` goes through the
    depthwise causal convolution and SiLU; the SSD scan with ``A = -exp(A_log)``,
    ``dt = clamp(softplus(dt + dt_bias))`` and skip ``D`` mixes tokens; the output is
    ``out_proj(gated_rms_norm(y, z))``. ``num_heads`` and ``num_groups`` are the heads and
    groups this module computes: all, or this rank's share after tensor-parallel sharding
    (``in_proj`` rows, conv channels and the per-head parameters sliced by head and group,
    ``out_proj`` by input column with its output summed over the group).

    Args:
        config: Model config.
        layer_idx: Global index of the layer (keys of :class:`MambaStepState`).
    """

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.mamba_num_heads
        self.num_groups = config.mamba_num_groups
        self.head_dim = config.mamba_head_dim
        self.state_size = config.ssm_state_size
        self.chunk_size = config.chunk_size
        self.time_step_limit = config.time_step_limit
        dtype = config.dtype
        inner, conv_dim = config.mamba_inner_size, config.conv_dim
        self.in_proj = nn.Linear(
            config.hidden_size,
            inner + conv_dim + self.num_heads,
            bias=config.mamba_proj_bias,
            dtype=dtype,
        )
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, config.conv_kernel, dtype=dtype))
        self.conv_bias = (
            nn.Parameter(torch.zeros(conv_dim, dtype=dtype)) if config.use_conv_bias else None
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=dtype))
        self.D = nn.Parameter(torch.ones(self.num_heads, dtype=dtype))
        self.norm = GatedRMSNorm(inner, self.num_groups, config.norm_eps, dtype)
        self.out_proj = nn.Linear(
            inner, config.hidden_size, bias=config.mamba_proj_bias, dtype=dtype
        )
        self.input_copy: nn.Module = nn.Identity()
        """Applied to the mixer's input (tensor parallelism: identity forward, all-reduce of
        the gradient); identity else."""
        self.output_reduce: nn.Module = nn.Identity()
        """Applied to out_proj's output (tensor parallelism: all-reduce); identity else."""
        self._init_ssm_parameters(config)

    @torch.no_grad()
    def _init_ssm_parameters(self, config: HybridConfig) -> None:
        if self.A_log.device.type == "meta":
            return
        heads = self.num_heads
        self.A_log.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
        low, high = math.log(config.time_step_min), math.log(config.time_step_max)
        dt = torch.exp(torch.rand(heads) * (high - low) + low).clamp(min=config.time_step_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        bound = 1 / math.sqrt(config.conv_kernel)
        self.conv_weight.uniform_(-bound, bound)

    @property
    def inner_size(self) -> int:
        """This module's SSM channels (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """This module's convolution channels."""
        return self.inner_size + 2 * self.num_groups * self.state_size

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        state: MambaStepState | None = None,
    ) -> torch.Tensor:
        """Mix tokens.

        Args:
            hidden: ``[B, T, hidden]`` normalised hidden states.
            cu_seqlens: Boundaries of sequences packed in the single row (B = 1); the
                convolution and the scan restart at each. Default: each row is a sequence.
            state: Inference step state (B = 1); its ``cu_seqlens`` replace the argument.

        Returns:
            ``[B, T, hidden]`` output of out_proj (reduced over tensor-parallel ranks).
        """
        batch, seq_len, _ = hidden.shape
        tokens = batch * seq_len
        inner, heads, groups = self.inner_size, self.num_heads, self.num_groups
        projected = self.in_proj(self.input_copy(hidden)).reshape(tokens, -1)
        gate, xbc, dt = projected.split([inner, self.conv_dim, heads], dim=-1)
        if state is not None:
            cu_seqlens = state.cu_seqlens
        elif cu_seqlens is None:
            cu_seqlens = torch.arange(
                0, tokens + 1, seq_len, dtype=torch.int32, device=hidden.device
            )
        conv_state = state.conv_states[self.layer_idx] if state is not None else None
        ssm_state = state.ssm_states[self.layer_idx] if state is not None else None
        if state is not None and state.decode:
            assert conv_state is not None
            xbc = causal_conv1d_update(
                xbc, conv_state, self.conv_weight, self.conv_bias, state_indices=state.slot_indices
            )
        else:
            initial = (
                conv_state[state.slot_indices]
                if state is not None and conv_state is not None
                else None
            )
            xbc, conv_final = causal_conv1d(
                xbc,
                self.conv_weight,
                self.conv_bias,
                cu_seqlens=cu_seqlens,
                initial_states=initial,
            )
            if state is not None and conv_state is not None:
                conv_state.index_copy_(0, state.slot_indices, conv_final.to(conv_state.dtype))
        x, b, c = xbc.split([inner, groups * self.state_size, groups * self.state_size], dim=-1)
        x = x.reshape(tokens, heads, self.head_dim)
        b = b.reshape(tokens, groups, self.state_size)
        c = c.reshape(tokens, groups, self.state_size)
        low, high = self.time_step_limit
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=low, max=high)
        A = -torch.exp(self.A_log.float())
        if state is not None and state.decode:
            assert ssm_state is not None
            y = ssd_state_update(
                ssm_state, x, dt, A, b, c, self.D, state_indices=state.slot_indices
            )
        else:
            initial = (
                ssm_state[state.slot_indices]
                if state is not None and ssm_state is not None
                else None
            )
            y, ssm_final = ssd_scan(
                x,
                dt,
                A,
                b,
                c,
                self.D,
                chunk_size=self.chunk_size,
                cu_seqlens=cu_seqlens,
                initial_states=initial,
            )
            if state is not None and ssm_state is not None:
                ssm_state.index_copy_(0, state.slot_indices, ssm_final)
        y = self.norm(y.reshape(tokens, inner), gate)
        out = self.out_proj(y.to(hidden.dtype))
        return self.output_reduce(out).reshape(batch, seq_len, -1)
