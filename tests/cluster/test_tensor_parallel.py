"""A target sharded over 2 ranks on CPU (gloo), by both backends (specdec_core/models/parallel.py): every
rank's logits and policy features equal one process's, before and after a rollback. Each rank is
a process of its own; the served group over Ray is tested in test_serve.py."""

from __future__ import annotations

import pytest
import torch

from deployments.workers.target_service import TargetService
from deployments.workers.tensor_parallel import ControlChannel
from specdec_core.api.sampling import SamplingParams
from specdec_core.models.loader import ModelSpec, load_model
from specdec_core.models.parallel import join_group, leave_group, load_sharded_model, run_local_ranks, shard_problem
from specdec_core.policies import make_policy
from specdec_core.runtime.model_runner import runner_of, use_step_graphs
from specdec_core.target.scorer import Row, TargetScorer, forward_rows

from helpers.tiny_models import TINY_VOCAB, tiny_llama

PROMPT = [5, 17, 42, 99, 3, 7, 250, 11]
FIRST_BLOCK = [11, 61, 300, 2, 77, 140]  # [the prompt's last token, 5 drafts]
KEEP = 3  # a rejection: keep 3 of the 6 scored tokens
SECOND_BLOCK = [19, 23, 400]
SAMPLING = SamplingParams(temperature=0.0, seed=4)


def steps(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, DropMatch path tokens) of two verify steps with a rollback between them, then of
    two steps of three sessions together (a prompt chunk between two verify rows, then two
    verify rows: a pipeline runs each as micro-batches)."""
    policy = make_policy("dropmatch", {"dropout": 0.3})
    scorer = TargetScorer(model)
    scorer.reset(PROMPT, policy, SAMPLING)
    first = scorer.score(FIRST_BLOCK)
    scorer.commit(KEEP)
    second = scorer.score(SECOND_BLOCK)
    blocks = [first, second]
    other, late = TargetScorer(model), TargetScorer(model)
    other.reset(PROMPT[::-1], policy, SAMPLING)
    scorer.commit(2)
    late_prompt = PROMPT * 8  # 72 tokens in the step: 2 micro-batches of a pipeline's 2 stages
    prefill = late.start(late_prompt, policy, SAMPLING)
    blocks += forward_rows([Row(scorer, SECOND_BLOCK), Row(late, prefill, prefill=True), Row(other, FIRST_BLOCK)])
    scorer.commit(1)
    blocks += forward_rows([Row(late, [late_prompt[-1], *SECOND_BLOCK]), Row(scorer, FIRST_BLOCK[::-1])])
    return [(block.logits, block.features["path_tokens"]) for block in blocks if block is not None]


def vocabulary_rows(module) -> int | None:
    """The rows of the vocabulary a rank holds of an embedding or LM head (None: it holds none)."""
    module = getattr(module, "head", module)  # a pipeline stage's head wraps the stage's own, if any
    if module is None:
        return None
    weight = module.weight
    return (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]


def rank_main(
    rank: int,
    world_size: int,
    port: int,
    checkpoint: str,
    backend: str,
    pp: int,
    num_layers=None,
    attention: str = "sdpa",
    graphs: bool = False,
):
    """`graphs`: the steps over static buffers as CUDA graphs replay them (use_step_graphs without
    recording, the CPU's stand-in). Returns the steps' (logits, paths), the smallest budget, the
    vocabulary rows of its ends, (whether it took the paged kernel, graphs recorded or None) and the
    KV bytes a position takes in its worker's pool."""
    torch.set_num_threads(1)
    group = join_group(rank, world_size, "127.0.0.1", port, timeout_s=120)
    model = load_sharded_model(ModelSpec(source=checkpoint, num_layers=num_layers, attention=attention), backend, pp)
    step_graphs = use_step_graphs(model, record=False) if graphs else None
    smallest_budget = ControlChannel(group).smallest(10.0 * (rank + 1))  # how the ranks size their pools
    with torch.no_grad():
        # numpy arrays travel by value (a tensor's shared memory would die with this process)
        scored = [(logits.numpy(), paths.numpy()) for logits, paths in steps(model)]
    ends = (vocabulary_rows(model.get_input_embeddings()), vocabulary_rows(model.get_output_embeddings()))
    steps_on = (runner_of(model.model).paged, step_graphs.recorded if step_graphs is not None else None)
    kv_bytes = TargetService(model).kv_bytes_per_token  # as a follower's service sizes its pool (no channel)
    leave_group(model)
    return scored, smallest_budget, ends, steps_on, kv_bytes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "target"
    tiny_llama(seed=3, prepared=False).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """The same tiny model with its decoder linears in FP8 (Meta's fbgemm_fp8 format)."""
    from helpers.fp8_checkpoints import FORMATS, write_fp8_checkpoint

    path = tmp_path_factory.mktemp("tp") / "fp8"
    write_fp8_checkpoint(tiny_llama(seed=3, prepared=False), path, FORMATS["fbgemm_fp8"])
    return str(path)


def sharded_steps(
    checkpoint: str,
    backend: str,
    world_size: int = 2,
    pp: int = 1,
    num_layers=None,
    attention: str = "sdpa",
    graphs: bool = False,
) -> dict:
    """Each rank's rank_main outcome from `world_size` processes loading `checkpoint` (its first
    `num_layers`) sharded: `pp` pipeline stages of world_size / pp tensor-parallel ranks."""
    arguments = (checkpoint, backend, pp, num_layers, attention, graphs)
    outputs = run_local_ranks(world_size, rank_main, *arguments, timeout_s=180)
    return dict(enumerate(outputs))


def assert_every_rank_scores_as(outputs: dict, reference) -> None:
    for rank, (rank_steps, smallest_budget, *_) in outputs.items():
        assert smallest_budget == 10.0
        for (logits, paths), (want_logits, want_paths) in zip(rank_steps, reference):
            assert (torch.from_numpy(logits) - want_logits).abs().max() < 1e-5, rank
            assert torch.equal(torch.from_numpy(paths), want_paths)  # the same seeded masks on every rank


@pytest.mark.parametrize("backend", ["transformers", "deepspeed"])
def test_every_rank_of_a_sharded_target_scores_as_one_process(checkpoint, backend):
    reference_model = tiny_llama(seed=3, prepared=False)
    with torch.no_grad():
        reference = steps(reference_model)
        # after the rollback the cache holds the prompt and KEEP - 1 drafts: a fresh forward over them
        committed = PROMPT[:-1] + FIRST_BLOCK[:KEEP] + SECOND_BLOCK
        fresh = reference_model(torch.tensor([committed])).logits[0, -len(SECOND_BLOCK) :]
    assert torch.allclose(reference[1][0], fresh, atol=1e-5)
    outputs = sharded_steps(checkpoint, backend)
    assert_every_rank_scores_as(outputs, reference)
    # every rank's pool holds half the KV heads, rank 0's as the others' (a full pool is full on all)
    whole = TargetService(reference_model).kv_bytes_per_token
    assert [rank_kv_bytes for *_, rank_kv_bytes in outputs.values()] == [whole / 2, whole / 2]


def test_tensor_parallel_ranks_step_on_the_paged_kernel_and_graphs_static_buffers(checkpoint):
    """A rank of a tensor-parallel group takes the paged kernel (here under Triton's interpreter) and
    its steps replay graphs with its collectives inside (on the CPU, eagerly over the graphs' static
    buffers): every rank scores as one eager process, and all ranks recorded the same graphs."""
    with torch.no_grad():
        reference = steps(tiny_llama(seed=3, prepared=False))
    outputs = sharded_steps(checkpoint, "transformers", attention="paged", graphs=True)
    assert_every_rank_scores_as(outputs, reference)
    assert_every_rank_steps_on_graphs(outputs, paged=True)


def assert_every_rank_steps_on_graphs(outputs: dict, paged: bool) -> None:
    """Every rank took the paged kernel or not, and recorded the same number of graphs (several)."""
    steps_on = {steps_on for _, _, _, steps_on, _ in outputs.values()}
    assert len(steps_on) == 1, steps_on
    took_paged, recorded = steps_on.pop()
    assert took_paged == paged and recorded >= 3, (took_paged, recorded)


def test_an_fp8_checkpoint_shards_its_fp8_linears_and_scores_as_one_process(fp8_checkpoint):
    """Each rank reads its rows (q, k, v, gate, up, with their scales) or columns (o, down) of the
    FP8 linears; transformers' tensor-parallel forwards all-reduce the rowwise outputs."""
    with torch.no_grad():
        reference = steps(load_model(ModelSpec(source=fp8_checkpoint, device="cpu")))
    outputs = sharded_steps(fp8_checkpoint, "transformers")
    assert_every_rank_scores_as(outputs, reference)
    # the embedding whole on each rank, the (untied) LM head split over the vocabulary
    assert {ends for _, _, ends, *_ in outputs.values()} == {(TINY_VOCAB, TINY_VOCAB // 2)}


def test_a_model_splits_only_over_a_divisor_of_its_heads():
    smollm2_like = type("Config", (), {"num_attention_heads": 9, "num_key_value_heads": 3})
    assert shard_problem(smollm2_like, 3) is None
    assert "valid: 1, 3" in shard_problem(smollm2_like, 2)


def all_reduce_after_a_peer_left(rank: int, world_size: int, store_port: int) -> str:
    """Rank 1 leaves (its process ends); rank 0 then all-reduces, as a forward's collective would:
    what `group_gone` makes of the error."""
    import time

    import torch.distributed as dist

    from deployments.workers.tensor_parallel import group_gone

    join_group(rank, world_size, "127.0.0.1", store_port, 60)
    if rank == 1:
        return ""
    time.sleep(2)  # rank 1's process has ended: its connections are closed
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as error:
        return type(group_gone(error)).__name__
    return "no error"


def test_a_collective_that_breaks_on_a_gone_peer_is_the_group_broken_not_a_bug():
    """A rank killed mid-forward breaks rank 0's all-reduce inside the operation, not its send:
    that failure is GroupBroken too (a 503 and Serve's restart of the group), and another
    RuntimeError stays what it is."""
    from deployments.workers.tensor_parallel import group_gone

    assert run_local_ranks(2, all_reduce_after_a_peer_left, timeout_s=120)[0] == "GroupBroken"
    assert group_gone(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None


def group_after_failures(rank: int, world_size: int, store_port: int, checkpoint: str) -> dict:
    """Two ranks' target services over the sharded target, rank 0 sending each operation and rank 1
    following (as a served worker's ranks): an operation that fails alike on both (a step of a
    missing session), then a step that both score, then one that fails on rank 1 alone (a CUDA
    error, as a graph's capture may meet on one rank) while rank 0 runs its forward. Rank 0's
    outcomes, by name; rank 1 answers nothing (its process ends). The group's collectives time
    out after the test's cap."""
    from deployments.workers.worker_ops import Release, TargetRow, TargetStep
    from specdec_core.api.request import ComponentSpec

    torch.set_num_threads(1)
    group = join_group(rank, world_size, "127.0.0.1", store_port, 600)
    model = load_sharded_model(ModelSpec(source=checkpoint), "transformers", 1)
    channel = ControlChannel(group)
    service = TargetService(model, channel=channel if rank == 0 else None, rank=rank)
    if rank == 1:
        step = service.operations[TargetStep]

        def failing_on_this_rank(op: TargetStep):
            if op.rows[0].tokens == SECOND_BLOCK:
                raise RuntimeError("CUDA error: out of memory (injected on rank 1)")
            return step(op)

        service.operations[TargetStep] = failing_on_this_rank
        service.follow(channel)
        return {"followed": "to the group's end"}
    outcomes = {}
    service.reset("a", PROMPT, ComponentSpec(name="greedy"), SAMPLING, None)
    try:
        service.run(TargetStep(rows=[TargetRow(session_id="missing", tokens=[1])]))
    except Exception as error:  # noqa: BLE001 - its kind is the outcome
        outcomes["alike"] = type(error).__name__
    block = service.run(TargetStep(rows=[TargetRow(session_id="a", tokens=FIRST_BLOCK)]))[0]
    outcomes["scored"] = list(block.logits.shape)
    for name, op in (
        ("alone", TargetStep(rows=[TargetRow(session_id="a", tokens=SECOND_BLOCK, commit_keep=KEEP)])),
        ("after", Release(session_id="a")),
    ):
        try:
            service.run(op)
        except Exception as error:  # noqa: BLE001 - its kind is the outcome
            outcomes[name] = type(error).__name__
    outcomes["broken"] = service.broken
    return outcomes


def test_a_rank_that_fails_an_operation_alone_ends_and_rank_0_does_not_wait_on_it(checkpoint):
    """A failure every rank meets alike (the operation's own error) keeps the group serving. One
    that strikes a rank alone may leave the ranks' sessions apart: that rank's process ends, so rank
    0's forward, waiting on it in an all-reduce, fails as GroupBroken (a 503, not a hang); rank 0
    then refuses every operation and fails its health check (WorkerRank.ping), and Serve rebuilds
    the group."""
    import multiprocessing
    import queue

    from deployments.workers.worker_service import FAILED_ALONE_EXIT
    from specdec_core.models.parallel import open_store, report_rank

    store = open_store("127.0.0.1", 2, 600)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [
        context.Process(target=report_rank, args=(results, group_after_failures, rank, 2, store.port, checkpoint))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    try:
        rank, outcomes = results.get(timeout=240)
        ranks[1].join(timeout=30)
    except queue.Empty:
        pytest.fail("rank 0 is still waiting on rank 1")
    finally:
        for process in ranks:
            process.kill()
    assert rank == 0, outcomes  # rank 1 went on following
    assert outcomes["alike"] == "SessionMissing" and outcomes["scored"] == [len(FIRST_BLOCK), TINY_VOCAB]
    assert outcomes["alone"] == "GroupBroken" and outcomes["after"] == "GroupBroken"
    assert "gone" in outcomes["broken"]
    assert ranks[1].exitcode == FAILED_ALONE_EXIT
