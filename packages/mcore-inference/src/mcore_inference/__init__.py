"""mcore-inference: a dynamic inference engine over a paged KV cache."""

from mcore_inference._version import __version__
from mcore_inference.errors import EngineClosedError, InferenceError, InvalidRequestError

__all__ = [
    "__version__",
    "InferenceError",
    "InvalidRequestError",
    "EngineClosedError",
]
