"""Point-to-point exchange of activations and gradients between adjacent pipeline stages.

Each call talks to one neighbour, and the schedules pair every call on a stage with exactly one
call on that neighbour (send forward with receive forward, and so on), so the two sides always
post matching operations. Operations of one call are posted together with
``batch_isend_irecv`` so that NCCL runs them concurrently instead of deadlocking on their order.
When the activation shape is not fixed up front, a small header (dtype and shape) precedes each
forward send.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore_parallel.errors import ParallelConfigError
from mcore_parallel.state import ParallelState

__all__ = ["PipelineChannel"]

# Tags keep activations and gradients apart where both travel between the same two ranks in one
# exchange (pp=2 with interleaving); NCCL ignores tags and relies on the fixed op order instead.
_FORWARD_TAG, _BACKWARD_TAG = 0, 1

_MAX_DIMS = 8
# Order defines the header's dtype code; both ends run the same code.
_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
)


class PipelineChannel:
    """Sends and receives one activation tensor per microbatch to and from the neighbours.

    Args:
        state: Parallel state with ``pp_size > 1``.
        tensor_shape: Shape of every activation sent between stages, or None to send a header
            with the shape and dtype before each activation (variable sequence lengths).
        dtype: Dtype of the activations when ``tensor_shape`` is given.

    Raises:
        ParallelConfigError: If ``tensor_shape`` has more than 8 dimensions.
    """

    def __init__(
        self,
        state: ParallelState,
        *,
        tensor_shape: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if tensor_shape is not None and len(tensor_shape) > _MAX_DIMS:
            raise ParallelConfigError(
                f"tensor_shape={tuple(tensor_shape)} has more than {_MAX_DIMS} dimensions"
            )
        self.state = state
        self.tensor_shape = None if tensor_shape is None else tuple(tensor_shape)
        self.dtype = dtype
        self.device = state.device
        # Shapes and dtypes of sent activations, oldest first: gradients come back in this order.
        self._sent: deque[tuple[tuple[int, ...], torch.dtype]] = deque()

    def _send_header(self, tensor: torch.Tensor) -> None:
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise ParallelConfigError(
                f"activation of shape {tuple(tensor.shape)} and dtype {tensor.dtype} cannot be "
                f"sent: at most {_MAX_DIMS} dimensions and a dtype in {_DTYPES}"
            )
        header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        dist.send(header, self.state.pp_next_rank)

    def _recv_header(self) -> tuple[tuple[int, ...], torch.dtype]:
        header = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
        dist.recv(header, self.state.pp_prev_rank)
        values = header.tolist()
        return tuple(values[2 : 2 + values[0]]), _DTYPES[values[1]]

    def _forward_spec(self, tensor: torch.Tensor) -> None:
        if self.tensor_shape is None:
            self._send_header(tensor)
        elif tuple(tensor.shape) != self.tensor_shape:
            raise ParallelConfigError(
                f"activation shape {tuple(tensor.shape)} differs from tensor_shape="
                f"{self.tensor_shape}; pass tensor_shape=None for variable shapes"
            )
        self._sent.append((tuple(tensor.shape), tensor.dtype))

    def _incoming_spec(self) -> tuple[tuple[int, ...], torch.dtype]:
        if self.tensor_shape is None:
            return self._recv_header()
        return self.tensor_shape, self.dtype

    def _exchange(
        self,
        send: torch.Tensor | None,
        peer: int,
        recv_spec: tuple[tuple[int, ...], torch.dtype] | None,
    ) -> torch.Tensor | None:
        ops = []
        received = None
        if send is not None:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), peer))
        if recv_spec is not None:
            received = torch.empty(recv_spec[0], dtype=recv_spec[1], device=self.device)
            ops.append(dist.P2POp(dist.irecv, received, peer))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    def recv_forward(self) -> torch.Tensor | None:
        """Receives the next activation from the previous stage.

        Returns:
            The activation, or None on the first stage.
        """
        if self.state.is_first_stage:
            return None
        return self._exchange(None, self.state.pp_prev_rank, self._incoming_spec())

    def send_forward(self, output: torch.Tensor) -> None:
        """Sends an activation to the next stage (no-op on the last stage).

        Args:
            output: The activation.
        """
        if self.state.is_last_stage:
            return
        self._forward_spec(output)
        self._exchange(output.detach(), self.state.pp_next_rank, None)

    def recv_backward(self) -> torch.Tensor | None:
        """Receives the gradient of the oldest activation sent forward.

        Returns:
            The gradient, or None on the last stage.
        """
        if self.state.is_last_stage:
            return None
        return self._exchange(None, self.state.pp_next_rank, self._sent.popleft())

    def send_backward(self, grad: torch.Tensor | None) -> None:
        """Sends the gradient of a received activation back (no-op on the first stage).

        Args:
            grad: The gradient.
        """
        if self.state.is_first_stage or grad is None:
            return
        self._exchange(grad, self.state.pp_prev_rank, None)

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor | None:
        """Sends an activation forward and receives the gradient of the oldest one sent.

        Args:
            output: The activation.

        Returns:
            The gradient, or None on the last stage.
        """
        if self.state.is_last_stage:
            return None
        self._forward_spec(output)
        return self._exchange(output.detach(), self.state.pp_next_rank, self._sent.popleft())

    def send_backward_recv_forward(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Sends a gradient backward and receives the next activation.

        Args:
            grad: The gradient of the oldest received activation.

        Returns:
            The next activation, or None on the first stage.
        """
        if self.state.is_first_stage:
            return None
        spec = self._incoming_spec()
        return self._exchange(grad, self.state.pp_prev_rank, spec)

    def exchange(
        self,
        output: torch.Tensor | None,
        input_grad: torch.Tensor | None,
        *,
        recv_prev: bool,
        recv_next: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Sends forward and backward and receives from both neighbours in one batch.

        The interleaved schedule's step; it needs a fixed ``tensor_shape``. Neighbours wrap
        around (the last stage's next is the first stage), since model chunks continue there.

        Args:
            output: Activation for the next stage, or None.
            input_grad: Gradient for the previous stage, or None.
            recv_prev: Whether to receive an activation from the previous stage.
            recv_next: Whether to receive a gradient from the next stage.

        Returns:
            The received activation and gradient (None where not received).

        Raises:
            ParallelConfigError: If the channel has no fixed ``tensor_shape``.
        """
        if self.tensor_shape is None:
            raise ParallelConfigError(
                "interleaved pipelining needs a fixed tensor_shape (got tensor_shape=None)"
            )
        prev_rank, next_rank = self.state.pp_prev_rank, self.state.pp_next_rank
        received_input = received_grad = None
        ops = []
        # One fixed order on every rank: with pp=2 both messages between two ranks then match.
        if output is not None:
            ops.append(
                dist.P2POp(dist.isend, output.detach().contiguous(), next_rank, tag=_FORWARD_TAG)
            )
        if recv_prev:
            received_input = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, received_input, prev_rank, tag=_FORWARD_TAG))
        if input_grad is not None:
            ops.append(
                dist.P2POp(dist.isend, input_grad.contiguous(), prev_rank, tag=_BACKWARD_TAG)
            )
        if recv_next:
            received_grad = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, received_grad, next_rank, tag=_BACKWARD_TAG))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received_input, received_grad
