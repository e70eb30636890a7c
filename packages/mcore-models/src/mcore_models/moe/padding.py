"""Switch MoE layers between dropless routing and fixed-shape drop-and-pad for decode.

CUDA graphs replay fixed shapes and cannot follow the host-side split sizes of dropless
routing, so the inference engine turns decode expert padding on around graph-captured decode
steps and off for prefill and training. The switch only sets plain attributes of the MoE
layers (the module tree is never changed) and restores them exactly on exit.
"""

from __future__ import annotations

from types import TracebackType

from torch import nn

from mcore_models.moe.config import check_capacity_factor
from mcore_models.moe.layer import MoELayer

__all__ = ["DecodeExpertPadding", "moe_layers", "set_decode_expert_padding"]


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers of a model, in module order.

    Args:
        model: Any module (a wrapper such as DDP works too).

    Returns:
        Every :class:`~mcore_models.moe.layer.MoELayer` inside ``model``.
    """
    return [module for module in model.modules() if isinstance(module, MoELayer)]


class DecodeExpertPadding:
    """Handle returned by :func:`set_decode_expert_padding`; a context manager that restores.

    The change is applied when the handle is created. Leaving the ``with`` block (also on an
    exception) or calling :meth:`restore` puts back every layer's previous mode and capacity
    factor and clears the routing metadata again.

    Args:
        layers: The MoE layers to switch.
        enabled: Whether padding is turned on.
        capacity_factor: Capacity factor while padded, or None for each layer's default.
    """

    def __init__(
        self, layers: list[MoELayer], enabled: bool, capacity_factor: float | None
    ) -> None:
        self._previous = [
            (layer, layer.decode_padding, layer.decode_capacity_factor) for layer in layers
        ]
        self._restored = False
        for layer in layers:
            layer.decode_padding = enabled
            layer.decode_capacity_factor = (
                capacity_factor
                if capacity_factor is not None
                else layer.moe_config.default_decode_capacity_factor
            )
            layer.tokens_per_expert = None

    def restore(self) -> None:
        """Put back the state from before the switch (idempotent)."""
        if self._restored:
            return
        self._restored = True
        for layer, padding, factor in self._previous:
            layer.decode_padding = padding
            layer.decode_capacity_factor = factor
            layer.tokens_per_expert = None

    def __enter__(self) -> DecodeExpertPadding:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()


def set_decode_expert_padding(
    model: nn.Module, enabled: bool, capacity_factor: float | None = None
) -> DecodeExpertPadding:
    """Turn fixed-shape drop-and-pad routing on (decode) or off (dropless) in every MoE layer.

    With padding on, each expert gets ``ceil(T * top_k / num_experts * capacity_factor)``
    slots per rank; the default factor ``num_experts / top_k`` gives every expert room for
    every token, so nothing is dropped and outputs equal dropless routing. The variable-size
    routing metadata of the previous mode (``tokens_per_expert``) is cleared. Use the result
    as a context manager to restore the previous mode on exit, also on exceptions::

        with set_decode_expert_padding(model, True):
            run_graph_captured_decode()

    A model without MoE layers is left untouched.

    Args:
        model: The model (or any module containing MoE layers).
        enabled: True for drop-and-pad, False for dropless.
        capacity_factor: Capacity factor while padded; None means each layer's
            ``MoEConfig.decode_capacity_factor`` (default ``num_experts / top_k``).

    Returns:
        A handle whose exit (or ``restore()``) puts back the previous state.

    Raises:
        ModelConfigError: If ``capacity_factor`` is not None and not a positive finite float.
    """
    check_capacity_factor("capacity_factor", capacity_factor)
    return DecodeExpertPadding(moe_layers(model), bool(enabled), capacity_factor)
