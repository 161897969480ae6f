"""Named candidate trees (paths of top-k ranks per depth, tree.py).

`mc_sim_7b_63` is the default tree that Medusa publishes for Vicuna-7B (63 nodes, depth 4;
FasterDecoding/Medusa, medusa/model/medusa_choices.py, Apache-2.0). Its paths are listed in the
order they were added, best first, and every path's parent comes before it, so each of its
prefixes is a tree too: `medusa_8`, `medusa_16` and `medusa_32` are the first 8, 16 and 32. The
chains are one-path trees, the shape a chain drafter proposes. A spine (`spine_DxW`) is a chain
of depth D with the W - 1 runners-up beside each of its nodes: every node hangs off the top-1
path, so `mla_tree` fills it in one draft forward when its lookup guessed the path."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Union

from .tree import TopologyBank

MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip

NAMED_TREES = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    **{f"medusa_{size}": MC_SIM_7B_63[:size] for size in (8, 16, 32)},
    **{f"chain_{depth}": tuple((0,) * length for length in range(1, depth + 1)) for depth in (2, 4, 8)},
    **{
        f"spine_{depth}x{width}": tuple((0,) * length + (rank,) for length in range(depth) for rank in range(width))
        for depth, width in ((4, 2), (6, 2), (8, 2), (6, 3))
    },
}
DEFAULT_TREE = "mc_sim_7b_63"
# the draft trees' (model_tree, mla_tree): a spine's nodes all come from its top-1 path's forwards,
# which a chain would take (docs/performance.md: the spines measured)
DEFAULT_DRAFT_TREE = "spine_6x2"


@functools.cache
def default_bank() -> TopologyBank:
    """Every named tree, built once per process."""
    return TopologyBank(NAMED_TREES)


def load_tree_bank(path: Union[str, Path]) -> list[str]:
    """Register the trees of a bank file (`specdec frontier`'s `{"trees": {name: paths}}`) in the
    default bank; returns their names. Every process that names them (the coordinator and the
    target worker) loads the same files."""
    trees = json.loads(Path(path).read_text())["trees"]
    for name, paths in trees.items():
        default_bank().add(name, [tuple(node) for node in paths])
    return list(trees)
