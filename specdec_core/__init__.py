"""specdec_core: speculative decoding in one process (pure PyTorch + transformers)."""

from .engine import SpeculativeEngine
from .errors import SpecdecError
from .loader import DEFAULT_DRAFT, EMBEDDED, ModelSpec
from .request import Completion, ComponentSpec, GenerationRequest, RequestDefaults, StreamChunk
from .sampling import SamplingParams

__all__ = [
    "Completion",
    "ComponentSpec",
    "DEFAULT_DRAFT",
    "EMBEDDED",
    "GenerationRequest",
    "ModelSpec",
    "RequestDefaults",
    "SamplingParams",
    "SpecdecError",
    "SpeculativeEngine",
    "StreamChunk",
]
