"""specdec_core: speculative decoding in one process (pure PyTorch + transformers)."""

from .engine import Completion, ComponentSpec, GenerationRequest, SpeculativeEngine, StreamChunk
from .errors import SpecdecError
from .models import EMBEDDED, ModelSpec
from .sampling import SamplingParams

__all__ = [
    "Completion",
    "ComponentSpec",
    "EMBEDDED",
    "GenerationRequest",
    "ModelSpec",
    "SamplingParams",
    "SpecdecError",
    "SpeculativeEngine",
    "StreamChunk",
]
