"""The engine on a CUDA device (skipped without one): models, caches and policy tensors on the GPU,
greedy speculation still token-identical to target-only decoding, sampling reproducible."""

from __future__ import annotations

import pytest
import torch

from specdec_core import GenerationRequest, SpeculativeEngine
from specdec_core.api.sampling import SamplingParams
from specdec_core.policies import POLICIES
from specdec_core.runtime.model_runner import runner_of
from specdec_core.target.scorer import TargetScorer

from helpers.deciding_target import decided_beside_rows
from helpers.tiny_models import repeating_prompt, tiny_llama, tiny_profile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_engine():
    target = tiny_llama(seed=0, prepared=False).to("cuda")
    draft = tiny_llama(seed=0, prepared=False)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.002 * torch.randn_like(parameter))
    return SpeculativeEngine(target, None, draft.to("cuda"), profile=lambda *_: tiny_profile())


def request(policy: str, drafter: str, temperature: float = 0.0, seed: int = 0) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=repeating_prompt(5),
        policy={"name": policy},
        drafter={"name": drafter},
        num_draft_tokens=6,
        sampling={"max_tokens": 32, "temperature": temperature, "seed": seed},
    )


@pytest.mark.parametrize("drafter", ["pld", "model", "mla"])
def test_greedy_speculation_on_cuda_equals_target_only(cuda_engine, drafter):
    target_only = cuda_engine.complete(request("greedy", "none")).token_ids
    assert cuda_engine.complete(request("greedy", drafter)).token_ids == target_only


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_decides_on_the_device(cuda_engine, policy):
    temperature = 0.8 if POLICIES[policy].supports_sampling else 0.0
    runs = [cuda_engine.complete(request(policy, "model", temperature, seed=3)).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 32


@pytest.mark.parametrize(
    ("policy", "drafter"), [("rejection", "model"), ("typical", "pld"), ("rejection", "model_tree")]
)
def test_sampled_verdicts_decided_beside_cuda_rows_are_the_loops(cuda_engine, policy, drafter):
    """A served target worker's way (target/verdicts.py) on the device: its rows processed there
    (penalties, logit_bias, min_tokens' stops) and decided there give the loop's own tokens."""
    free = cuda_engine.complete(request(policy, drafter, 0.8)).token_ids
    sampling = {"max_tokens": 32, "temperature": 0.8, "seed": 0, "min_tokens": 10, "stop_token_ids": free[1:3]}
    sampling.update(presence_penalty=0.6, repetition_penalty=1.3, logit_bias={free[5]: 2.0})
    req = request(policy, drafter, 0.8).model_copy(update={"sampling": SamplingParams(**sampling)})
    assert decided_beside_rows(cuda_engine, req) == cuda_engine.complete(req).token_ids


def host_synchronizations(call):
    """`call()`'s result and the host synchronizations it made (CUDA's sync debug warnings)."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return result, [str(warning.message) for warning in caught if "synchroniz" in str(warning.message)]


def decided_once_as_on_the_cpu(checks, decide) -> list:
    """`decide`'s verdicts over `checks("cuda")`: one host synchronization (the read back), and
    each as over `checks("cpu")` but for rare fp32 rounding."""
    on_cuda = checks("cuda")
    verdicts, syncs = host_synchronizations(lambda: decide(on_cuda))
    assert len(syncs) == 1, syncs
    on_cpu = decide(checks("cpu"))
    outcomes = [[(each.num_accepted, each.next_token, each.path) for each in run] for run in (verdicts, on_cpu)]
    agreeing = sum(a == b for a, b in zip(*outcomes))
    assert agreeing >= len(verdicts) - 2  # fp32 softmax rounding may move a draw across a boundary, rarely
    return verdicts


SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def chain_checks(device: str) -> list:
    """16 requests' sampled chains, rejection and typical, sampled and one-hot drafts."""
    from specdec_core.api.sampling import SamplingParams, sampling_probs
    from specdec_core.loop.stage_types import DraftBlock, TargetBlock
    from specdec_core.policies import make_policy
    from specdec_core.policies.sampled_chains import Check

    sampling, made = SamplingParams(**SAMPLED), []
    for index in range(16):
        target_logits = 3 * torch.randn(5, 1000, generator=torch.Generator().manual_seed(index))
        draft_logits = target_logits[:4] + torch.randn(4, 1000, generator=torch.Generator().manual_seed(99 + index))
        tokens = draft_logits.argmax(-1)
        probs = sampling_probs(draft_logits, sampling).gather(-1, tokens[:, None]).squeeze(-1)
        draft = DraftBlock(tokens, draft_logits, probs) if index % 3 else DraftBlock(tokens)
        policy = make_policy("rejection" if index % 2 else "typical")
        target = TargetBlock(target_logits.to(device))
        made.append(
            Check(policy, draft.to(torch.device(device)), target, sampling, torch.Generator().manual_seed(index))
        )
    return made


def tree_checks(device: str) -> list:
    """16 requests' sampled trees of 4 shapes, each shape under rejection and typical."""
    from specdec_core.api.sampling import SamplingParams
    from specdec_core.loop.stage_types import DraftBlock, TargetBlock
    from specdec_core.policies import make_policy
    from specdec_core.policies.sampled_chains import Check
    from specdec_core.trees.topologies import default_bank

    bank, sampling, made = default_bank(), SamplingParams(**SAMPLED), []
    for index in range(16):
        tree = bank.get(["mc_sim_7b_63", "medusa_16", "spine_6x3", "chain_4"][index // 2 % 4])
        target_logits = 3 * torch.randn(tree.num_nodes + 1, 1000, generator=torch.Generator().manual_seed(index))
        tokens = target_logits[tree.parents[1:]].topk(4).indices[:, index % 4]  # [N] a near guess
        draft, target = DraftBlock(tokens.to(device), tree=tree), TargetBlock(target_logits.to(device))
        policy = make_policy("rejection" if index % 2 else "typical")
        made.append(Check(policy, draft, target, sampling, torch.Generator().manual_seed(index)))
    return made


def test_a_steps_sampled_chains_are_decided_with_one_read_back():
    """policies/sampled_chains.py on the device: the chains synchronize the host once, at the read
    back, and decide as on the CPU."""
    from specdec_core.policies.sampled_chains import decide_chains

    decided_once_as_on_the_cpu(chain_checks, decide_chains)


def test_a_steps_sampled_trees_are_decided_with_one_read_back():
    """policies/sampled_trees.py on the device: the trees synchronize the host once, at the read
    back, and decide as on the CPU; each rule takes some paths past the root."""
    from specdec_core.policies.sampled_trees import decide_trees

    decided_once_as_on_the_cpu(tree_checks, decide_trees)
    on_cpu = decide_trees(tree_checks("cpu"))  # (the data's, not the device's: one tree may round otherwise there)
    for rule in (0, 1):  # typical's (even), rejection's (odd)
        assert any(len(verdict.path) > 1 for verdict in on_cpu[rule::2])


def test_a_steps_chains_and_trees_share_one_read_back():
    """policies/step_verdicts.py: a step of both chains and trees synchronizes the host once."""
    from specdec_core.policies.step_verdicts import decide_together

    decided_once_as_on_the_cpu(lambda device: chain_checks(device) + tree_checks(device), decide_together)


def test_cuda_logits_match_the_cpu_in_fp32():
    cpu_model = tiny_llama(seed=1, prepared=False)
    cuda_model = tiny_llama(seed=1, prepared=False).to("cuda")
    blocks = []
    for model in (cpu_model, cuda_model):
        scorer = TargetScorer(model)
        scorer.reset(repeating_prompt(2), POLICIES["greedy"](), request("greedy", "none").sampling)
        blocks.append(scorer.score([1, 2, 3, 4]).logits.cpu())
    assert (blocks[0] - blocks[1]).abs().max() < 1e-4


def test_a_fraction_of_the_card_sizes_the_pool_once():
    """gpu_memory_utilization: the pool gets the fraction less the weights and a profiled step,
    is allocated at the first forward and never grows."""
    from specdec_core.planning.kv_budget import kv_budget
    from specdec_core.planning.memory import kv_bytes_per_token
    from specdec_core.runtime.batching import fix_pool, forward_ragged
    from specdec_core.runtime.kv_pool import PagedKV

    model = tiny_llama(seed=0, prepared=False).to("cuda")
    total = torch.cuda.mem_get_info()[1]
    budget = kv_budget(model, None, utilization=0.25, profile_tokens=512)
    assert 0 < budget < 0.25 * total
    bytes_per_token = kv_bytes_per_token(model.config, 1, 4)
    pool = fix_pool(model, budget, bytes_per_token)
    forward_ragged(model, [PagedKV()], [repeating_prompt(5)])
    block = bytes_per_token * pool.block_size
    stored = pool.keys.numel() * pool.keys.element_size() * 2 - block  # less the scratch block
    assert not pool.growable and budget - block < stored <= budget
    del pool, model
    torch.cuda.empty_cache()


def test_cuda_graphs_pool_is_measured_for_the_kv_budget():
    """A model whose steps replay CUDA graphs has their pool's activations taken from its KV budget
    (kv_budget.graph_pool_bytes), measured eagerly: no graph is recorded by the measure."""
    from specdec_core.planning.kv_budget import graph_pool_bytes
    from specdec_core.runtime.model_runner import use_step_graphs

    model = tiny_llama(seed=0, prepared=False).to("cuda")
    assert graph_pool_bytes(model) == 0.0
    graphs = use_step_graphs(model)
    assert graph_pool_bytes(model) > 0 and runner_of(model.model).graphs is graphs and graphs.recorded == 0


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
)
def test_an_fp8_checkpoint_multiplies_in_fp8_within_its_rounding(tmp_path):
    """On Ada/Hopper an FP8 checkpoint's linears are Fp8Linear (FP8 matmuls, activations scaled
    per token): logits within 5% (relative norm) of the bf16 model of the same de-quantized weights."""
    from specdec_core.models.kernels.fp8 import Fp8Linear
    from specdec_core.models.loader import ModelSpec, load_model

    from helpers.fp8_checkpoints import FORMATS, write_fp8_checkpoint

    original = tiny_llama(seed=2, prepared=False)
    expected = write_fp8_checkpoint(original, tmp_path, FORMATS["fbgemm_fp8"])
    model = load_model(ModelSpec(source=str(tmp_path), dtype="bfloat16", device="cuda"))
    assert all(isinstance(model.get_submodule(name), Fp8Linear) for name in expected)
    reference = tiny_llama(seed=2, prepared=False)
    for name, weight in expected.items():
        reference.get_submodule(name).weight.data.copy_(weight)
    reference = reference.to("cuda", torch.bfloat16)
    tokens = torch.tensor([repeating_prompt(3)], device="cuda")
    with torch.inference_mode():
        got, want = (m(tokens).logits[0].float() for m in (model, reference))
    assert (got - want).norm() < 0.05 * want.norm()


def graphed_pair(compiled_layers_in=None, paged: bool = False) -> SpeculativeEngine:
    """cuda_engine's target with its steps replayed as CUDA graphs (step_graphs.py), beside a draft
    graphed too; with a cache folder, both compiled by layer first (compiled_layers.py); `paged`:
    both on the paged attention kernel."""
    from specdec_core.runtime.compiled_layers import compile_layers
    from specdec_core.runtime.model_runner import use_paged_attention, use_step_graphs

    target = tiny_llama(seed=0, prepared=False).to("cuda")
    draft = tiny_llama(seed=0, prepared=False)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.002 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    draft = draft.to("cuda")
    for model in (target, draft):
        if compiled_layers_in is not None:
            compile_layers(model, compiled_layers_in)
        if paged:
            use_paged_attention(model)
        use_step_graphs(model)
    return SpeculativeEngine(target, None, draft, profile=lambda *_: tiny_profile())


@pytest.fixture(scope="module")
def graphed_engine():
    return graphed_pair()


@pytest.mark.parametrize("drafter", ["pld", "model", "mla"])
def test_greedy_speculation_with_compiled_layers_and_graphs_equals_its_target_only(tmp_path_factory, drafter):
    """Inductor's fused kernels round fp32 differently from eager ones: the invariant is within
    one model, compiled and graphed, against its own target-only output."""
    engine = graphed_pair(tmp_path_factory.mktemp("compiled"))
    target_only = engine.complete(request("greedy", "none")).token_ids
    for _ in range(2):  # the first request compiles and records, the second replays
        assert engine.complete(request("greedy", drafter)).token_ids == target_only
    assert runner_of(engine.target_model.model).graphs.recorded > 0


@pytest.mark.parametrize("drafter", ["pld", "model", "mla", "model_tree"])
def test_greedy_speculation_on_the_paged_kernel_and_graphs_equals_its_target_only(drafter):
    """kernels/paged_attention.py in the step, graphed: against its own target-only output (its
    fp32 sums run in another order than SDPA's). The draft model's chains run their followed
    forwards as one recorded graph (chained_steps.py)."""
    engine = graphed_pair(paged=True)
    target_only = engine.complete(request("greedy", "none")).token_ids
    for _ in range(2):  # the first request records, the second replays
        assert engine.complete(request("greedy", drafter)).token_ids == target_only
    assert runner_of(engine.target_model.model).graphs.recorded > 0
    chained = [kind for kind, *_ in runner_of(engine.draft_model.model).graphs.graphs if kind != "step"]
    assert bool(chained) == (drafter == "model")


@pytest.mark.parametrize("drafter", ["none", "pld", "model", "mla"])
def test_greedy_speculation_with_cuda_graphs_equals_eager_target_only(cuda_engine, graphed_engine, drafter):
    target_only = cuda_engine.complete(request("greedy", "none")).token_ids
    for _ in range(2):  # the first request records, the second replays
        assert graphed_engine.complete(request("greedy", drafter)).token_ids == target_only
    assert runner_of(graphed_engine.target_model.model).graphs.recorded > 0


@torch.inference_mode()
def test_a_replayed_step_keeps_the_states_eagle3_reads():
    """The kept layer inputs (aux_states.py) after a replay are the replayed step's, not the
    recording's: two steps of one shape and different tokens, against an eager twin. Keeping
    them drops the graphs recorded before (and their memory pool); the next step records anew."""
    from specdec_core.runtime.batching import forward_ragged
    from specdec_core.runtime.kv_pool import PagedKV
    from specdec_core.runtime.model_runner import use_step_graphs
    from specdec_core.target.aux_states import aux_states, keep_aux_states

    graphed, eager = (tiny_llama(seed=2, prepared=False).to("cuda") for _ in range(2))
    use_step_graphs(graphed)
    caches = []
    for model in (graphed, eager):
        caches.append(PagedKV())
        forward_ragged(model, [caches[-1]], [repeating_prompt(4)])  # allocates the pool: eager
        forward_ragged(model, [caches[-1]], [[1, 2, 3]])  # recorded
        keep_aux_states(model, [0, 1])
    assert runner_of(graphed.model).graphs.recorded == 1 and not runner_of(graphed.model).graphs.graphs
    for tokens in ([5, 6], [9, 10]):  # after 27 positions: both steps pad to 2 tokens over 32 keys
        states = []
        for model, cache in zip((graphed, eager), caches):
            forward_ragged(model, [cache], [tokens])
            states.append(aux_states(model, len(tokens)))
        torch.testing.assert_close(states[0], states[1], atol=1e-4, rtol=0)
    assert runner_of(graphed.model).graphs.recorded == 2


@pytest.mark.parametrize("rows, tokens, history", [(64, 5, 352), (1, 1, 2000), (3, 5, 40)])
def test_the_paged_attention_kernel_equals_sdpa_and_replays_in_a_cuda_graph(rows, tokens, history):
    """kernels/paged_attention.py at Llama-3.1-8B's heads in bf16, against SDPA in fp32 over the
    gathered keys; recorded in a CUDA graph (it reads nothing back to the host), its replay the same."""
    from specdec_core.models.kernels.paged_attention import paged_attention

    from helpers.paged_rows import causal, random_paged_arguments, sdpa_reference

    arguments = random_paged_arguments(
        [history + tokens] * rows, [causal(tokens)] * rows, 32, 8, 128, dtype=torch.bfloat16, device="cuda"
    )
    output = paged_attention(**arguments)
    torch.testing.assert_close(output.float().cpu(), sdpa_reference(arguments), atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged_attention(**arguments)
    arguments["query"].copy_(torch.randn_like(arguments["query"]))  # a later step's queries, in place
    arguments["seq_lens"].sub_(tokens)  # and shorter rows
    graph.replay()
    torch.testing.assert_close(captured, paged_attention(**arguments), atol=0, rtol=0)


def test_a_tensor_parallel_ranks_graphs_hold_its_nccl_collectives(tmp_path):
    """A rank of a tensor-parallel group (load_sharded_model; here a group of one on NCCL, the
    card being one) records its steps' graphs with the group's collectives inside: an all-reduce
    on each layer's attention output, where a row-wise projection's would be. Greedy speculation
    over its graphs equals the same rank's eager target-only output."""
    import torch.distributed as dist

    from specdec_core.models.loader import ModelSpec
    from specdec_core.models.parallel import join_group, leave_group, load_sharded_model, open_store

    tiny_llama(seed=0, prepared=False).save_pretrained(tmp_path)
    store = open_store("127.0.0.1", 1, 60)
    join_group(0, 1, "127.0.0.1", store.port, 60, store=store)
    engines = {}
    try:
        for graphs in (True, False):
            model = load_sharded_model(ModelSpec(source=str(tmp_path), cuda_graphs=graphs), "transformers")
            for layer in model.model.layers:
                layer.self_attn.o_proj.register_forward_hook(lambda _module, _inputs, output: dist.all_reduce(output))
            engines[graphs] = SpeculativeEngine(model, None, None, profile=lambda *_: tiny_profile())
        assert runner_of(engines[True].target_model.model).graphs.record
        assert runner_of(engines[False].target_model.model).graphs is None
        target_only = engines[False].complete(request("greedy", "none")).token_ids
        for drafter in ("none", "pld", "none"):  # the first request records, the last replays
            assert engines[True].complete(request("greedy", drafter)).token_ids == target_only, drafter
        assert runner_of(engines[True].target_model.model).graphs.recorded > 0
    finally:
        leave_group(*(engine.target_model for engine in engines.values()))
