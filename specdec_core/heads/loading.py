"""Which heads a target holds (drafters `heads` and `eagle3`): those named (`target_heads`: a
directory of Medusa or Hydra heads or of an EAGLE-3 layer, or one of each) or, for `auto`, those
shipped for its source that fit it. Whether heads fit a target is decided from the heads' files
(their config and the shapes of their tensors, no weights read) and the target's shape as
configured (hidden size, vocabulary, the layers it keeps, its pipeline stages), so that a
deployment checks a named directory before any replica starts (deployments/app.py) and a worker
checks it again against the model it loaded."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from ..models.shard_loader import activation_dtype
from ..runtime.model_runner import runner_of
from ..target.aux_states import keep_aux_states
from .contract import Heads
from .eagle3_checkpoint import is_eagle3, load_eagle3, read_config, weight_files
from .eagle3_layer import default_aux_layers
from .hydra import HYDRA_WEIGHTS_FILE, LM_HEAD_KEY, HydraHeads
from .medusa import WEIGHTS_FILE, MedusaHeads

SHIPPED = Path(str(resources.files("specdec_core") / "data" / "heads"))
# heads trained here for the embedded default (`specdec train-heads`, docs/trees.md), by target source
SHIPPED_HEADS = {
    "embedded:smollm2-135m-instruct": [SHIPPED / "smollm2-135m-instruct", SHIPPED / "smollm2-135m-instruct-eagle3"]
}
AUTO = "auto"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetShape:
    """What heads read of a target, as it is configured."""

    hidden_size: int
    vocab_size: int
    num_layers: int  # the decoder layers it keeps (ModelSpec.num_layers)
    stages: int = 1  # its pipeline stages (pipeline.py)

    @classmethod
    def of_config(cls, config, num_layers: Optional[int] = None, stages: int = 1) -> "TargetShape":
        """A target of transformers `config`, cut to `num_layers`, in `stages` pipeline stages."""
        kept = min(num_layers or config.num_hidden_layers, config.num_hidden_layers)
        return cls(config.hidden_size, config.vocab_size, kept, stages)

    @classmethod
    def of_model(cls, model: nn.Module) -> "TargetShape":
        """A loaded target (a stage's layers are its own; heads that read layers refuse stages)."""
        stage = runner_of(model.model).stage
        return cls.of_config(model.config, stages=stage.num_stages if stage is not None else 1)


@dataclass(frozen=True)
class HeadsShape:
    """What heads read and predict, from their files."""

    kind: str  # medusa, hydra or eagle3
    hidden_size: int  # of the target states they read
    vocab_size: Optional[int]  # of their predictions; None: the target's LM head projects them
    layers: tuple[int, ...] = ()  # the target layers whose states they read besides the last (EAGLE-3)
    embedding_size: Optional[int] = None  # of the target's token embeddings they read as their own input


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shapes of a weight file's tensors, their data left on disk (safetensors' header, or a
    torch file mapped into memory)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as weights:
            return {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def heads_shape(directory: str, target: TargetShape) -> HeadsShape:
    """The shape of the heads in `directory` (an EAGLE-3 layer that names no layers reads the
    default ones of `target`)."""
    path = Path(directory)
    if is_eagle3(path):
        _, layer_config, aux = read_config(path)
        files = weight_files(path)
        shapes = {name.removeprefix("model."): shape for file in files for name, shape in tensor_shapes(file).items()}
        layers = aux or default_aux_layers(target.num_layers)
        if "fc.weight" not in shapes or shapes["fc.weight"][1] % len(layers):
            raise ValueError(f"{directory} is not an EAGLE-3 head: no fc.weight over its {len(layers)} target layers")
        # without an embedding of its own the layer embeds its tokens with the target's
        embedding = None if "embed_tokens.weight" in shapes else layer_config.get("hidden_size")
        fc_width = shapes["fc.weight"][1] // len(layers)
        return HeadsShape("eagle3", fc_width, layer_config.get("vocab_size"), layers, embedding)
    if (path / HYDRA_WEIGHTS_FILE).exists():
        shapes = tensor_shapes(path / HYDRA_WEIGHTS_FILE)
        lm_heads = [shape for name, shape in shapes.items() if (key := LM_HEAD_KEY.match(name)) and key[2] == "weight"]
        if not lm_heads:
            raise ValueError(f"{path / HYDRA_WEIGHTS_FILE} holds no Hydra LM head")
        vocab_size, hidden_size = lm_heads[0]
        return HeadsShape("hydra", hidden_size, vocab_size)
    if not (path / WEIGHTS_FILE).exists():
        raise FileNotFoundError(f"{directory}: no {WEIGHTS_FILE}, {HYDRA_WEIGHTS_FILE} or EAGLE-3 config.json")
    shapes = tensor_shapes(path / WEIGHTS_FILE)
    if "0.0.linear.weight" not in shapes:
        raise ValueError(f"{path / WEIGHTS_FILE} is not a Medusa head state dict (keys like 0.0.linear.weight)")
    projections = [shape for name, shape in shapes.items() if re.fullmatch(r"0\.\d+\.weight", name)]
    return HeadsShape("medusa", shapes["0.0.linear.weight"][1], projections[0][0] if projections else None)


def fit_refusal(heads: HeadsShape, target: TargetShape) -> Optional[str]:
    """Why `heads` cannot run on `target` (None: they can)."""
    what = {"medusa": "the Medusa heads", "hydra": "the Hydra heads", "eagle3": "the EAGLE-3 layer"}[heads.kind]
    if target.stages > 1 and heads.kind != "medusa":
        reads = (
            "reads hidden states from low, middle and high layers of the target, which its pipeline stages split"
            if heads.kind == "eagle3"
            else "read the target's token embeddings, which only a pipeline's first stage holds"
        )
        return f"{what} {reads}; a target in stages holds Medusa heads only"
    if heads.hidden_size != target.hidden_size:
        hidden = target.hidden_size
        return f"{what} read target states of size {heads.hidden_size}; the target's hidden size is {hidden}"
    if heads.embedding_size is not None and heads.embedding_size != target.hidden_size:
        size = heads.embedding_size
        return f"{what} embeds its tokens at size {size} with the target's embedding, of size {target.hidden_size}"
    if heads.vocab_size is not None and heads.vocab_size != target.vocab_size:
        return f"the vocabulary of {what} is {heads.vocab_size}; the target's is {target.vocab_size}"
    if not all(0 <= layer < target.num_layers for layer in heads.layers):
        return f"{what} reads target layers {list(heads.layers)}; the target keeps {target.num_layers} layers"
    return None


def refusal(directory: str, target: TargetShape) -> Optional[str]:
    """Why the heads in `directory` cannot run on `target`, naming the directory (None: they can)."""
    problem = fit_refusal(heads_shape(directory, target), target)
    return f"{directory}: {problem}" if problem else None


def shipped_heads(target_source: str, target: TargetShape, left_out: Callable[[str], None]) -> list[str]:
    """The heads shipped for `target_source` that fit `target`; `left_out(why)` for each other."""
    fitting = []
    for directory in map(str, SHIPPED_HEADS.get(target_source, [])):
        problem = refusal(directory, target)
        if problem:
            left_out(f"target_heads auto leaves out {problem}")
        else:
            fitting.append(directory)
    return fitting


def named_heads(setting: Optional[str]) -> list[str]:
    """The directories a `target_heads` setting other than auto names."""
    return [directory.strip() for directory in (setting or "").split(",") if directory.strip()]


def load_heads(
    setting: Optional[str], target_source: str, model: nn.Module, left_out: Callable[[str], None] = logger.warning
) -> dict[str, Heads]:
    """A target's heads by kind, on its device and in its dtype: `setting` names directories
    (several separated by commas, one of each kind: Medusa or Hydra, and EAGLE-3), or is "auto"
    (those shipped for `target_source` that fit `model`, `left_out` told of the others) or None."""
    if setting == AUTO:
        directories = shipped_heads(target_source, TargetShape.of_model(model), left_out)
    else:
        directories = named_heads(setting)
    held: dict[str, Heads] = {}
    for directory in directories:
        heads = load_heads_from(directory, model)
        if heads.kind in held or {heads.kind, *held} >= {"medusa", "hydra"}:
            raise ValueError(
                f"a target holds one set of Medusa or Hydra heads and one EAGLE-3 layer; {directory} "
                f"is {heads.kind} beside {', '.join(held)}"
            )
        held[heads.kind] = heads
    return held


def load_heads_from(directory: str, model: nn.Module) -> Heads:
    """The heads in one directory, refused (ValueError) where they do not fit `model`."""
    target = TargetShape.of_model(model)
    shape = heads_shape(directory, target)  # its kind too: which loader reads it
    problem = fit_refusal(shape, target)
    if problem is not None:
        raise ValueError(f"{directory}: {problem}")
    heads: Heads
    if shape.kind == "eagle3":
        heads = load_eagle3(directory, model.config)
        keep_aux_states(model, heads.aux_layers)  # what the layer reads, from every target forward
        heads.run_as(model)
    elif shape.kind == "hydra":
        heads = HydraHeads.load(directory, model.config)
    else:
        heads = MedusaHeads.load(directory)
    return heads.to(model.device, activation_dtype(model)).eval()
