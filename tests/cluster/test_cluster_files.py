"""Every file in cluster/ validates with Ray's own schemas, its app args with specdec's config,
and the GPUs a Serve config asks for fit the node types it is meant for."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from deployments.config import AppConfig  # noqa: E402

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"
# GPUs per machine of the node types the launcher files use (the clouds' published shapes)
MACHINE_GPUS = {"p5.48xlarge": 8, "p5e.48xlarge": 8, "p4d.24xlarge": 8, "g6e.2xlarge": 1, "a3-highgpu-8g": 8}
# which launcher files each GPU Serve config is meant for
MEANT_FOR = {
    "serve-llama-3.1-70b.yaml": ["aws-p5.yaml", "aws-p4d.yaml", "gcp-a3.yaml"],
    "serve-llama-3.1-405b.yaml": ["aws-p5.yaml"],
    "serve-llama-3.1-405b-h100.yaml": ["aws-p5.yaml"],
    "serve-llama-3.1-405b-h100-pp2.yaml": ["aws-p5.yaml"],  # a stage a gpu_h100 node (it has 2)
}


def documents() -> dict[str, dict]:
    return {path.name: yaml.safe_load(path.read_text()) for path in sorted(CLUSTER.glob("*.yaml"))}


def serve_configs() -> dict[str, dict]:
    configs = {name: document for name, document in documents().items() if "applications" in document}
    for name, document in documents().items():
        if document.get("kind") == "RayService":
            configs[name] = yaml.safe_load(document["spec"]["serveConfigV2"])
    return configs


def test_every_file_is_a_serve_config_a_launcher_or_a_rayservice():
    kinds = {}
    for name, document in documents().items():
        kinds[name] = (
            "serve" if "applications" in document else "launcher" if "provider" in document else document.get("kind")
        )
    assert set(kinds.values()) == {"serve", "launcher", "RayService"}, kinds
    assert {
        "local.yaml",
        "local-tp3.yaml",
        "local-pp2.yaml",
        "serve-llama-3.1-70b.yaml",
        "serve-llama-3.1-405b.yaml",
    } <= set(kinds)


@pytest.mark.parametrize("name", sorted(serve_configs()))
def test_serve_configs_validate_with_serve_and_specdec(name):
    config = serve_configs()[name]
    ServeDeploySchema.model_validate(config)
    (application,) = config["applications"]
    assert application["import_path"] == "deployments.app:build_app"
    AppConfig(**application["args"])


@pytest.mark.parametrize("name", sorted(name for name, document in documents().items() if "provider" in document))
def test_launcher_files_validate_with_the_autoscaler(name):
    validate_config(prepare_config(documents()[name]))


def node_types(launcher: dict) -> dict[str, tuple[int, dict]]:
    """name -> (GPUs, custom resources) of each worker node type."""
    types = {}
    for type_name, node_type in launcher["available_node_types"].items():
        machine = node_type["node_config"].get("InstanceType") or node_type["node_config"].get("machineType")
        types[type_name] = (MACHINE_GPUS.get(machine, 0), node_type.get("resources", {}))
    return types


def fits(worker: dict, types: dict[str, tuple[int, dict]], extra_gpus: float = 0.0) -> bool:
    """Some node type has the custom resources and the GPUs of all the worker's ranks."""
    ranks = worker.get("tp_size", 1)
    for gpus, resources in types.values():
        has = all(resources.get(key, 0) >= amount * ranks for key, amount in worker.get("resources", {}).items())
        if has and ranks * worker.get("num_gpus", 0) + extra_gpus <= gpus and gpus > 0:
            return True
    return False


@pytest.mark.parametrize("name", sorted(MEANT_FOR))
def test_the_gpus_a_serve_config_asks_for_fit_its_node_types(name):
    args = documents()[name]["applications"][0]["args"]
    target, draft = args["target_worker"], args["draft_worker"]
    for launcher in MEANT_FOR[name]:
        types = node_types(documents()[launcher])
        colocated = draft.get("num_gpus", 0) if args.get("draft_on_target_node") else 0.0
        assert fits(target, types, colocated), (name, launcher, "target")
        assert args.get("draft_on_target_node") or fits(draft, types), (name, launcher, "draft")


def test_the_rayservice_worker_group_holds_its_serve_config():
    rayservice = documents()["kuberay-rayservice.yaml"]
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    gpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    resources = yaml.safe_load(yaml.safe_load(group["rayStartParams"]["resources"]))
    target = args["target_worker"]
    assert target["tp_size"] * target["num_gpus"] + args["draft_worker"]["num_gpus"] <= gpus
    assert resources["target_node"] >= target["tp_size"] * target["resources"]["target_node"]


def test_the_app_bounds_each_replica_and_its_queue_as_configured():
    """`max_ongoing_requests` and `max_queued_requests` reach Serve's deployment (past the queue
    Serve answers 503 itself)."""
    from deployments.app import build_app

    deployment = build_app({"max_ongoing_requests": 3, "max_queued_requests": 7})._bound_deployment
    assert deployment._deployment_config.max_ongoing_requests == 3
    assert deployment._deployment_config.max_queued_requests == 7
    default = build_app({})._bound_deployment._deployment_config
    assert default.max_queued_requests == AppConfig().max_queued_requests == 64


def test_the_command_lines_layout_overrides_the_configs():
    """`specdec serve --config cluster/local-pp2.yaml --tp 3`: 2 stages of 3 ranks, the rest the
    file's; --simulate-nodes refuses an existing cluster's --address before starting anything."""
    from typer.testing import CliRunner

    from deployments.cli import app, load_serve_config, options_over

    args = options_over(
        load_serve_config(CLUSTER / "local-pp2.yaml"), tp_size=3, pp_size=None, http_port=8001, host=None
    )
    config = AppConfig(**args)
    assert (config.target_worker.pp_size, config.target_worker.tp_size, config.http_port) == (2, 3, 8001)
    assert config.target_worker.placement_strategy == "SPREAD" and config.host == "127.0.0.1"
    command = ["serve", "--config", str(CLUSTER / "local-pp2.yaml"), "--simulate-nodes", "2", "--address", "auto"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2 and "leave out --address" in result.output


@pytest.mark.parametrize("name", sorted(MEANT_FOR))
def test_a_worker_that_rolls_over_has_nodes_for_its_replacement_beside_it(name):
    """A worker whose replacement starts before it stops (max_surge_percent above 0, the default)
    needs a second set of its nodes during a rollout: a node type that holds it and of which the
    launcher may start twice its stages. Where none has, the config replaces it in place (0); so
    does a draft on the target's node, whose GPU share has no room for a second."""
    args = documents()[name]["applications"][0]["args"]
    for launcher in MEANT_FOR[name]:
        document = documents()[launcher]
        types = node_types(document)
        for role in ("target", "draft"):
            worker = args[f"{role}_worker"]
            if worker.get("max_surge_percent", 100) == 0:
                continue
            assert not (role == "draft" and args.get("draft_on_target_node")), (name, role)
            room = [
                type_name
                for type_name, node_type in document["available_node_types"].items()
                if node_type.get("max_workers", 0) >= 2 * worker.get("pp_size", 1)
                and fits(worker, {type_name: types[type_name]})
            ]
            assert room, (name, launcher, role)
