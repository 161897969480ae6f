"""specdec_core: speculative decoding in one process (pure PyTorch + transformers)."""

from .api.errors import SpecdecError
from .api.request import Completion, ComponentSpec, GenerationRequest, RequestDefaults, StreamChunk
from .api.sampling import SamplingParams
from .loop.engine import SpeculativeEngine
from .models.loader import DEFAULT_DRAFT, ModelSpec
from .models.sources import EMBEDDED

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
