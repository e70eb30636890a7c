"""Triton kernel of :func:`mcore_kernels.decode_model.decode_model`: every decoder layer of a
decode step in one persistent launch.

The phases of :mod:`mcore_kernels.decode_layer_kernel` (attention, o, gate/up, down, the next
layer's q/k/v) run layer after layer, separated by grid barriers; the weights of each layer
are read through a table of device addresses (one row per layer), the key/value caches are one
stacked tensor. Every intermediate (queries, attention partials, residual stream, activation)
has one slice per layer, so no program can read a value cached in its L1 from an earlier
layer. The next layer's weights are requested into L2 while the current layer runs.
"""

from __future__ import annotations

from mcore_kernels._triton_utils import CachedLauncher, gdc_launch_dependents, gdc_wait, jit, tl
from mcore_kernels.decode_layer_attention import _attention_phase
from mcore_kernels.decode_layer_kernel import (
    _grid_barrier,
    _merged_o_phase,
    _prefetch_share,
    _projection_phase,
)

O_W, O_B, POST_NORM, GATE_UP, DOWN, QKV_W, QKV_B, IN_NORM = range(8)
"""Columns of the weight address table (the q/k/v columns hold the *next* layer's)."""


@jit
def _address(table_ptr, layer, column: tl.constexpr, DTYPE: tl.constexpr):
    """The weight pointer at ``table[layer, column]``."""
    return tl.load(table_ptr + layer * 8 + column).to(tl.pointer_type(DTYPE))


@jit
def _prefetch_layer(table_ptr, layer, pid, programs, o_bytes, gate_up_bytes, down_bytes,
                    qkv_bytes, FIRST: tl.constexpr, SECOND: tl.constexpr, NEXT,
                    DTYPE: tl.constexpr, CHUNK: tl.constexpr,
                    THREADS: tl.constexpr):  # fmt: skip
    """Request a layer's o and gate/up weights (``FIRST``) and down and next q/k/v (``SECOND``)."""
    if FIRST:
        _prefetch_share(
            _address(table_ptr, layer, 0, DTYPE), o_bytes, pid, programs, CHUNK, THREADS
        )
        _prefetch_share(
            _address(table_ptr, layer, 3, DTYPE), gate_up_bytes, pid, programs, CHUNK, THREADS
        )
    if SECOND:
        _prefetch_share(
            _address(table_ptr, layer, 4, DTYPE), down_bytes, pid, programs, CHUNK, THREADS
        )
        if NEXT:
            _prefetch_share(
                _address(table_ptr, layer, 5, DTYPE), qkv_bytes, pid, programs, CHUNK, THREADS
            )


@jit(do_not_specialize=("M", "num_splits", "stride_table"))
def _decode_model_kernel(
    q0_ptr, res0_ptr, weights_ptr, NUM_LAYERS,
    h_ptr, act_ptr, out_ptr, q_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    k_ptr, v_ptr, layer_stride_k, layer_stride_v,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    table_ptr, lens_ptr, stride_table, num_splits, scale,
    cos_ptr, sin_ptr, slot_ptr, stride_cos, stride_sin,
    post_eps, in_eps, counter_ptr, M, ATTN, HIDDEN, FFN, PAIRS, NUM_Q_HEADS, NUM_KV_HEADS,
    o_bytes, gate_up_bytes, down_bytes, qkv_bytes,
    O_BIAS: tl.constexpr, QKV_BIAS: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
    BN_O: tl.constexpr, BK_O: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr,
    BN_D: tl.constexpr, BK_D: tl.constexpr, BN_QKV: tl.constexpr, BK_QKV: tl.constexpr,
    USE_PDL: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    CHUNK: tl.constexpr, PREFETCH: tl.constexpr, PREFETCH_CHUNK: tl.constexpr,
    SLEEP: tl.constexpr, THREADS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = res0_ptr.dtype.element_ty
    if USE_PDL:
        gdc_launch_dependents()
    if PREFETCH:
        _prefetch_layer(
            weights_ptr, 0, pid, programs, o_bytes, gate_up_bytes, down_bytes, qkv_bytes,
            True, True, NUM_LAYERS > 1, dtype, PREFETCH_CHUNK, THREADS,
        )  # fmt: skip
    if USE_PDL:
        gdc_wait()
    partial_rows = M * NUM_Q_HEADS * num_splits
    arrivals = 0
    for layer in range(NUM_LAYERS):
        nxt = layer + 1 < NUM_LAYERS
        if layer == 0:
            q_in = q0_ptr
            res_in = res0_ptr
        else:
            # Every program's q/k/v of the previous layer (and its cache writes) is done.
            arrivals += 1
            _grid_barrier(counter_ptr, arrivals * programs, SLEEP)
            q_in = q_ptr + (layer - 1) * M * ATTN
            res_in = out_ptr + (layer - 1) * M * HIDDEN
            if PREFETCH:
                _prefetch_layer(
                    weights_ptr, layer, pid, programs, o_bytes, gate_up_bytes, down_bytes,
                    qkv_bytes, False, True, nxt, dtype, PREFETCH_CHUNK, THREADS,
                )  # fmt: skip
        acc_ptr = part_acc_ptr + layer * partial_rows * HEAD_DIM
        max_ptr = part_max_ptr + layer * partial_rows
        sum_ptr = part_sum_ptr + layer * partial_rows
        _attention_phase(
            q_in, k_ptr + layer * layer_stride_k, v_ptr + layer * layer_stride_v, table_ptr,
            lens_ptr, acc_ptr, max_ptr, sum_ptr, scale, M, num_splits, stride_table,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, NUM_Q_HEADS,
            NUM_KV_HEADS, pid, programs, GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, SPLIT,
        )  # fmt: skip
        h_layer = h_ptr + layer * M * HIDDEN
        act_layer = act_ptr + layer * M * FFN
        out_layer = out_ptr + layer * M * HIDDEN
        post_norm = _address(weights_ptr, layer, 2, dtype)
        arrivals += 1
        _merged_o_phase(
            acc_ptr, max_ptr, sum_ptr, lens_ptr, _address(weights_ptr, layer, 0, dtype),
            _address(weights_ptr, layer, 1, dtype), res_in, h_layer,
            M, HIDDEN, ATTN, num_splits, NUM_Q_HEADS, ATTN, HIDDEN, HIDDEN,
            counter_ptr, arrivals * programs, pid, programs,
            O_BIAS, HEAD_DIM, SPLIT, BLOCK_M, BN_O, BK_O, CHUNK, SLEEP,
        )  # fmt: skip
        arrivals += 1
        _projection_phase(
            h_layer, _address(weights_ptr, layer, 3, dtype), post_norm, post_norm, res_in,
            act_layer, post_eps, M, FFN, HIDDEN, HIDDEN, HIDDEN, HIDDEN, FFN,
            cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, stride_cos, stride_sin,
            stride_ks, stride_kh, stride_vs, stride_vh, NUM_Q_HEADS, NUM_KV_HEADS,
            counter_ptr, arrivals * programs, pid, programs,
            False, True, False, True, False, HALF, BLOCK_M, BN_GU, BK_GU, 2, SLEEP,
        )  # fmt: skip
        if PREFETCH:  # noqa: SIM102 (a constexpr, then a runtime condition)
            if nxt:
                _prefetch_layer(
                    weights_ptr, layer + 1, pid, programs, o_bytes, gate_up_bytes, down_bytes,
                    qkv_bytes, True, False, False, dtype, PREFETCH_CHUNK, THREADS,
                )  # fmt: skip
        arrivals += 1
        _projection_phase(
            act_layer, _address(weights_ptr, layer, 4, dtype), post_norm, post_norm, h_layer,
            out_layer, post_eps, M, HIDDEN, FFN, FFN, FFN, HIDDEN, HIDDEN,
            cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, stride_cos, stride_sin,
            stride_ks, stride_kh, stride_vs, stride_vh, NUM_Q_HEADS, NUM_KV_HEADS,
            counter_ptr, arrivals * programs, pid, programs,
            False, False, True, False, False, HALF, BLOCK_M, BN_D, BK_D, 2, SLEEP,
        )  # fmt: skip
        if nxt:
            arrivals += 1
            _projection_phase(
                out_layer, _address(weights_ptr, layer, 5, dtype),
                _address(weights_ptr, layer, 6, dtype), _address(weights_ptr, layer, 7, dtype),
                res_in, q_ptr + layer * M * ATTN, in_eps,
                M, PAIRS, HIDDEN, HIDDEN, HIDDEN, HIDDEN, NUM_Q_HEADS * 2 * HALF,
                cos_ptr, sin_ptr, slot_ptr, k_ptr + (layer + 1) * layer_stride_k,
                v_ptr + (layer + 1) * layer_stride_v, stride_cos, stride_sin,
                stride_ks, stride_kh, stride_vs, stride_vh, NUM_Q_HEADS, NUM_KV_HEADS,
                counter_ptr, arrivals * programs, pid, programs,
                QKV_BIAS, True, False, False, True, HALF, BLOCK_M, BN_QKV, BK_QKV, 2, SLEEP,
            )  # fmt: skip
    done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == programs - 1:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")


_MODEL = CachedLauncher(_decode_model_kernel)
_MODEL_PDL = CachedLauncher(_decode_model_kernel, launch_pdl=True)
