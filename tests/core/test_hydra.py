"""Hydra's heads (specdec_core/heads/hydra.py): its published format loads, trees expand depth by depth
as Hydra's proposal does (each node's children read its path), Hydra++'s prefix layer keeps its
cache across commits, and decoding with them is exact."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_core import GenerationRequest
from specdec_core.heads.hydra import HydraHeads
from specdec_core.heads.loading import load_heads, load_heads_from
from specdec_core.trees.topologies import default_bank

from helpers.published_hydra import PublishedHydra, hydra_from_medusa
from helpers.tiny_models import repeating_prompt, tiny_llama, tiny_profile


def published_hydra(target, architecture: str, num_layers: int) -> PublishedHydra:
    """Random Hydra heads for `target` in Hydra's module layout (Hydra++ with a one-layer prefix)."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(3)
    prefix = None
    if architecture == "prefix-mlp":
        prefix = LlamaModel(LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})).eval()
    config = target.config
    hydra = PublishedHydra(config.hidden_size, config.vocab_size, 3, num_layers, prefix).eval()
    with torch.no_grad():
        for name, parameter in hydra.named_parameters():
            if not name.startswith("prefix"):
                parameter.normal_(std=0.3)
    return hydra


def reference_tree(hydra: PublishedHydra, state, embed, root: int, tree) -> tuple[list[int], float]:
    """Hydra's proposal path by path, from scratch: node (r_1..r_d) is the r_d-th guess of head d
    over the state and the embeddings of the root and the path to its parent; and head 0's top-1
    probability."""
    tokens = {(): root}
    for path in tree.paths:
        head = len(path) - 1
        features = torch.cat([state, *embed(torch.tensor([tokens[path[:depth]] for depth in range(len(path))]))])
        logits = hydra.hydra_lm_head[head](hydra.hydra_mlp[head](features))
        tokens[path] = int(logits.topk(path[-1] + 1).indices[-1])
    first = hydra.hydra_lm_head[0](hydra.hydra_mlp[0](torch.cat([state, embed(torch.tensor(root))])))
    return [tokens[path] for path in tree.paths], float(first.softmax(-1).max())


@pytest.mark.parametrize(("architecture", "num_layers"), [("mlp", 1), ("mlp", 2), ("prefix-mlp", 2)])
def test_a_published_hydra_checkpoint_expands_trees_as_hydras_proposal(tmp_path, architecture, num_layers):
    target = tiny_llama()
    hydra = published_hydra(target, architecture, num_layers)
    hydra.save(tmp_path, architecture)
    if architecture == "prefix-mlp":  # as older transformers saved it: the rotary frequencies too
        state = torch.load(tmp_path / "hydra_lm_head.pt")
        state["prefix_embeding_layer.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        torch.save(state, tmp_path / "hydra_lm_head.pt")
    heads = load_heads_from(str(tmp_path), target)
    assert isinstance(heads, HydraHeads) and (heads.num_heads, heads.num_layers) == (3, num_layers)
    assert (heads.prefix is not None) == (architecture == "prefix-mlp")
    session = heads.session(target)
    hidden = torch.randn(9, target.config.hidden_size)
    for rows in (slice(0, 4), slice(4, 5), slice(5, 9)):  # committed in three steps
        session.advance(hidden[rows], torch.zeros(len(hidden[rows]), dtype=torch.long), None)
    with torch.no_grad():
        if architecture == "prefix-mlp":  # the prefix layer's cache: as one forward over every position
            state = hydra.prefix_embeding_layer(inputs_embeds=hidden[None]).last_hidden_state[0, -1]
        else:
            state = hidden[-1]
        embed = target.get_input_embeddings()
        root_prob = target.lm_head(hidden[-1]).softmax(-1)[17].item()
        for name in ("mc_sim_7b_63", "medusa_8", "chain_2"):
            guesses = session.guess(17, name)
            assert guesses.tree.name == default_bank().limited(name, 3).name
            tokens, first_prob = reference_tree(hydra, state, embed, 17, guesses.tree)
            assert guesses.tokens.tolist() == tokens
            assert guesses.top_probs[0].item() == pytest.approx(first_prob, abs=1e-5)
            assert guesses.root_prob == pytest.approx(root_prob, abs=1e-6)


def test_hydra_heads_that_ignore_the_path_guess_medusas_tree(trained_heads, tiny_target, tmp_path, heads_engine):
    """Hydra heads made from Medusa heads, with no weight on the path, decode exactly as the
    Medusa heads do: the same trees, the same acceptance, target-only's tokens."""
    from specdec_core import SpeculativeEngine

    hydra_from_medusa(trained_heads[0], path_weight=0.0).save(tmp_path, "mlp")
    heads = load_heads(str(tmp_path), "tiny", tiny_target)
    assert list(heads) == ["hydra"]
    engine = SpeculativeEngine(tiny_target, None, profile=lambda *_: tiny_profile(), heads=heads)
    for seed in (0, 3):
        prompt, sampling = repeating_prompt(seed), {"max_tokens": 32}
        reference = engine.complete(GenerationRequest(prompt_ids=prompt, drafter={"name": "none"}, sampling=sampling))
        request = GenerationRequest(prompt_ids=prompt, drafter={"name": "heads"}, sampling=sampling)
        hydra, medusa = engine.complete(request), heads_engine.complete(request)
        assert hydra.token_ids == medusa.token_ids == reference.token_ids
        assert hydra.metrics["spec_decode_num_accepted_tokens"] == medusa.metrics["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("tree", ["mc_sim_7b_63", "chain_4"])
def test_greedy_decoding_with_hydra_heads_equals_target_only(hydra_engine, tree):
    for seed in (1, 4):
        prompt, sampling = repeating_prompt(seed), {"max_tokens": 40}
        reference = hydra_engine.complete(
            GenerationRequest(prompt_ids=prompt, drafter={"name": "none"}, sampling=sampling)
        )
        run = hydra_engine.complete(
            GenerationRequest(prompt_ids=prompt, drafter={"name": "heads", "params": {"tree": tree}}, sampling=sampling)
        )
        assert run.token_ids == reference.token_ids
        assert run.metrics["spec_decode_num_accepted_tokens"] > 0


def test_unsupported_hydra_checkpoints_are_refused_with_a_message(tmp_path):
    target = tiny_llama()
    hydra = published_hydra(target, "mlp", 1)
    for config, message in [
        ({"hydra_head_arch": "cross-attn"}, "architecture 'cross-attn' is not supported"),
        ({"hydra_head_arch": "mlp", "hidden_state_offset": 2}, "hidden_state_offset"),
    ]:
        hydra.save(tmp_path, "mlp")
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            load_heads(str(tmp_path), "tiny", target)
    torch.save({**hydra.state_dict(), "lm_head.weight": torch.zeros(2, 2)}, tmp_path / "hydra_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"hydra_head_arch": "mlp"}))
    with pytest.raises(ValueError, match="not a Hydra head weight"):
        load_heads(str(tmp_path), "tiny", target)


def test_only_heads_sessions_run_the_heads_and_a_worker_reserves_their_prefix_cache(tmp_path):
    """A target worker with Hydra++ heads runs them (and their prefix layer's cache) only for the
    sessions reset with `heads_kind`, and admits those for the prefix cache too."""
    grpc = pytest.importorskip("grpc")
    from deployments.coordination.wire import component_to_proto, sampling_to_proto
    from deployments.workers.admission import Admission
    from deployments.workers.servicers import TargetServicer, start_server
    from deployments.workers.target_service import TargetService
    from protos import specdec_pb2 as pb
    from protos import specdec_pb2_grpc as pb_grpc
    from specdec_core.api.request import ComponentSpec
    from specdec_core.api.sampling import SamplingParams

    target = tiny_llama()
    published_hydra(target, "prefix-mlp", 1).save(tmp_path, "prefix-mlp")
    heads = load_heads_from(str(tmp_path), target)
    config = target.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert heads.cache_bytes_per_token() == 2 * config.num_key_value_heads * head_dim * 4  # one fp32 layer
    service = TargetService(target, 60.0, admission=Admission(None, 4, 1.0), heads={"hydra": heads})
    server, port = start_server(TargetServicer(service), pb_grpc.add_TargetServicer_to_server)
    stub = pb_grpc.TargetStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    prompt, sampling = [1, 2, 3], SamplingParams(max_tokens=8)
    try:
        for session_id, heads_kind in (("plain", ""), ("heads", "hydra")):
            reset = pb.TargetReset(
                session_id=session_id,
                prompt_ids=prompt,
                sampling=sampling_to_proto(sampling),
                policy=component_to_proto(ComponentSpec(name="greedy")),
                heads_kind=heads_kind,
            )
            stub.Reset(reset)
        reserved = service.admission.reserved
        extra = reserved["heads"] - reserved["plain"]
        assert extra == pytest.approx(service.max_len(prompt, sampling) * heads.cache_bytes_per_token())
        assert service.session("plain").heads_session is None
        assert service.session("heads").heads_session.cache is not None  # the prefix layer's
        assert len(stub.Heads(pb.HeadsRequest(session_id="heads", root_token=3, tree="chain_2")).tokens.shape) == 1
        with pytest.raises(grpc.RpcError) as raised:
            stub.Heads(pb.HeadsRequest(session_id="plain", root_token=3, tree="chain_2"))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "heads_kind" in raised.value.details()
    finally:
        server.stop(None)
