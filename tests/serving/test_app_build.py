"""The app builder refuses a config that cannot serve before any replica starts: target heads
named that do not fit the target as configured (`serve deploy` then reports DEPLOY_FAILED and the
running app stays; `specdec serve` exits before starting Ray)."""

from __future__ import annotations

import pytest
import torch
import yaml
from typer.testing import CliRunner

from helpers.eagle3_heads import write_eagle3
from helpers.tiny_models import tiny_llama

pytest.importorskip("ray")

from deployments.app import build_app  # noqa: E402
from deployments.cli import app as cli  # noqa: E402


@pytest.fixture(scope="module")
def target_with_eagle3(tmp_path_factory):
    """A tiny 8-layer checkpoint and an EAGLE-3 layer that reads its layers 2, 4 and 5."""
    root = tmp_path_factory.mktemp("app_build")
    target = tiny_llama(seed=3, num_layers=8, prepared=False)
    target.save_pretrained(root / "target")
    return str(root / "target"), str(write_eagle3(root / "eagle3", target, "speculators"))


def args(target_dir: str, heads: str, **target) -> dict:
    return {"target": {"source": target_dir, **target}, "draft": None, "target_heads": heads, "calibration": None}


def test_named_heads_that_do_not_fit_the_target_as_configured_are_refused_by_the_builder(target_with_eagle3):
    target_dir, eagle3_dir = target_with_eagle3
    assert build_app(args(target_dir, eagle3_dir)) is not None
    too_short = r"target_heads: .* reads target layers \[2, 4, 5\]; the target keeps 5 layers"
    with pytest.raises(ValueError, match=too_short):
        build_app(args(target_dir, eagle3_dir, num_layers=5))
    in_stages = {**args(target_dir, eagle3_dir), "target_worker": {"pp_size": 2}}
    with pytest.raises(ValueError, match="a target in stages holds Medusa heads only"):
        build_app(in_stages)
    with pytest.raises(ValueError, match="target_heads: .*: no medusa_lm_head.pt"):  # a checkpoint, no heads
        build_app(args(target_dir, target_dir))
    # auto leaves out what does not fit instead (the worker logs it); heads elsewhere are the worker's to check
    assert build_app(args(target_dir, "auto", num_layers=5)) is not None
    assert build_app(args(target_dir, "/not/on/this/node", num_layers=5)) is not None


def test_specdec_serve_refuses_such_a_config_before_starting_ray(target_with_eagle3, tmp_path):
    target_dir, eagle3_dir = target_with_eagle3
    application = {"name": "specdec", "import_path": "deployments.app:build_app"}
    config = {"applications": [{**application, "args": args(target_dir, eagle3_dir, num_layers=5)}]}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(cli, ["serve", "--config", str(tmp_path / "serve.yaml")])
    assert result.exit_code == 2, result.output
    assert "bad config" in result.output and "the target keeps 5 layers" in result.output


def test_specdec_serve_prices_a_cpu_draft_on_this_machine_and_says_what_it_chose(tmp_path, monkeypatch, capsys):
    """Before it starts the workers, `specdec serve` loads a CPU pair, chooses the draft's kernels
    at its worker's threads (cached where the worker reads them), times the draft beside the
    target, prints both, and serves the prices as the model drafters' defaults."""
    import json

    from deployments.cli import with_measured_draft
    from deployments.config import AppConfig
    from specdec_core.models.kernels.kernel_choice import machine

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    tiny = tiny_llama(prepared=False).config.to_dict()
    (tmp_path / "tiny.json").write_text(json.dumps(tiny))
    source = f"random:{tmp_path / 'tiny.json'}"
    config = AppConfig(
        target={"source": source},
        draft={"source": source, "dtype": "int4"},
        draft_worker={"torch_threads": 1},
        calibration=None,
    )
    priced = with_measured_draft(config)
    assert priced.draft_costs is not None and priced.draft_costs.draft_cost > 0
    printed = capsys.readouterr().out
    assert "draft kernels: " in printed and "LM head (1): " in printed and "draft: a draft step costs" in printed
    (tables,) = (tmp_path / "kernels").glob("*.json")
    assert json.loads(tables.read_text())["machine"]["threads"] == "1"  # the draft worker's
    assert machine()["threads"] == str(torch.get_num_threads())  # this process's own, restored
    assert AppConfig(**priced.model_dump()).draft_costs == priced.draft_costs  # as build_app gets it
    assert with_measured_draft(config).draft_costs == priced.draft_costs  # the next start: from the cache
    assert "measured before" in capsys.readouterr().out
    with pytest.raises(ValueError, match="int4 is for drafts"):
        AppConfig(target={"source": source, "dtype": "int4"})
