"""``ParallelConfig``: the sizes of a parallel layout of a GRPO run, for training or generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_rl._config_checks import check_choices, check_minimums
from mcore_rl.errors import RLConfigError

__all__ = ["ParallelConfig"]


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Sizes of a parallel layout over the ranks of the run (tp x pp x cp x dp = world)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vp: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B; training only)."""
    cp: int = 1
    """Context-parallel size (training only): every packed sequence is split over cp ranks,
    each sequence padded to a multiple of ``2 cp`` tokens."""
    cp_method: Literal["ring", "all_gather"] = "ring"
    """Attention over the context-parallel ranks (training only): ``ring`` passes keys and
    values round the ring, ``all_gather`` gathers them (``mcore_models.parallelize``'s
    ``context_parallel_method``)."""
    ep: int = 1
    """Expert-parallel size (MoE models): experts split over ``ep`` ranks carved out of the
    data x context-parallel ranks, as in Megatron."""
    etp: int | None = None
    """Expert tensor-parallel size (MoE models): each expert's FFN split over ``etp`` ranks;
    None takes ``tp``. ``ep x etp`` must divide ``tp x cp x dp``."""
    dp: int | None = None
    """Data-parallel size; None takes what the world leaves after tp x pp x cp."""
    sequence_parallel: bool = False
    """Split the sequence over the tensor-parallel ranks between layers (training only)."""

    def __post_init__(self) -> None:
        check_minimums(self, {"tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "etp": 1, "dp": 1})
        check_choices(self)
        if self.vp > 1 and self.pp == 1:
            raise RLConfigError(f"vp={self.vp} needs pp > 1 (virtual stages of a pipeline)")
        if self.sequence_parallel and self.tp == 1:
            raise RLConfigError("sequence_parallel=True needs tp > 1")

    def data_parallel_size(self, world: int) -> int:
        """The data-parallel size this layout gets on ``world`` ranks.

        Args:
            world: Number of ranks of the run.

        Returns:
            ``dp`` (given or implied).

        Raises:
            RLConfigError: If ``tp x pp x cp x dp`` does not equal ``world``.
        """
        model = self.tp * self.pp * self.cp
        dp = self.dp if self.dp is not None else world // model
        if model * dp != world or dp < 1:
            raise RLConfigError(
                f"tp={self.tp} x pp={self.pp} x cp={self.cp} x dp={self.dp} does not fill the "
                f"{world} ranks of the run"
            )
        if (self.tp * self.cp * dp) % (self.ep * self.expert_tp):
            raise RLConfigError(
                f"ep={self.ep} x etp={self.expert_tp} must divide tp={self.tp} x cp={self.cp} x "
                f"dp={dp} (experts are split over ranks of the tensor and data-parallel grid)"
            )
        return dp

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect (``etp``, or ``tp`` when None)."""
        return self.tp if self.etp is None else self.etp

    def same_model_layout(self, other: ParallelConfig) -> bool:
        """Whether two layouts split the model the same way (tp, pp, vp, cp, ep, etp, sp).

        Args:
            other: The other layout.

        Returns:
            True when both would hold the same blocks on every rank.
        """
        names = ("tp", "pp", "vp", "cp", "ep", "expert_tp", "sequence_parallel")
        return all(getattr(self, n) == getattr(other, n) for n in names)
