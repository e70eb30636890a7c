"""The engine's fused forward of a whole dense ``GPTModel`` over its paged KV cache.

The model's own forward runs each projection as its own GEMM and RoPE, the cache write and
SwiGLU as a dozen small elementwise kernels per layer; at decode, where every kernel moves
little data, the launches dominate. :class:`FusedDecoder` computes the same layers with:

- one GEMM for q/k/v and one for gate/up, over concatenated weight copies that the decoder owns
  (the model's parameters, names and checkpoints are unchanged);
- RoPE, the key/value cache write and the query rotation in one kernel
  (:func:`mcore_kernels.rotary_kv_write.rotary_kv_write`);
- the fused residual-add + RMSNorm the model already uses, and the fused SwiGLU of
  :mod:`mcore_kernels.moe` (one kernel reading the gate/up GEMM output once).
- in steps of up to 256 tokens, the down projection as float32 split-K partial products (one
  batched GEMM) that the next add + RMSNorm sums (:mod:`mcore_kernels.split_sum_rms_norm`;
  :data:`DOWN_PROJ_SPLITS`): one launch fewer than cuBLAS's split-K GEMM and its reduction.
- in decode steps of more than 64 tokens, RoPE and the cache write inside the attention launch
  (:data:`ROTARY_IN_ATTENTION_MIN_ROWS`).
- the RMSNorm weights folded into weight copies (:data:`MLP_NORM_IN_WEIGHTS`, and past 256
  tokens :data:`QKV_NORM_IN_WEIGHTS`): the GEMM that ends a block adds the residual stream
  (``addmm_`` into the stream itself: :data:`RESIDUAL_ADD_IN_PLACE`), the next projection
  reads that sum, and the kernel after it applies the row's ``rstd``
  (:mod:`mcore_kernels.normed_swiglu`,
  :mod:`mcore_kernels.normed_rotary_kv_write`): no norm launch in those places.

Steps of at most ``gemv_max_rows`` tokens (decode at small batch) run every projection as
:func:`mcore_kernels.decode_gemv.decode_gemv` instead, a kernel that streams the weight at close
to the memory bandwidth where cuBLAS runs split-K GEMMs plus reductions, and that folds the
work around each projection in: the input RMSNorm into the q/k/v and gate/up projections, the
SwiGLU into the gate/up projection's epilogue (the down projection reads the activation) and
the residual add into the o and down projections' epilogues. A layer is then five launches
plus the attention (q/k/v, RoPE + cache write, attention, o, gate/up, down); the LM head of those
steps (:meth:`FusedDecoder.compute_logits`) is one more ``decode_gemv``. The projections named
in :data:`PACKED_GEMV` (gate/up and down of one-token bfloat16 steps) run as
:func:`mcore_kernels.packed_gemv.packed_gemv` instead, the same arithmetic with the weight
tiles held packed over the programmatic-dependent-launch wait. With RoPE and the
cache write in the q/k/v projection's epilogue and the attention's merge inside the o
projection (``attention_in_o_proj``), a layer of one or two tokens is five launches, and the
step's embeddings and RoPE rows are one gather launch. The values are those
of the unfused ops up to the order of the float32 sums (the same roundings to the activation
dtype happen at the same points), so they differ from cuBLAS's in the last bit at times.

The copies follow the model, always into the same buffers, so captured CUDA graphs, which
read them, stay valid: the engine copies every source weight again at each ``generate`` or
``stream`` call and after ``update_weights`` (:meth:`FusedDecoder.refresh_now`, one pass over
those weights), and at each ``step`` only when a parameter's version counter or address
changed since the last copy (:meth:`FusedDecoder.refresh`: optimizer steps, ``load_state_dict``,
offloading and reloading are seen; writes through ``param.data`` or in-place broadcasts are
not, they are picked up at the next ``generate``/``stream`` call or ``update_weights``).

Only whole, unsharded models with the stock decoder layers are fused (:func:`build_fused_decoder`
says why another is not); everything else runs the model's forward as before.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mcore_inference.kv_cache import PagedKVCache
from mcore_kernels._backend import use_triton
from mcore_kernels.batch_invariant import is_batch_invariant
from mcore_kernels.decode_attention_gemv import attention_o_proj
from mcore_kernels.decode_gemv import decode_gemv
from mcore_kernels.decode_rms_norm import decode_rms_norm
from mcore_kernels.gather_rows import gather_row_pairs
from mcore_kernels.moe.swiglu import swiglu
from mcore_kernels.normed_rotary_kv_write import normed_rotary_kv_write
from mcore_kernels.normed_swiglu import normed_swiglu
from mcore_kernels.packed_gemv import PackedGemvConfig, packed_gemv, packed_gemv_supports
from mcore_kernels.pdl import programmatic_dependent_launch
from mcore_kernels.rotary_kv_write import RotaryCacheWrite
from mcore_kernels.rotary_paged_attention import rotary_paged_attention
from mcore_kernels.skinny_gemm import SkinnyGemmConfig, skinny_gemm
from mcore_kernels.split_sum_rms_norm import split_k_partials, split_sum_add_rms_norm
from mcore_models.gpt.layer import Attention, DecoderLayer, add_rms_norm
from mcore_models.gpt.mlp import SwiGLUMLP

__all__ = [
    "DOWN_PROJ_SPLITS",
    "FINAL_NORM_IN_LM_HEAD",
    "FINAL_NORM_PDL",
    "GEMM_PDL_MAX_ROWS",
    "GEMV_MAX_ROWS",
    "LM_HEAD_GEMV_MAX_ROWS",
    "MLP_NORM_IN_WEIGHTS",
    "NORM_SWIGLU_PDL",
    "NORMED_SWIGLU_PDL",
    "O_PROJ_SPLITS",
    "PACKED_GEMV",
    "QKV_NORM_IN_WEIGHTS",
    "RESIDUAL_ADD_IN_PLACE",
    "ROTARY_IN_ATTENTION_MIN_ROWS",
    "SKINNY_GEMM",
    "SKINNY_GEMM_MAX_ROWS",
    "STEP_INPUTS_IN_ONE_LAUNCH",
    "FusedDecoder",
    "build_fused_decoder",
    "fused_decoder_unsupported_reason",
]

GEMV_MAX_ROWS = 2
"""Steps of at most this many tokens run the layers' projections as ``decode_gemv``.

Measured on one H100 (``bench_decode_gemv.py``): up to 2 rows the kernel's vector path beats
cuBLAS on every projection and the fused norms and epilogues save their launches; from 3 rows
on its tensor-core path only matches cuBLAS, and its norm prologue costs more than the norm
kernel it replaces."""
GEMM_PDL_MAX_ROWS = 64
"""Steps of more than ``gemv_max_rows`` and at most this many tokens launch their Triton kernels
(RoPE + cache write, attention) between the cuBLAS GEMMs with programmatic dependent launch too.
One H200, ``bench_decode.py``: 62.1k against 60.7k tok/s at batch 64, but 173.9k against 178.7k
at 256 and 236.6k against 244.9k at 512 (there the early-started kernels hold multiprocessors
that the GEMMs want)."""
LM_HEAD_GEMV_MAX_ROWS = 16
"""Steps of at most this many sampled rows run the LM head as ``decode_gemv``."""
_SAME_LAUNCH = contextlib.nullcontext()
ATTENTION_IN_O_PROJ = True
"""Default of ``FusedDecoder(attention_in_o_proj=)``."""
PACKED_GEMV: dict[str, tuple[PackedGemvConfig, int] | None] = {
    "gate_up": (PackedGemvConfig(block_n=8), 1),
    "down": (PackedGemvConfig(block_n=1), 1),
    "lm_head": None,
}
"""Per projection of ``decode_gemv`` steps of bfloat16 models (``gate_up`` with the norm and
SwiGLU, ``down`` with the residual add, ``lm_head``): ``(launch configuration, max rows)`` of
:func:`mcore_kernels.packed_gemv.packed_gemv`, whose programs keep their weight tiles packed
while they wait for the previous kernel (fewer registers: more programs have their weights in
flight before that kernel ends), or None for ``decode_gemv``.

One H200, Qwen2.5-0.5B shape (docs/benchmarks/inference.md, session 15): gate/up in 8-row
programs, captured batch-1 step 444.6-449.3 us against 487.0-493.9 with ``decode_gemv`` at a
context of 160, 453.7-454.4 against 494.0-495.0 at 288 (4-row programs 452.0-453.0 at 160); at
two rows slower (engine 2684 against 2786 tok/s: 168 registers a thread), hence one row. The
down projection packed (one row a program, 40 registers against 56) on top: 446.4 / 444.4
against 447.5 / 447.9 us at 160, 447.9 against 453.2 / 453.5 at 288. The LM head in packed
programs measured even in the step (451.7 against 452.0 us)."""
STEP_INPUTS_IN_ONE_LAUNCH = True
"""``decode_gemv`` steps gather the token embeddings and the RoPE rows of their positions in
one launch (under PDL: the first projection then requests its weights meanwhile). False: the
embedding and the RoPE table lookup as two torch ops."""
FINAL_NORM_PDL = True
"""``decode_gemv`` steps run the final RMSNorm as :func:`mcore_kernels.decode_rms_norm.
decode_rms_norm` (a PDL participant: under ``pdl`` the LM head starts streaming its weight
while the norm waits for the last layer). False: the model's norm module."""
FINAL_NORM_IN_LM_HEAD = False
""":meth:`FusedDecoder.logits` of ``decode_gemv`` steps runs the final RMSNorm in the LM head's
prologue (no norm launch). Off: each of the LM head's ~38k programs then reduces the row
before its products (one H200, the captured batch-1 step of the Qwen2.5-0.5B shape: the LM
head 87.8 us instead of about 74, the step 547.3-552.8 against 535.5 us)."""
DOWN_PROJ_SPLITS = (4, 256)
"""``(splits, max tokens)``: steps of more than ``gemv_max_rows`` and at most ``max tokens``
tokens run the down projection as ``splits`` float32 partial products (one batched GEMM,
:func:`mcore_kernels.split_sum_rms_norm.split_k_partials`) summed by the next add + RMSNorm
(:func:`mcore_kernels.split_sum_rms_norm.split_sum_add_rms_norm`): one kernel fewer than
cuBLAS's split-K GEMM, its reduction kernel and the norm. 0 splits: cuBLAS's own GEMM."""
O_PROJ_SPLITS = (0, 512)
"""``(splits, max tokens)`` of the o projection, as :data:`DOWN_PROJ_SPLITS` (the
post-attention add + RMSNorm sums the partials). 0 splits: cuBLAS's own GEMM."""
SPLIT_SUM_MAX_HIDDEN = 8192
"""Widest hidden size whose down projection may take the split-K path (one row per program)."""
RESIDUAL_ADD_IN_PLACE = True
"""The o and down projections that add the residual stream in their GEMM
(:data:`MLP_NORM_IN_WEIGHTS`, :data:`QKV_NORM_IN_WEIGHTS`) write the sum over the stream
(``addmm_``): ``torch.addmm`` into a new tensor first copies the stream there, one copy
launch per GEMM (one H200, the captured 512-row step of the Qwen2.5-0.5B shape: 48 copies,
79 us of a 1913 us step). The same GEMM and bits either way."""
NORM_SWIGLU_PDL = True
"""Whether steps launched with PDL (up to :data:`GEMM_PDL_MAX_ROWS` tokens) launch their add +
RMSNorm and SwiGLU kernels between the GEMMs with it too (the split-K sum + norm takes part;
the next ``skinny_gemm`` then requests its weights while it runs). Session 11, with cuBLAS
GEMMs around them: slower (one H200, batch 64, captured step at contexts near 288, 1143 us
against 1095). Session 14, with the :data:`SKINNY_GEMM` defaults: 857.4 against 873.4-874.4
us at context 160, and with the gate/up ``skinny_gemm`` too 828.4-829.1 (engine 75.0-75.2k
against 71.5-71.6k tok/s)."""

NORMED_SWIGLU_PDL = True
"""Whether the ``normed_swiglu`` kernel of the steps under :data:`NORM_SWIGLU_PDL` is launched
with PDL too (it takes part since session 15): it starts while the gate/up projection drains
and lets the down projection start likewise. One H200, Qwen2.5-0.5B shape, captured 64-row
step: 820.0-824.1 against 831.1-844.1 us at context 160 and 918.9-920.1 against 931.2-931.7 at
288 (rounds 0-1 of session 15; engine 74.7-76.1k against 72.1-75.0k tok/s in the same runs)."""

MLP_NORM_IN_WEIGHTS = True
"""Steps of more than ``gemv_max_rows`` tokens drop the post-attention add + RMSNorm launch:
the o projection adds the residual stream inside its GEMM (``torch.addmm``), the gate/up GEMM
reads that sum with the norm weight folded into a copy of its weight (``gate_up_folded``), and
the SwiGLU kernel scales each row by the norm's ``rstd``
(:func:`mcore_kernels.normed_swiglu.normed_swiglu`). Costs a second gate/up weight copy
(``2 * ffn * hidden`` elements a layer). Only for layers whose o projection has no bias."""

QKV_NORM_IN_WEIGHTS = True
"""Steps of more than ``gemv_max_rows`` tokens whose down projection is cuBLAS's own GEMM (past
``DOWN_PROJ_SPLITS``' token count) drop the input add + RMSNorm launch too: the down (and o)
projection adds the residual stream inside its GEMM, the q/k/v GEMM reads that sum with the
input norm weight folded into a copy of its weight (``qkv_folded``), and the RoPE + cache write
kernel finishes the projection (row scale, bias;
:func:`mcore_kernels.normed_rotary_kv_write.normed_rotary_kv_write`). Models without QK-norm
and without an o or down projection bias."""

SKINNY_GEMM_MAX_ROWS = 64
"""Steps of more than ``gemv_max_rows`` and at most this many tokens run the projections named
in :data:`SKINNY_GEMM` as :func:`mcore_kernels.skinny_gemm.skinny_gemm` instead of cuBLAS."""

_SKINNY_SMALL = (SkinnyGemmConfig(block_n=64, block_k=128, num_stages=4, prefetch=True), 1)
"""The q/k/v and o projections' tiles: 18 and 14 programs of 64 weight rows for the
Qwen2.5-0.5B shape, each requesting its weight slab into L2 before it waits under PDL."""

SKINNY_GEMM: dict[str, tuple[SkinnyGemmConfig, int] | None] = {
    "qkv": _SKINNY_SMALL,
    "qkv_rope": _SKINNY_SMALL,
    "o": _SKINNY_SMALL,
    "gate_up": (SkinnyGemmConfig(block_n=64, block_k=64, num_stages=4, prefetch=True), 1),
    "gate_up_swiglu": None,
    "down": None,
    "lm_head": None,
}
"""Per projection of the many-token layers (``qkv``, ``o``, ``gate_up``, ``down``): ``(tile
shape, splits)`` of :func:`~mcore_kernels.skinny_gemm.skinny_gemm` in steps of up to
:data:`SKINNY_GEMM_MAX_ROWS` tokens, or None for cuBLAS. ``splits`` counts only for ``down``
on the split-K path (its float32 partials go to the next add + RMSNorm). ``qkv_rope`` (models
without QK-norm; before ``qkv``): the q/k/v projection with RoPE and the cache write in its
epilogue, no ``rotary_kv_write`` launch. ``lm_head``: :meth:`FusedDecoder.compute_logits` of
more than ``lm_head_gemv_max_rows`` rows. ``gate_up_swiglu`` (before ``gate_up``; the
norm-folded MLP of :data:`MLP_NORM_IN_WEIGHTS`): the gate/up projection with the SwiGLU and
the norm's row scale in its epilogue, no ``normed_swiglu`` launch.

Defaults (one H200, Qwen2.5-0.5B shape, 64 rows, captured step at context 160, same run):
``qkv_rope`` and ``o`` 873.2 / 874.0 us against 1002.2 / 1005.6 for cuBLAS (the o
projection's residual in the epilogue also drops ``torch.addmm``'s copy of the residual,
1.1 us a layer; RoPE + the cache write drop ``rotary_kv_write``), ``qkv`` and ``o`` 920.6 /
920.1 (943.0 / 943.8 without the L2 prefetch); engine 71.5k against 61.6-62.5k tok/s. With
``gate_up`` in 64 x 64 tiles and :data:`NORM_SWIGLU_PDL` (the split-K sum + norm before the
q/k/v projection and the o projection before gate/up both let the next projection prefetch):
828.4 / 829.1 us, engine 75.0 / 75.2k tok/s (30.7 % of the roofline). The SwiGLU epilogue,
the down partials and the LM head measured slower than or even with cuBLAS there
(docs/benchmarks/inference.md, session 14)."""

ROTARY_IN_ATTENTION_MIN_ROWS = 65
"""Decode steps (``PagedKVCache.one_token_per_sequence``) of at least this many tokens (0:
none) whose contexts fit one attention split run RoPE and the cache write inside the attention
launch (:func:`mcore_kernels.rotary_paged_attention.rotary_paged_attention`: each program
finishes, rotates and stores its own heads, then attends) instead of ``rotary_kv_write`` /
``normed_rotary_kv_write`` and the paged attention: one launch fewer per layer. Never in steps
that prefill (their tokens read keys that other programs of the launch write). One H200,
Qwen2.5-0.5B shape, captured step at context 160 / 288: 1715.7 / 1943.2 against 1768.3 /
1991.1 us at 512 rows, 1250.5 / 1378.4 against 1311.7 / 1439.4 at 256."""


@dataclass(slots=True)
class _FusedLayer:
    """Concatenated projection weights of one decoder layer."""

    qkv_weight: torch.Tensor
    """``[(Hq + 2 Hkv) * D, hidden]``: the q, k then v projection weights."""
    qkv_bias: torch.Tensor | None
    """``[(Hq + 2 Hkv) * D]`` biases, None without QKV bias."""
    gate_up_weight: torch.Tensor
    """``[2 * ffn, hidden]``: the gate then the up projection weights."""
    split: tuple[int, int, int]
    """Output widths of q, k and v."""
    qkv_folded: torch.Tensor | None = None
    """``qkv_weight`` times the input norm weight (per input column), or None (see
    :data:`QKV_NORM_IN_WEIGHTS`)."""
    gate_up_folded: torch.Tensor | None = None
    """``gate_up_weight`` times the post-attention norm weight (per input column), or None
    (see :data:`MLP_NORM_IN_WEIGHTS`)."""


def _split_k_slices(setting: tuple[int, int], rows: int, projections: list[Any]) -> int:
    """Slices of a step's split-K projections: ``setting`` is ``(splits, max tokens)``; 0 when
    off, past ``max tokens``, or when a projection has a bias, inputs the slices do not divide,
    or outputs wider than :data:`SPLIT_SUM_MAX_HIDDEN` (the sum kernel holds a row in one
    program's registers)."""
    splits, max_rows = setting
    if not splits or rows > max_rows:
        return 0
    for projection in projections:
        outputs, inputs = projection.weight.shape
        if projection.bias is not None or inputs % splits or outputs > SPLIT_SUM_MAX_HIDDEN:
            return 0
    return splits


def fused_decoder_unsupported_reason(model: Any) -> str | None:
    """Why :class:`FusedDecoder` cannot serve ``model``, or None when it can.

    Args:
        model: The engine's model (or pipeline stage).

    Returns:
        A short reason, or None for a whole, unsharded ``GPTModel`` of stock dense decoder
        layers (QK-norm and QKV bias included).
    """
    if not (getattr(model, "pre_process", False) and getattr(model, "post_process", False)):
        return "not a whole model (a pipeline stage or another module)"
    if getattr(model, "tp_group", None) is not None:
        return "tensor-parallel model"
    if getattr(model, "context_parallel_size", 1) != 1:
        return "context-parallel model"
    if getattr(model, "sequence_parallel_size", 1) != 1:
        return "sequence-parallel model"
    if not isinstance(getattr(model, "embedding", None), torch.nn.Embedding):
        return "embedding is not a plain nn.Embedding"
    layers = getattr(model, "layers", None)
    if not layers:
        return "model has no decoder layers"
    for layer in layers:
        attention = getattr(layer, "self_attention", None)
        mlp = getattr(layer, "mlp", None)
        # Exact types: a subclass (another attention or block kind) may compute differently.
        if type(layer) is not DecoderLayer or type(attention) is not Attention:
            return f"layer {getattr(layer, 'layer_idx', '?')} is not a stock DecoderLayer"
        if type(mlp) is not SwiGLUMLP:
            return f"layer {layer.layer_idx} has a {type(mlp).__name__}, not a dense SwiGLUMLP"
        if attention.core_attention is not None:
            return f"layer {layer.layer_idx} replaces its core attention"
        projections = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)
        if any(type(p) is not torch.nn.Linear for p in (*projections, mlp.gate_proj, mlp.up_proj)):
            return f"layer {layer.layer_idx} has sharded or custom projections"
    return None


def _rotary_in_attention(kv_cache: PagedKVCache, rows: int, head_dim: int) -> bool:
    """Whether a step's RoPE and cache write run inside its attention
    (:data:`ROTARY_IN_ATTENTION_MIN_ROWS`): enough rows, a decode step (every sequence one
    token: ``PagedKVCache.one_token_per_sequence``), every context within one attention
    split (the step's table as wide as one split at most: then eager and captured steps of
    the same contexts both take this path), a power-of-two head dimension of at least 32,
    not the batch-invariant mode (its attention is the training kernel's)."""
    if not ROTARY_IN_ATTENTION_MIN_ROWS or rows < ROTARY_IN_ATTENTION_MIN_ROWS:
        return False
    if not getattr(kv_cache, "one_token_per_sequence", False):
        # A step that prefills: its tokens read keys other tokens of the launch write.
        return False
    if head_dim < 32 or head_dim & (head_dim - 1) or is_batch_invariant():
        return False
    tables, _ = kv_cache.step_tables()
    return tables.shape[1] * kv_cache.block_size <= kv_cache.split_size


def _add_product(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T`` by one cuBLAS GEMM (``beta=1``), into ``residual`` itself
    with :data:`RESIDUAL_ADD_IN_PLACE` (the layers never read the stream's previous value
    again), else into a new tensor."""
    if RESIDUAL_ADD_IN_PLACE:
        return residual.addmm_(x, weight.t())
    return torch.addmm(residual, x, weight.t())


class FusedDecoder:
    """Forward of a whole dense ``GPTModel`` over a :class:`PagedKVCache` with fused kernels.

    Same inputs and output as ``model(input_ids, position_ids, kv_cache=cache,
    return_hidden=True)``; the logits come from ``model.compute_logits`` as before.

    Args:
        model: A model for which :func:`fused_decoder_unsupported_reason` is None.
        gemv_max_rows: Steps of at most this many tokens run the projections as
            ``decode_gemv`` with the norms, SwiGLU and residual adds fused in (0: never;
            None: :data:`GEMV_MAX_ROWS`).
        lm_head_gemv_max_rows: :meth:`compute_logits` of at most this many rows runs the LM
            head as ``decode_gemv`` (0: never; None: :data:`LM_HEAD_GEMV_MAX_ROWS`).
        pdl: Launch the Triton kernels of a step (the ``decode_gemv`` projections, RoPE +
            cache write, attention; and the LM head of at most ``lm_head_gemv_max_rows`` rows)
            with programmatic dependent launch (:mod:`mcore_kernels.pdl`; Hopper or newer,
            ignored elsewhere): each starts, and the projections stream their weights, while
            the previous kernel finishes. Steps of more rows than ``gemv_max_rows`` too, up to
            :data:`GEMM_PDL_MAX_ROWS`.
        max_positions: Positions are below this (the engine's ``max_sequence_length``): the
            RoPE cosines and sines of every position are computed once and each step looks its
            rows up (one kernel instead of four, same values). None computes them per step.
        rope_in_projection: In the ``decode_gemv`` steps of a model without QK-norm, fold RoPE
            and the key/value cache write into the q/k/v projection's epilogue
            (``decode_gemv(..., rope=...)``): four launches per layer plus the attention.
        attention_in_o_proj: In those steps, run the attention in short splits (one tile of
            positions per program, whatever the context) and merge them inside the o
            projection (:func:`mcore_kernels.decode_attention_gemv.attention_o_proj`): still
            five launches per layer, but the attention link no longer walks the context tile
            by tile. Never in the batch-invariant mode. None: :data:`ATTENTION_IN_O_PROJ`.
    """

    def __init__(
        self,
        model: Any,
        *,
        gemv_max_rows: int | None = None,
        lm_head_gemv_max_rows: int | None = None,
        pdl: bool = False,
        max_positions: int | None = None,
        rope_in_projection: bool = True,
        attention_in_o_proj: bool | None = None,
    ) -> None:
        self.model = model
        self.rope_in_projection = rope_in_projection
        self.attention_in_o_proj = (
            ATTENTION_IN_O_PROJ if attention_in_o_proj is None else attention_in_o_proj
        )
        self.pdl = pdl
        self.max_positions = max_positions
        self._rope_table: torch.Tensor | None = None
        self.gemv_max_rows = GEMV_MAX_ROWS if gemv_max_rows is None else gemv_max_rows
        self.lm_head_gemv_max_rows = (
            LM_HEAD_GEMV_MAX_ROWS if lm_head_gemv_max_rows is None else lm_head_gemv_max_rows
        )
        self._layers: list[_FusedLayer] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        """``(target view in a fused buffer, source parameter)`` pairs."""
        self._folds: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """``(folded buffer, fused weight, norm weight)``: ``weight * norm`` per input column."""
        for layer in model.layers:
            attention, mlp = layer.self_attention, layer.mlp
            sources = (attention.q_proj, attention.k_proj, attention.v_proj)
            split = tuple(p.weight.shape[0] for p in sources)
            qkv_weight = self._fuse([p.weight for p in sources])
            qkv_bias = None
            if attention.q_proj.bias is not None:
                qkv_bias = self._fuse([p.bias for p in sources])
            gate_up_weight = self._fuse([mlp.gate_proj.weight, mlp.up_proj.weight])
            qkv_folded = folded = None
            no_bias = attention.o_proj.bias is None and mlp.down_proj.bias is None
            if QKV_NORM_IN_WEIGHTS and no_bias and attention.q_norm is None:
                qkv_folded = torch.empty_like(qkv_weight)
                self._folds.append((qkv_folded, qkv_weight, layer.input_norm.weight))
            if MLP_NORM_IN_WEIGHTS and attention.o_proj.bias is None:
                folded = torch.empty_like(gate_up_weight)
                self._folds.append((folded, gate_up_weight, layer.post_attention_norm.weight))
            fused = _FusedLayer(qkv_weight, qkv_bias, gate_up_weight, split, qkv_folded, folded)  # type: ignore[arg-type]
            self._layers.append(fused)
        self._fold_weights()
        self._signature = self._source_signature()

    def _fuse(self, parameters: list[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            buffer = torch.cat([p.detach() for p in parameters], dim=0)
        offset = 0
        for parameter in parameters:
            rows = parameter.shape[0]
            self._copies.append((buffer[offset : offset + rows], parameter))
            offset += rows
        return buffer

    def _source_signature(self) -> tuple[tuple[int, int], ...]:
        sources = [source for _, source in self._copies] + [norm for _, _, norm in self._folds]
        return tuple((source._version, source.data_ptr()) for source in sources)

    def _fold_weights(self) -> None:
        """Recompute the norm-folded weight copies from the fused ones (one rounding each)."""
        with torch.no_grad():
            for folded, weight, norm in self._folds:
                torch.mul(weight, norm.detach().to(weight.dtype), out=folded)

    @property
    def nbytes(self) -> int:
        """Device bytes of the fused weight copies (the norm-folded ones included)."""
        copies = sum(target.nbytes for target, _ in self._copies)
        return copies + sum(folded.nbytes for folded, _, _ in self._folds)

    def refresh(self) -> bool:
        """Copy the model's weights again if any changed since the last copy.

        Changes are seen through each parameter's version counter (every in-place update
        through autograd-visible ops bumps it) and its storage address; writes through
        ``param.data`` bypass the counter, so call :meth:`refresh_now` after those.

        Returns:
            True if the fused weights were copied.
        """
        signature = self._source_signature()
        if signature == self._signature:
            return False
        self.refresh_now()
        return True

    def refresh_now(self) -> None:
        """Copy every source weight into the fused buffers (same storages: graphs stay valid)."""
        with torch.no_grad():
            for target, source in self._copies:
                target.copy_(source)
        self._fold_weights()
        self._signature = self._source_signature()

    def __call__(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, *, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        """Run every layer and the final norm over the step's tokens.

        Args:
            input_ids: ``[1, T]`` token ids.
            position_ids: ``[1, T]`` positions.
            kv_cache: The engine's paged cache with the step's metadata installed.

        Returns:
            ``[1, T, hidden]`` final-normed hidden states (``return_hidden=True`` of the model).
        """
        return self._forward(input_ids, position_ids, kv_cache, final_norm=True)[None]

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: PagedKVCache,
        *,
        final_norm: bool,
    ) -> torch.Tensor:
        """``[T, hidden]``: final-normed, or (``final_norm=False``, ``decode_gemv`` steps only)
        the residual stream before the final norm."""
        model = self.model
        rows = input_ids.shape[1]
        with programmatic_dependent_launch(self.pdl and rows <= GEMM_PDL_MAX_ROWS):
            if rows <= self.gemv_max_rows:
                hidden, cos, sin = self._step_inputs(input_ids[0], position_ids[0])
                residual = self._gemv_layers(hidden, cos, sin, kv_cache)
                if not final_norm:
                    return residual
                norm = model.final_norm
                if FINAL_NORM_PDL:
                    return decode_rms_norm(residual, norm.weight, norm.eps)
                return norm(residual)
        hidden = model.embedding(input_ids[0])
        cos, sin = self._rotary(position_ids[0])
        with programmatic_dependent_launch(self.pdl and rows <= GEMM_PDL_MAX_ROWS):
            return self._gemm_layers(hidden, cos, sin, kv_cache)

    def _step_inputs(
        self, tokens: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The embeddings and the RoPE cosines and sines of a ``decode_gemv`` step: one
        :func:`~mcore_kernels.gather_rows.gather_row_pairs` launch where the RoPE table exists
        (:data:`STEP_INPUTS_IN_ONE_LAUNCH`), else the embedding and :meth:`_rotary`."""
        embedding = self.model.embedding
        if (
            STEP_INPUTS_IN_ONE_LAUNCH
            and self.max_positions is not None
            and embedding.max_norm is None
        ):
            table = self._rope_table
            if table is None or table.device != positions.device:
                self._rotary(positions[:0])
                table = self._rope_table
            assert table is not None
            hidden, rope = gather_row_pairs(embedding.weight, tokens, table.flatten(1), positions)
            rope = rope.view(-1, *table.shape[1:])
            return hidden, rope[:, 0], rope[:, 1]
        return embedding(tokens), *self._rotary(positions)

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        kv_cache: PagedKVCache,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's forward and the logits of its ``rows``: :meth:`__call__`, then
        :meth:`compute_logits` of those rows, except that steps whose projections and LM head
        both run as ``decode_gemv`` fold the final norm into the LM head's prologue
        (:data:`FINAL_NORM_IN_LM_HEAD`, off by default). The engine's eager and captured steps
        both come
        here, so they compute the same bits.

        Args:
            input_ids: ``[1, T]`` token ids.
            position_ids: ``[1, T]`` positions.
            kv_cache: The engine's paged cache with the step's metadata installed.
            rows: Indices of the rows whose logits are wanted (None: every row).

        Returns:
            ``[len(rows), vocab_size]`` logits (see :meth:`compute_logits`).
        """
        count = input_ids.shape[1] if rows is None else rows.shape[0]
        fold = (
            FINAL_NORM_IN_LM_HEAD
            and input_ids.shape[1] <= self.gemv_max_rows
            and count <= self.lm_head_gemv_max_rows
        )
        hidden = self._forward(input_ids, position_ids, kv_cache, final_norm=not fold)
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        if not fold:
            return self.compute_logits(hidden)
        norm = self.model.final_norm
        with programmatic_dependent_launch(self.pdl):
            return decode_gemv(
                hidden, self.model.output_weight(), norm_weight=norm.weight, norm_eps=norm.eps
            )

    def _gemm_layers(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        """The layers over many tokens: cuBLAS projections between fused norm, RoPE + cache
        write, attention and SwiGLU kernels (under PDL, the Triton ones among them start while
        the kernel before them drains; cuBLAS's are launched plainly).

        ``residual`` is the residual stream. With :data:`QKV_NORM_IN_WEIGHTS` (steps whose
        down projection is cuBLAS's own GEMM) every GEMM that ends a block adds it in place
        (``addmm_``, :data:`RESIDUAL_ADD_IN_PLACE`) and the input norm lives in the q/k/v
        weight copy and the RoPE kernel: no norm launch before the q/k/v projection."""
        model = self.model
        residual: torch.Tensor | None = None
        layers = list(zip(model.layers, self._layers, strict=True))
        splits = self._down_splits(hidden.shape[0])
        o_splits = self._o_splits(hidden.shape[0])
        fold_qkv = not splits and all(fused.qkv_folded is not None for _, fused in layers)
        normed: tuple[torch.Tensor, torch.Tensor] | None = None
        for index, (layer, fused) in enumerate(layers):
            attention = layer.self_attention
            if fold_qkv:
                residual = hidden if residual is None else residual
                out = self._folded_qkv_attention(layer, fused, residual, cos, sin, kv_cache)
            else:
                if normed is not None:
                    # The previous layer's down projection already added and normed its output.
                    (x, residual), normed = normed, None
                else:
                    with self._norm_swiglu_launch():
                        x, residual = add_rms_norm(layer.input_norm, hidden, residual)
                rope_setting = self._skinny("qkv_rope", x)
                head_dim = attention.head_dim
                if (
                    rope_setting is not None
                    and attention.q_norm is None
                    and head_dim >= 32
                    and head_dim & (head_dim - 1) == 0
                ):
                    out = self._skinny_qkv_attention(
                        layer, fused, x, cos, sin, kv_cache, rope_setting[0]
                    )
                else:
                    qkv = self._linear("qkv", x, fused.qkv_weight, fused.qkv_bias)
                    if attention.q_norm is None and _rotary_in_attention(
                        kv_cache, qkv.shape[0], head_dim
                    ):
                        keys, values, slots = kv_cache.layer_write_target(layer.layer_idx)
                        tables, lengths = kv_cache.step_tables()
                        out = rotary_paged_attention(
                            qkv,
                            cos,
                            sin,
                            keys,
                            values,
                            slots,
                            tables,
                            lengths,
                            num_q_heads=fused.split[0] // head_dim,
                            scale=attention.scale,
                        )
                    else:
                        out = self._attend_qkv(layer, fused, qkv, cos, sin, kv_cache)
            norm = layer.post_attention_norm
            if fused.gate_up_folded is not None and not o_splits and residual is not None:
                # The residual add in the o projection's GEMM, the norm in the gate/up weight
                # and the SwiGLU's row scale (MLP_NORM_IN_WEIGHTS): no norm launch.
                residual = self._linear(
                    "o", out.flatten(-2), attention.o_proj.weight, residual=residual
                )
                swiglu_setting = self._skinny("gate_up_swiglu", residual)
                if swiglu_setting is not None:
                    # The SwiGLU and the norm's row scale in the GEMM's epilogue: one launch.
                    activation = skinny_gemm(
                        residual,
                        fused.gate_up_folded,
                        swiglu_norm_eps=norm.eps,
                        config=swiglu_setting[0],
                    )
                else:
                    gate_up = self._linear("gate_up", residual, fused.gate_up_folded)
                    with self._norm_swiglu_launch(NORMED_SWIGLU_PDL):
                        activation = normed_swiglu(gate_up, residual, norm.eps)
            else:
                if o_splits and residual is not None:
                    partials = split_k_partials(out.flatten(-2), attention.o_proj.weight, o_splits)
                    with self._norm_swiglu_launch():
                        x, residual = split_sum_add_rms_norm(
                            partials, residual, norm.weight, norm.eps
                        )
                else:
                    attention_out = attention.o_proj(out.flatten(-2))
                    with self._norm_swiglu_launch():
                        x, residual = add_rms_norm(norm, attention_out, residual)
                gate_up = F.linear(x, fused.gate_up_weight)
                with self._norm_swiglu_launch():
                    activation = swiglu(gate_up)
            assert residual is not None
            if splits:
                norm = layers[index + 1][0].input_norm if index + 1 < len(layers) else None
                norm = model.final_norm if norm is None else norm
                partials = self._down_partials(activation, layer.mlp.down_proj.weight, splits)
                with self._norm_swiglu_launch():
                    normed = split_sum_add_rms_norm(partials, residual, norm.weight, norm.eps)
            elif fold_qkv:
                residual = _add_product(residual, activation, layer.mlp.down_proj.weight)
            else:
                hidden = layer.mlp.down_proj(activation)
        if normed is not None:
            return normed[0]
        with self._norm_swiglu_launch():
            if fold_qkv:
                return model.final_norm(residual)
            hidden, _ = add_rms_norm(model.final_norm, hidden, residual)
        return hidden

    @staticmethod
    def one_token_per_sequence_matters(rows: int) -> bool:
        """Whether steps of ``rows`` tokens compute differently when every sequence feeds one
        token (:data:`ROTARY_IN_ATTENTION_MIN_ROWS`): CUDA graphs then keep decode steps apart
        from steps that prefill.

        Args:
            rows: Tokens of the step.

        Returns:
            True where decode steps of that size may take the rotary-in-attention path.
        """
        return bool(ROTARY_IN_ATTENTION_MIN_ROWS) and rows >= ROTARY_IN_ATTENTION_MIN_ROWS

    def _skinny(self, name: str, x: torch.Tensor) -> tuple[SkinnyGemmConfig, int] | None:
        """The :data:`SKINNY_GEMM` setting of projection ``name`` for a step's input ``x``:
        None past the row bounds, in the batch-invariant mode, or, where the Triton kernel
        would run (a GPU, or ``MCORE_KERNELS_BACKEND=triton`` under the interpreter), for inputs
        it does not take (a dtype other than bf16/fp16, inputs not a multiple of 8)."""
        rows, inputs = x.shape
        if rows <= self.gemv_max_rows or rows > SKINNY_GEMM_MAX_ROWS or is_batch_invariant():
            # The batch-invariant mode keeps its own GEMMs (the same bits at every row count).
            return None
        if (x.dtype not in (torch.bfloat16, torch.float16) or inputs % 8) and use_triton(x):
            return None
        return SKINNY_GEMM.get(name)

    def _linear(
        self,
        name: str,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``residual + x @ weight.T + bias`` by cuBLAS or :func:`skinny_gemm` (:data:`SKINNY_GEMM`)."""
        setting = self._skinny(name, x)
        if setting is not None:
            return skinny_gemm(x, weight, bias=bias, residual=residual, config=setting[0])
        if residual is not None:
            out = _add_product(residual, x, weight)
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)

    @staticmethod
    def _skinny_qkv_attention(
        layer: Any,
        fused: _FusedLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
        config: SkinnyGemmConfig,
    ) -> torch.Tensor:
        """The q/k/v projection with RoPE and the cache write in its epilogue
        (:func:`skinny_gemm` with ``rope=``), then the attention of the stored keys."""
        attention = layer.self_attention
        keys, values, slots = kv_cache.layer_write_target(layer.layer_idx)
        rope = RotaryCacheWrite(
            cos=cos,
            sin=sin,
            k_cache=keys,
            v_cache=values,
            slot_mapping=slots,
            num_q_heads=fused.split[0] // attention.head_dim,
        )
        q = skinny_gemm(x, fused.qkv_weight, bias=fused.qkv_bias, rope=rope, config=config)
        return kv_cache.attend_stored_keys(
            layer.layer_idx, q.unflatten(-1, (-1, attention.head_dim)), scale=attention.scale
        )

    def _down_partials(self, x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
        """float32 split-K partials of the down projection (cuBLAS's batched GEMM, or
        :func:`skinny_gemm` with its own split count)."""
        setting = self._skinny("down", x)
        if setting is not None:
            return skinny_gemm(x, weight, splits=setting[1], config=setting[0])
        return split_k_partials(x, weight, splits)

    @staticmethod
    def _folded_qkv_attention(
        layer: Any,
        fused: _FusedLayer,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: PagedKVCache,
    ) -> torch.Tensor:
        """The q/k/v projection of the un-normalised stream with the input norm folded into
        the weight, finished (row scale, bias), rotated and written to the cache by one
        kernel, then the attention (:data:`QKV_NORM_IN_WEIGHTS`)."""
        attention = layer.self_attention
        assert fused.qkv_folded is not None
        qkv = F.linear(residual, fused.qkv_folded)
        keys, values, slots = kv_cache.layer_write_target(layer.layer_idx)
        norm = layer.input_norm
        if _rotary_in_attention(kv_cache, qkv.shape[0], attention.head_dim):
            tables, lengths = kv_cache.step_tables()
            return rotary_paged_attention(
                qkv,
                cos,
                sin,
                keys,
                values,
                slots,
                tables,
                lengths,
                num_q_heads=fused.split[0] // attention.head_dim,
                scale=attention.scale,
                norm_input=(residual, norm.eps),
                bias=fused.qkv_bias,
            )
        q = normed_rotary_kv_write(
            qkv,
            residual,
            norm.eps,
            fused.qkv_bias,
            cos,
            sin,
            keys,
            values,
            slots,
            fused.split[0] // attention.head_dim,
        )
        return kv_cache.attend_stored_keys(layer.layer_idx, q, scale=attention.scale)

    def _o_splits(self, rows: int) -> int:
        """Split-K slices of this step's o projections (0: cuBLAS's own GEMM)."""
        projections = [layer.self_attention.o_proj for layer in self.model.layers]
        return _split_k_slices(O_PROJ_SPLITS, rows, projections)

    def _down_splits(self, rows: int) -> int:
        """Split-K slices of this step's down projections (0: cuBLAS's own GEMM)."""
        projections = [layer.mlp.down_proj for layer in self.model.layers]
        return _split_k_slices(DOWN_PROJ_SPLITS, rows, projections)

    @staticmethod
    def _norm_swiglu_launch(enabled: bool = True) -> contextlib.AbstractContextManager:
        """The launch setting of the add + RMSNorm and SwiGLU kernels (:data:`NORM_SWIGLU_PDL`;
        ``enabled=False``: plain launches whatever it says)."""
        if NORM_SWIGLU_PDL and enabled:
            return _SAME_LAUNCH
        return programmatic_dependent_launch(False)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``model.rotary(positions)``, looked up in a table of every position when bounded."""
        if self.max_positions is None:
            return self.model.rotary(positions)
        table = self._rope_table
        if table is None or table.device != positions.device:
            # Elementwise ops: each position's values are those computed for it alone.
            every = torch.arange(self.max_positions, device=positions.device)
            cos, sin = self.model.rotary(every)
            table = self._rope_table = torch.stack((cos, sin), dim=1)
        rows = table.index_select(0, positions)
        return rows[:, 0], rows[:, 1]

    def _gemv_layers(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        """The layers over a few tokens: every projection one ``decode_gemv`` launch; returns
        the residual stream before the final norm.

        ``residual`` is the residual stream (the embedding, then after each block the block's
        output plus the stream, added in the projection's epilogue); the RMSNorm before each
        block runs in the next projection's prologue.
        """
        model = self.model
        residual = hidden
        layers = list(zip(model.layers, self._layers, strict=True))
        in_o_proj = self._attention_in_o_proj()
        for layer, fused in layers:
            attention = layer.self_attention
            if self.rope_in_projection and attention.q_norm is None:
                # RoPE and the cache write in the projection's epilogue: one launch fewer.
                keys, values, slots = kv_cache.layer_write_target(layer.layer_idx)
                rope = RotaryCacheWrite(
                    cos=cos,
                    sin=sin,
                    k_cache=keys,
                    v_cache=values,
                    slot_mapping=slots,
                    num_q_heads=fused.split[0] // attention.head_dim,
                )
                q = decode_gemv(
                    residual,
                    fused.qkv_weight,
                    fused.qkv_bias,
                    norm_weight=layer.input_norm.weight,
                    norm_eps=layer.input_norm.eps,
                    rope=rope,
                )
                if in_o_proj:
                    residual = self._attention_o_proj(
                        attention, q, keys, values, kv_cache, residual
                    )
                    residual = self._mlp(layer, fused, residual)
                    continue
                out = kv_cache.attend_stored_keys(
                    layer.layer_idx,
                    q.unflatten(-1, (-1, attention.head_dim)),
                    scale=attention.scale,
                )
            else:
                qkv = decode_gemv(
                    residual,
                    fused.qkv_weight,
                    fused.qkv_bias,
                    norm_weight=layer.input_norm.weight,
                    norm_eps=layer.input_norm.eps,
                )
                out = self._attend_qkv(layer, fused, qkv, cos, sin, kv_cache)
            residual = decode_gemv(
                out.flatten(-2),
                attention.o_proj.weight,
                attention.o_proj.bias,
                residual=residual,
            )
            residual = self._mlp(layer, fused, residual)
        return residual

    @staticmethod
    def _attend_qkv(
        layer: Any,
        fused: _FusedLayer,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: Any,
    ) -> torch.Tensor:
        """Split a q/k/v projection into heads, apply the q/k norms if any, RoPE, store, attend."""
        attention = layer.self_attention
        q, k, v = (
            part.unflatten(-1, (-1, attention.head_dim)) for part in qkv.split(fused.split, dim=-1)
        )
        if attention.q_norm is not None and attention.k_norm is not None:
            q, k = attention.q_norm(q), attention.k_norm(k)
        return kv_cache.attend_rotary(layer.layer_idx, q, k, v, cos, sin, scale=attention.scale)

    @staticmethod
    def _mlp(layer: Any, fused: _FusedLayer, residual: torch.Tensor) -> torch.Tensor:
        """Post-attention norm, gate/up with SwiGLU, down and the residual add: two launches."""
        norm = layer.post_attention_norm
        activation = _gemv(
            "gate_up",
            residual,
            fused.gate_up_weight,
            norm_weight=norm.weight,
            norm_eps=norm.eps,
            swiglu=True,
        )
        return _gemv("down", activation, layer.mlp.down_proj.weight, residual=residual)

    def _attention_in_o_proj(self) -> bool:
        """Whether this ``decode_gemv`` step merges its attention inside the o projection.

        Every such step does (eager or captured, whatever the table width: the merge reads
        only the splits that hold a context), so graph and eager steps compute the same bits;
        never in the batch-invariant mode, whose attention is the training kernel's.
        """
        return self.attention_in_o_proj and self.rope_in_projection and not is_batch_invariant()

    @staticmethod
    def _attention_o_proj(
        attention: Any,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        kv_cache: PagedKVCache,
        residual: torch.Tensor,
    ) -> torch.Tensor:
        """The attention of the rotated queries ``q`` and the o projection: the split kernel
        and the projection that merges the splits."""
        tables, lengths = kv_cache.step_tables()
        return attention_o_proj(
            q.unflatten(-1, (-1, attention.head_dim)),
            keys,
            values,
            tables,
            lengths,
            attention.o_proj.weight,
            attention.o_proj.bias,
            scale=attention.scale,
            residual=residual,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final-normed hidden states in the model's dtype (``upcast=False``).

        The engine's sampler reads them as they are: the argmax of greedy rows is that of the
        float32 upcast, sampled rows are upcast first, and the log-probs are computed from the
        logits in the model's dtype anyway. Not upcasting saves a float32 copy of
        ``[rows, vocab_size]`` (written and read again) per step: at 512 rows of a 152k
        vocabulary, 311 MB.

        Args:
            hidden: ``[rows, hidden]`` output of this decoder.

        Returns:
            ``[rows, vocab_size]`` logits in the dtype of the output weight; at most
            ``lm_head_gemv_max_rows`` rows run the LM head as one ``decode_gemv``.
        """
        model = self.model
        if hidden.dim() != 2 or hidden.shape[0] > self.lm_head_gemv_max_rows:
            setting = self._skinny("lm_head", hidden) if hidden.dim() == 2 else None
            if setting is not None:
                weight = model.output_weight()
                return skinny_gemm(model.logits_input(hidden), weight, config=setting[0])
            return model.compute_logits(hidden, upcast=False)
        with programmatic_dependent_launch(self.pdl):
            return _gemv("lm_head", hidden, model.output_weight())


def _gemv(
    name: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """A bias-free projection of a ``decode_gemv`` step: :func:`packed_gemv` where
    :data:`PACKED_GEMV` names a setting for ``name``, the step has at most its rows and the
    kernel takes the operands (bfloat16; not in the batch-invariant mode), else
    ``decode_gemv``."""
    setting = PACKED_GEMV.get(name)
    if (
        setting is not None
        and x.shape[0] <= setting[1]
        and not is_batch_invariant()
        and packed_gemv_supports(x, weight)
    ):
        return packed_gemv(
            x,
            weight,
            norm_weight=norm_weight,
            norm_eps=norm_eps,
            swiglu=swiglu,
            residual=residual,
            config=setting[0],
        )
    return decode_gemv(
        x, weight, norm_weight=norm_weight, norm_eps=norm_eps, swiglu=swiglu, residual=residual
    )


def build_fused_decoder(
    model: Any,
    enabled: bool,
    *,
    pdl: bool = False,
    max_positions: int | None = None,
) -> FusedDecoder | None:
    """The engine's fused decoder for ``model``, or None where it does not apply.

    Args:
        model: The engine's model.
        enabled: ``InferenceConfig.fused_decode``.
        pdl: ``InferenceConfig.decode_pdl`` (see :class:`FusedDecoder`).
        max_positions: ``InferenceConfig.max_sequence_length`` (see :class:`FusedDecoder`).

    Returns:
        A :class:`FusedDecoder`, or None when disabled or unsupported (the model's own
        forward then runs).
    """
    if not enabled or fused_decoder_unsupported_reason(model) is not None:
        return None
    return FusedDecoder(
        model,
        pdl=pdl,
        max_positions=max_positions,
    )
