"""Context parallelism (Ulysses, `rayft.parallel.context`) on gloo ranks: one packed micro-batch of several documents
with a completion-only mask, split over N ranks, gives the loss and the LoRA gradients of the whole micro-batch on
one rank (fp32, 1e-5 relative), for a dense GQA family and the tiny Mistral-Small-4 (MLA), and for the latter also
with its routed experts split over expert-parallel groups (the layout a config of both asks for).

The reference is transformers' own path on the whole rows: the model's SDPA attention with its packed-sequence mask
from `position_ids`, and the model's own loss from its logits (`labels`), with no rayft code in it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from conftest import Fixtures, free_port, tiny_config
from fixtures.families import FAMILIES, TINY
from fixtures.hub_layout import TINY_MISTRAL4
from fixtures.local_run import LocalRun, train_locally
from fixtures.ranks import spawn_ranks
from safetensors.torch import load_file

if TYPE_CHECKING:
    from rayft.parallel.expert import ExpertParallel
    from rayft.parallel.layout import ParallelDims

DOCS = [(3, 6), (2, 5), (4, 4), (0, 1)]  # (prompt, completion) tokens of the packed documents of a row: 25 tokens
# Gradient norms and trained adapters after a few steps: the same sums over the tokens in another order (per shard,
# then over the ranks) in fp32, near a uniform softmax over 131k logits (as test_local_trainer's REORDERED).
REORDERED = 1e-4
LORA_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral4": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}


def _model(family: str, experts: bool = False) -> torch.nn.Module:
    """A random tiny model (seeded: every rank builds the same one) with random LoRA factors (B ≠ 0, so that both
    factors have gradients); `experts`: LoRA on the routed experts too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, Mistral4Config, Mistral4ForCausalLM

    torch.manual_seed(0)
    if family == "mistral4":  # the text model of Mistral-Small-4 (the vision tower never sees a long row)
        config = Mistral4Config(**{**TINY_MISTRAL4, "vocab_size": 256}, attn_implementation="sdpa")
        model = Mistral4ForCausalLM(config).float()
    else:
        config = AutoConfig.for_model(family, vocab_size=256, **TINY, **FAMILIES[family])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else None
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=LORA_TARGETS[family], target_parameters=parameters, init_lora_weights=False
    )
    return get_peft_model(model, lora)


def _batch(rows: int) -> dict[str, torch.Tensor]:
    """Packed rows: documents back to back, position ids restarting at each, prompts unscored; 25 tokens, so
    that the rows are padded to a multiple of N."""
    gen = torch.Generator().manual_seed(1)
    ids, labels, positions = [], [], []
    for _ in range(rows):
        row_ids, row_labels, row_pos = [], [], []
        for prompt, completion in DOCS:
            tokens = torch.randint(3, 256, (prompt + completion,), generator=gen)
            row_ids.append(tokens)
            row_labels.append(torch.cat([torch.full((prompt,), -100), tokens[prompt:]]))
            row_pos.append(torch.arange(prompt + completion))
        ids.append(torch.cat(row_ids))
        labels.append(torch.cat(row_labels))
        positions.append(torch.cat(row_pos))
    return {"input_ids": torch.stack(ids), "labels": torch.stack(labels), "position_ids": torch.stack(positions)}


def _lora_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _layout(world: int, context: int, experts: int) -> ParallelDims:
    """The layout a config of `world` workers on one node with both degrees gets, as a worker builds it."""
    from rayft.config import Config
    from rayft.demo import demo_config
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.topology import Topology

    raw = demo_config(Path("unread"))
    raw["ray"]["num_workers"] = world
    raw["parallel"] = {"context_parallel": context, "expert_parallel": experts}
    return parallel_dims(Config.from_dict(raw), "cpu", Topology(("node",) * world))


def _own_experts(model: torch.nn.Module, dims: ParallelDims) -> ExpertParallel:
    """This rank's E/k experts of the whole model: `split_experts_` cuts them (to meta tensors, as on the weightless
    model of a job), then this rank's rows of the whole base and LoRA tensors fill them, as its load would."""
    from rayft.parallel.expert import is_expert_lora, split_experts_

    ep = dims.split_experts(model.config)
    whole = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n}
    split_experts_(model, ep)
    for name, param in list(model.named_parameters()):
        if name in whole and param.is_meta:
            owner, _, leaf = name.rpartition(".")
            full = whole[name]
            local = ep.local_part(name, full) if is_expert_lora(name) else full[ep.first : ep.first + ep.local]
            setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(local, requires_grad=param.requires_grad))
    return ep


def _reduced_grads(model: torch.nn.Module, ep: ExpertParallel | None, world: int) -> dict[str, torch.Tensor]:
    """The LoRA gradients as a step sees them: the rest averaged over the ranks (what FSDP does), the experts' by
    expert parallelism's own reduction, then made whole for the comparison."""
    import torch.distributed as dist

    from rayft.parallel.expert import is_expert_lora

    for name, p in model.named_parameters():
        if p.grad is not None and not (ep is not None and is_expert_lora(name)):
            dist.all_reduce(p.grad)
            p.grad /= world
    if ep is not None:
        ep.clip_gradients_(model, math.inf)
    grads = _lora_grads(model)
    return {n: ep.full(n, g) if ep is not None and is_expert_lora(n) else g for n, g in grads.items()}


def _rank(rank: int, world: int, port: int, family: str, split: tuple[int, int], case: tuple, result: str) -> None:
    import torch.distributed as dist

    from rayft.model.loss import CausalLMLoss
    from rayft.parallel.context import shard_batch
    from rayft.train.step import step_targets

    kernel, fused, rows = case
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, batch = _model(family, experts=split[1] > 1), _batch(rows)
        reference = model(**batch, use_cache=False).loss  # transformers alone, on the whole rows
        reference.backward()
        expected = _lora_grads(model)
        model.zero_grad(set_to_none=True)

        dims = _layout(world, *split)
        context = dims.split_sequences(model)
        ep = _own_experts(model, dims) if split[1] > 1 else None
        share = rows // context.data_ranks  # each context-parallel group its own rows
        mine = {k: v[context.data_rank * share : (context.data_rank + 1) * share] for k, v in batch.items()}
        shard = shard_batch(mine, context.group, context.ranks, kernel)
        loss = CausalLMLoss(fused)(model, shard, step_targets([shard], world))
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # each rank's token sum over the mean count per rank: the sum is `world` means
        got = _reduced_grads(model, ep, world)
        if rank == 0:
            worst = max(((got[n] - g).norm() / g.norm()).item() for n, g in expected.items())
            whole = torch.cat([g.flatten() for g in expected.values()])
            gap = torch.cat([(got[n] - g).flatten() for n, g in expected.items()]).norm() / whole.norm()
            experts = sum(".experts." in n for n in got)
            out = {"loss": (total.item() / world, reference.item()), "worst": worst, "all": gap.item(), "n": len(got)}
            torch.save({**out, "experts": experts}, result)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("family", "ranks", "context", "experts", "kernel", "fused", "rows"),
    [  # context: N, the ranks a row is split over; experts: k, the ranks that share the experts
        ("llama", 2, 2, 1, "sdpa", True, 1),  # 2 kv heads split over 2 ranks; SDPA per document
        ("llama", 4, 4, 1, "sdpa", True, 2),  # 2 kv heads repeated to 4; two rows: the whole rows' mask
        ("llama", 2, 2, 1, "eager", False, 1),  # the eager kernel (with the mask), the model's own loss from logits
        ("mistral", 4, 4, 1, "sdpa", False, 1),
        ("mistral4", 2, 2, 1, "sdpa", True, 1),  # MLA: q/k head 16, v head 16 from a 16-rank latent
        ("mistral4", 4, 4, 1, "sdpa", True, 2),
        ("mistral4", 2, 2, 1, "eager", True, 1),  # Mistral4's own eager attention, with the whole row's mask
        # 2 groups of 2 (a row each) with the experts (and their LoRA) split over 2: tokens of both rows' halves
        # travel to their experts, whose gradients are summed over the expert-parallel and data-parallel ranks
        ("mistral4", 4, 2, 2, "sdpa", True, 2),
    ],
)
def test_context_parallel_equals_one_rank(
    tmp_path, family: str, ranks: int, context: int, experts: int, kernel: str, fused: bool, rows: int
):
    result = str(tmp_path / "result.pt")
    split = (context, experts)
    spawn_ranks(_rank, args=(ranks, free_port(), family, split, (kernel, fused, rows), result), nprocs=ranks)
    out = torch.load(result)
    got, reference = out["loss"]
    print(
        f"{family} N={split[0]} k={split[1]} rows={rows}: loss {got!r} vs {reference!r}; LoRA gradients "
        f"{out['all']:.3g} relative (all of them), worst tensor {out['worst']:.3g}"
    )
    assert out["n"] > 0 and (out["experts"] > 0) == (split[1] > 1)
    assert got == pytest.approx(reference, rel=1e-5)
    assert out["all"] < 1e-5, out
    # One tensor alone, of the smallest gradients: SDPA per document (its CPU flash kernel) against the reference's
    # masked kernel sums in another order.
    assert out["worst"] < 1e-4, out


def _run_config(fixtures: Fixtures, out: Path, workers: int, n: int, model: Path | None = None) -> dict:
    """A few steps of the tiny job, every step logged and evaluated, on `workers` workers split `n` ways."""
    cfg = tiny_config(
        fixtures, out, max_steps=3, logging_steps=1, eval_steps=1, save_steps=3, per_device_train_batch_size=2
    )
    cfg["data"]["max_eval_samples"] = 16  # 2 batches: one for each data-parallel rank of the 4-worker run
    cfg["ray"]["num_workers"] = workers
    cfg["parallel"] = {"context_parallel": n}
    if model is not None:
        cfg["model"]["model_name_or_path"] = str(model)
    return cfg


def _assert_same_run(got: LocalRun, want: LocalRun) -> None:
    mine, theirs = got.metrics(), want.metrics()
    assert len(mine) == len(theirs) and sum("eval_loss" in r for r in theirs) == 3
    for a, b in zip(mine, theirs, strict=True):
        compared = [key for key in ("loss", "eval_loss", "grad_norm") if key in b]
        assert compared and all(key in a for key in compared), (a, b)
        for key in compared:
            print(f"step {a['step']} {key}: {a[key]!r} vs {b[key]!r}")
            assert a[key] == pytest.approx(b[key], rel=1e-5 if "loss" in key else REORDERED), (a["step"], key)
    adapters = [load_file(run.out / "final" / "adapter_model.safetensors") for run in (got, want)]
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    gap = max(((adapters[0][k] - t).norm() / t.norm()).item() for k, t in adapters[1].items())
    print(f"adapter gap {gap:.3g} (relative, worst tensor)")
    assert gap < REORDERED


@pytest.mark.parametrize("n", [2, 4])
def test_a_context_parallel_run_trains_as_one_rank(fixtures: Fixtures, tmp_path: Path, n: int) -> None:
    """The Trainer under FSDP2 on N gloo ranks, one sequence split over all of them, against one rank: the same
    losses, evaluation losses, gradient norms and final adapter."""
    one = train_locally(_run_config(fixtures, tmp_path / "one", 1, 1), 1)
    split = train_locally(_run_config(fixtures, tmp_path / "split", n, n), n)
    assert "attention" in split.text()
    _assert_same_run(split, one)


def test_a_context_parallel_run_keeps_data_parallel_groups(fixtures: Fixtures, tmp_path: Path) -> None:
    """4 workers as 2 data-parallel groups of 2: each group reads its own micro-batches of the global stream, the
    pair within a group the same ones, so the run trains as 2 workers reading that stream without context
    parallelism (an elastic run's global order: ray.min_workers)."""
    raw = _run_config(fixtures, tmp_path / "dp", 2, 1)
    raw["ray"]["min_workers"] = 1
    dp = train_locally(raw, 2)
    both = train_locally(_run_config(fixtures, tmp_path / "both", 4, 2), 4)
    _assert_same_run(both, dp)


def test_mistral_small_4_trains_context_parallel(fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path) -> None:
    """The tiny Mistral-Small-4 from its hub layout (MLA attention, FP8 storage, routed experts) split 2 ways."""
    one = train_locally(_run_config(fixtures, tmp_path / "one", 1, 1, mistral4_hub), 1)
    split = train_locally(_run_config(fixtures, tmp_path / "split", 2, 2, mistral4_hub), 2)
    _assert_same_run(split, one)


def test_a_context_parallel_run_stopped_after_a_checkpoint_resumes_to_the_same_losses(
    fixtures: Fixtures, tmp_path: Path
) -> None:
    """Checkpoints keep their meaning: a 2-way run stopped dead while saving step 3's checkpoint and continued from
    step 2's ends where the one-rank run ends (the data position is the global stream's, the same at any split)."""
    raw = _run_config(fixtures, tmp_path / "split", 2, 2)
    raw["train"]["save_steps"] = 1
    stopped = train_locally(raw, 2, crash_saving=3)
    assert [r["step"] for r in stopped.metrics() if "loss" in r] == [1, 2]
    assert not stopped.checkpoint(3).exists()
    resumed = train_locally(raw, 2, resume=stopped.checkpoint(2))
    assert resumed.resumes()[-1] == 2
    one = train_locally(_run_config(fixtures, tmp_path / "one", 1, 1), 1)
    _assert_same_run(resumed, one)


def test_preflight_refuses_n_that_does_not_split_the_heads(fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path):
    """Before any worker starts (as `rayft validate` and the job's preflight run it): the tiny models' 4 heads do
    not split 3 ways; 2 ways they do."""
    from rayft.config import Config, ConfigError
    from rayft.model.build import text_config
    from rayft.parallel.context import check_heads

    for model in (fixtures.model, mistral4_hub):
        with pytest.raises(ConfigError, match=r"parallel.context_parallel 3 must divide the model's 4 attention"):
            check_heads(text_config(str(model)), 3)
        check_heads(text_config(str(model)), 2)
    raw = _run_config(fixtures, tmp_path, 3, 3)
    assert Config.from_dict(raw).parallel.context_parallel == 3  # the config alone cannot know the heads


def _draws_rank(rank: int, world: int, port: int, result: str) -> None:
    """Each worker's dropout draws for one micro-batch (one seed), with the sequence split over both workers and
    without: gathered to rank 0."""
    import torch.distributed as dist

    from rayft.train.step import seed_draws

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        draws = {}
        for context in (1, world):
            seed_draws(1234, _layout(world, context, 1))
            mine = torch.nn.functional.dropout(torch.ones(64), p=0.5)
            gathered = [torch.empty(64) for _ in range(world)]
            dist.all_gather(gathered, mine)
            draws[context] = gathered
        if rank == 0:
            torch.save(draws, result)
    finally:
        dist.destroy_process_group()


def test_the_workers_of_a_split_sequence_draw_their_own_dropout_masks(tmp_path: Path) -> None:
    """The workers of a context-parallel group train one micro-batch, each on its own slice of the rows. Seeded
    alike, they would drop the same positions of every slice: one mask repeated N times over the row. Each draws
    its own; without the split a micro-batch's draws stay the same on whichever worker trains it (an elastic run's
    result does not depend on the group's size)."""
    result = str(tmp_path / "draws.pt")
    spawn_ranks(_draws_rank, args=(2, free_port(), result), nprocs=2)
    draws = torch.load(result)
    assert torch.equal(draws[1][0], draws[1][1])
    assert not torch.equal(draws[2][0], draws[2][1]), "both slices of the row got one dropout mask"
