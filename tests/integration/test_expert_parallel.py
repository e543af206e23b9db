"""Expert parallelism (rayft.parallel.expert) against FSDP2 alone, in-process on 2 gloo ranks.

The reference is the same run with `parallel.expert_parallel: 1` (every expert FSDP-sharded, routed by
transformers' own grouped-GEMM path): per-step losses, gradient norms and the gathered adapter must agree. The
router is skewed (a few experts' router rows scaled up) so the experts get very uneven token counts, one rank's
experts far more than the other's. The all-to-all byte tally is checked against a count made from the router's
own choices, read by forward hooks on the router (not by the code under test). One forward of the k=2 layout as the
job builds it is held against two figures from the weightless model: the bytes of all-to-all outputs activation
checkpointing keeps (the memory plan's row) and the FLOPs per token (MFU), which the split must not change.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Fixtures, free_port, tiny_config
from fixtures.hub_layout import TINY_MISTRAL4, make_tiny_mistral_small4
from fixtures.moe_families import EXPERTS as FAMILY_EXPERTS
from fixtures.moe_families import MOE_FAMILIES, make_hub_moe
from fixtures.ranks import spawn_ranks
from safetensors.torch import load_file, save_file
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from rayft.config import Config, ConfigError

STEPS = 5
SAVE_AT = 3  # the k=2 run writes a checkpoint after this step; a k=1 run resumes from it
HIDDEN, EXPERTS, TOP_K = TINY_MISTRAL4["hidden_size"], TINY_MISTRAL4["n_routed_experts"], 2
SKEW = {0: 6.0, 1: 4.0, 2: 3.0}  # router rows scaled: experts 0-2 (all on rank 0 with k=2) take most tokens


@pytest.fixture(scope="module")
def skewed_hub(fixtures: Fixtures, tmp_path_factory) -> Path:
    """The tiny hub-layout Mistral-Small-4 (FP8 experts) with a router that favours experts 0-2."""
    directory = make_tiny_mistral_small4(tmp_path_factory.mktemp("skewed") / "m", tokenizer_from=fixtures.model)
    for file in sorted(directory.glob("*.safetensors")):
        tensors = load_file(str(file))
        routers = [k for k in tensors if k.endswith("mlp.gate.weight")]
        for key in routers:
            weight = tensors[key].float()
            for expert, scale in SKEW.items():
                weight[expert] *= scale
            tensors[key] = weight.to(tensors[key].dtype)
        if routers:
            save_file(tensors, str(file), metadata={"format": "pt"})
    return directory


def _raw(fixtures: Fixtures, model: Path, out: Path, k: int, frozen_dtype: str, experts: bool = True) -> dict:
    raw = tiny_config(fixtures, out, max_grad_norm=0.5)
    raw["model"].update(model_name_or_path=str(model), torch_dtype="float32", frozen_dtype=frozen_dtype)
    raw["lora"].update(target_modules=["auto"], target_experts=experts, lora_dropout=0.0)
    raw["fsdp"] = {"activation_checkpointing": experts}
    raw["ray"]["num_workers"] = 2
    raw["parallel"] = {"expert_parallel": k}
    return raw


def _batch(step: int, rank: int) -> torch.Tensor:
    """Each rank's own tokens, the same in every run; ranks see different lengths' worth of routing."""
    return torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(1000 * step + rank))


def _record_routing(model, calls: list) -> None:
    """Forward hooks on every router: (layer, expert index of each (token, k) pair) per call, recompute included."""
    for name, module in model.named_modules():
        if name.endswith(("mlp.gate", "mlp.router")):
            module.register_forward_hook(lambda _m, _i, out, name=name: calls.append((name, out[2].reshape(-1))))


def _rank(rank: int, world: int, port: int, raw: dict, out: str, resume: str | None, save: str | None) -> None:
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.parallelize import build_model
    from rayft.parallel.tally import TALLY
    from rayft.train.checkpoint import load_checkpoint, save_adapter, save_checkpoint
    from rayft.train.checkpoint_dir import Progress
    from rayft.train.step import clip_gradients_, step_targets

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(42)
        cfg = Config.from_dict(raw)
        layout = parallel_dims(cfg, "cpu")
        model = build_model(cfg, on_gpu=False, dims=layout)
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        first = 0
        if resume:
            first = load_checkpoint(Path(resume), model, optimizer, scheduler, layout).step
        calls: list = []
        _record_routing(model, calls)
        record = {"losses": {}, "grad_norms": {}, "a2a": {}, "routing": {}, "all_reduce": {}}
        TALLY.take()
        for step in range(first, STEPS):
            calls.clear()
            ids = _batch(step, rank)
            per_rank = step_targets([{"labels": ids}], world)
            loss = model(input_ids=ids, labels=ids, num_items_in_batch=per_rank).loss
            loss.backward()
            norm = clip_gradients_(model, cfg.train.max_grad_norm, layout)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)  # each rank's loss is its token sum over the mean count: the sum is the mean
            taken = TALLY.take()
            record["losses"][step] = total.item() / world
            record["grad_norms"][step] = float(norm)
            record["a2a"][step] = taken["all_to_all"]
            record["all_reduce"][step] = taken["all_reduce"]
            record["routing"][step] = [(name, idx.tolist()) for name, idx in calls]
            if save and step + 1 == SAVE_AT:
                progress = Progress(step=SAVE_AT, world_size=world)
                save_checkpoint(Path(save), model, optimizer, scheduler, progress, {}, layout)
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
        save_adapter(model, Path(out) / "adapter", layout)
    finally:
        dist.destroy_process_group()


def _run(raw: dict, out: Path, resume: Path | None = None, save: Path | None = None) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    args = (2, free_port(), raw, str(out), resume and str(resume), save and str(save))
    spawn_ranks(_rank, args=args, nprocs=2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _expected_a2a(ranks: list[dict], step: int, k: int, recompute: bool) -> list[int]:
    """Bytes each rank receives from the other in a step, from the router's choices alone: per MoE layer,
    dispatch brings the other rank's pairs for my experts, combine brings back my pairs that went out, and the
    per-expert counts (E/k int64 from each other rank) go first; backward sends the gradients of both exchanges.
    A recomputed forward (the second call of a layer) reuses the saved exchanges: it moves nothing."""
    local = EXPERTS // k
    owner = [e // local for e in range(EXPERTS)]
    expected = []
    for me in range(k):
        total = 0
        seen: set[str] = set()
        calls = [call for call in zip(*(r["routing"][str(step)] for r in ranks), strict=True)]
        for per_rank in calls:
            name = per_rank[0][0]
            into_mine = sum(owner[e] == me for r, (_, idx) in enumerate(per_rank) if r != me for e in idx)
            mine_out = sum(owner[e] != me for e in per_rank[me][1])
            pairs_bytes = (into_mine + mine_out) * HIDDEN * 4
            if name not in seen:  # forward: dispatch + combine and the counts; backward: their gradients
                total += 2 * pairs_bytes + (k - 1) * local * 8
            seen.add(name)
        assert recompute == (len(calls) == 2 * len(seen)), "a forward per layer, and one recompute when checkpointed"
        expected.append(total)
    return expected


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "adapter_model.safetensors"))


@pytest.mark.parametrize("frozen_dtype", ["auto", "float32"])
def test_expert_parallel_matches_fsdp(fixtures: Fixtures, skewed_hub: Path, tmp_path: Path, frozen_dtype: str):
    """k=2 (each rank 4 of 8 experts, FP8 or fp32 storage) vs k=1 FSDP2: same losses, norms and adapter over 5
    steps with skewed routing; the tally equals the router-derived count; a k=2 checkpoint resumes with k=1."""
    resharding = frozen_dtype == "auto"  # the checkpoint holds only LoRA and optimizer state: one storage suffices
    ep = _run(_raw(fixtures, skewed_hub, tmp_path, 2, frozen_dtype), tmp_path / "ep", save=tmp_path / "ckpt")
    fsdp = _run(_raw(fixtures, skewed_hub, tmp_path, 1, frozen_dtype), tmp_path / "fsdp")
    if resharding:
        resumed = _run(_raw(fixtures, skewed_hub, tmp_path, 1, frozen_dtype), tmp_path / "resumed", tmp_path / "ckpt")

    # Skewed, uneven routing: per expert and per owning rank (from the hooks, the first call of layer 0).
    pairs = [e for r in ep for e in r["routing"]["0"][0][1]]
    counts = torch.bincount(torch.tensor(pairs), minlength=EXPERTS)
    assert counts.max() >= 3 * counts.min() and counts[:4].sum() >= 1.5 * counts[4:].sum(), counts.tolist()

    for step in range(STEPS):
        a, b = ep[0]["losses"][str(step)], fsdp[0]["losses"][str(step)]
        assert abs(a - b) <= 1e-4, f"step {step}: EP loss {a} vs FSDP {b}"
        na, nb = ep[0]["grad_norms"][str(step)], fsdp[0]["grad_norms"][str(step)]
        assert abs(na - nb) <= 1e-4 * max(1.0, nb), f"step {step}: grad norm {na} vs {nb}"
        for rank, record in enumerate(ep):
            assert record["a2a"][str(step)] == _expected_a2a(ep, step, 2, recompute=True)[rank]
        assert all(r["a2a"][str(step)] == 0 for r in fsdp)
    if resharding:  # the k=2 checkpoint, resumed with k=1, continues as both uninterrupted runs
        assert sorted(resumed[0]["losses"]) == [str(s) for s in range(SAVE_AT, STEPS)]
        for step in range(SAVE_AT, STEPS):
            assert abs(resumed[0]["losses"][str(step)] - fsdp[0]["losses"][str(step)]) <= 1e-4

    reference = _adapter(tmp_path / "fsdp" / "adapter")
    assert any(".experts." in k for k in reference) and any("shared_experts" in k for k in reference)
    for label in ("ep", "resumed") if resharding else ("ep",):
        adapter = _adapter(tmp_path / label / "adapter")
        assert adapter.keys() == reference.keys()
        for key, tensor in reference.items():
            assert adapter[key].shape == tensor.shape, key
            torch.testing.assert_close(adapter[key], tensor, atol=1e-4, rtol=1e-3, msg=f"{label}: {key}")
    configs = [json.loads((tmp_path / run / "adapter" / "adapter_config.json").read_text()) for run in ("ep", "fsdp")]
    for config in configs:  # PEFT writes its target set in hash order, which differs between processes
        config["target_modules"] = sorted(config["target_modules"])
    assert configs[0] == configs[1]


@pytest.mark.parametrize("model_type", sorted(MOE_FAMILIES))
def test_expert_parallel_matches_fsdp_for_each_family(fixtures: Fixtures, tmp_path: Path, model_type: str):
    """Each MoE family's block under k=2 (4 of 8 experts a rank) against FSDP2 alone, LoRA on the attention and the
    routed experts: the same losses, gradient norms and adapter over 5 steps. Mixtral's training-time jitter is on,
    GPT-OSS's experts are transposed with biases, DeepSeek-V3's first layer is dense."""
    model = make_hub_moe(model_type, tmp_path / "model")  # the hub layout: each rank reads its experts
    ep = _run(_raw(fixtures, model, tmp_path, 2, "float32"), tmp_path / "ep")
    fsdp = _run(_raw(fixtures, model, tmp_path, 1, "float32"), tmp_path / "fsdp")

    pairs = torch.tensor([e for r in ep for _, idx in r["routing"]["0"] for e in idx])
    per_rank = torch.bincount(pairs // (FAMILY_EXPERTS // 2), minlength=2)  # experts per rank with k=2
    assert per_rank.min() > 0, f"the experts of one rank got no tokens: {per_rank.tolist()}"
    for step in range(STEPS):
        a, b = ep[0]["losses"][str(step)], fsdp[0]["losses"][str(step)]
        assert abs(a - b) <= 1e-4, f"step {step}: EP loss {a} vs FSDP {b}"
        na, nb = ep[0]["grad_norms"][str(step)], fsdp[0]["grad_norms"][str(step)]
        assert abs(na - nb) <= 1e-4 * max(1.0, nb), f"step {step}: grad norm {na} vs {nb}"
        assert all(r["a2a"][str(step)] > 0 for r in ep) and all(r["a2a"][str(step)] == 0 for r in fsdp)

    reference, adapter = _adapter(tmp_path / "fsdp" / "adapter"), _adapter(tmp_path / "ep" / "adapter")
    assert any(".self_attn." in k for k in reference)
    assert any(".experts." in k and ".lora_B." in k and t.abs().sum() > 0 for k, t in reference.items())  # trained
    assert adapter.keys() == reference.keys()
    for key, tensor in reference.items():
        torch.testing.assert_close(adapter[key], tensor, atol=1e-4, rtol=1e-3, msg=key)


def test_expert_parallel_config_errors(fixtures: Fixtures, tmp_path: Path):
    from rayft.parallel.expert import check_experts

    raw = tiny_config(fixtures, tmp_path)
    raw["ray"]["num_workers"] = 4
    for k, fragment in ((3, "must divide ray.num_workers 4; valid: [1, 2, 4]"), ("two", "neither an integer")):
        raw["parallel"] = {"expert_parallel": k}
        with pytest.raises(ConfigError, match=r"parallel\.expert_parallel") as e:
            Config.from_dict(raw)
        assert fragment in str(e.value)
    with pytest.raises(ConfigError, match=r"does not divide the model's 6 routed experts; valid: \[1, 2\]"):
        check_experts(4, 6, 4)


def test_auto_takes_expert_parallelism_where_the_network_would_bind_fsdp(tmp_path: Path):
    """`auto` on Mistral-Small-4 (the preset's config, FP8 base, 4,096 tokens): on 2 single-GPU nodes FSDP would pull
    ~118 GB of FP8 decoder through a 50 GB/s NIC per micro-batch (> 2 s against < 1 s of compute), so EP 2; on 3
    nodes no k > 1 divides both 3 workers and 128 experts, so 1."""
    from transformers import Mistral4Config

    from rayft.plan import meta_structure
    from rayft.plan.steptime import planned_expert_parallel

    raw = {
        "data": {"max_length": 4096},
        "fsdp": {"activation_checkpointing": True},
        "train": {"output_dir": str(tmp_path), "gradient_accumulation_steps": 1},
        "parallel": {"expert_parallel": "auto"},
    }
    for workers, expected in ((2, 2), (3, 1)):
        raw["ray"] = {"num_workers": workers}
        cfg = Config.from_dict(raw)
        assert planned_expert_parallel(cfg, meta_structure(cfg, Mistral4Config()), "fp8") == expected, workers


def test_preflight_refuses_k_that_does_not_split_the_experts(fixtures: Fixtures, mistral4_hub: Path, tmp_path: Path):
    """Before any worker starts: 8 routed experts do not split 3 ways, and a dense model has none to split."""
    from rayft.model.build import text_config
    from rayft.parallel.expert import check_expert_parallel

    raw = tiny_config(fixtures, tmp_path)
    raw["ray"]["num_workers"] = 6
    raw["parallel"] = {"expert_parallel": 3}
    cfg = Config.from_dict(raw)
    with pytest.raises(ConfigError, match=r"does not divide the model's 8 routed experts; valid: \[1, 2\]"):
        check_expert_parallel(cfg, text_config(str(mistral4_hub)))
    with pytest.raises(ConfigError, match="has no routed experts"):
        check_expert_parallel(cfg, text_config(str(fixtures.model)))


def _gradients_rank(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    """One forward/backward of every rank's own batch; rank 0 saves every trainable parameter's whole gradient
    (FSDP's gathered, the experts' made whole over the ep-group) after the step's averaging."""
    from torch.distributed.tensor import DTensor

    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.parallelize import build_model
    from rayft.train.step import clip_gradients_, step_targets

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(42)
        cfg = Config.from_dict(raw)
        layout = parallel_dims(cfg, "cpu")
        model = build_model(cfg, on_gpu=False, dims=layout)
        ids = _batch(0, rank)
        model(input_ids=ids, labels=ids, num_items_in_batch=step_targets([{"labels": ids}], world)).loss.backward()
        clip_gradients_(model, 1e9, layout)
        ep = layout.expert_parallel
        # one layout, its meshes cut once: FSDP's (k = 2: one per node) and the experts' are the model's
        sharded = next(p for p in model.parameters() if isinstance(p, DTensor))
        assert layout.fsdp_mesh() is None or sharded.device_mesh is layout.fsdp_mesh()
        assert ep is None or (ep.mesh is layout.expert_mesh() and sharded.device_mesh is layout.fsdp_mesh())
        grads = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                grad = param.grad
                if isinstance(grad, DTensor):
                    grad = grad.full_tensor()
                elif ep is not None and ".experts." in name:
                    grad = ep.full(name, grad)
                grads[name] = grad
        if rank == 0:
            torch.save(grads, out)
    finally:
        dist.destroy_process_group()


def test_expert_parallel_with_the_rest_sharded_within_a_node_matches_fsdp(
    fixtures: Fixtures, skewed_hub: Path, tmp_path: Path
):
    """4 ranks as 2 workers a node, k=2: a (dp 2 × ep 2) mesh, the non-expert part sharded over a node's 2 workers
    and replicated across, expert gradients summed over dp: the first step's gradients equal FSDP2's over all 4."""
    grads = {}
    for k in (1, 2):
        raw = _raw(fixtures, skewed_hub, tmp_path, k, "auto")
        raw["ray"].update(num_workers=4, workers_per_node=2)
        spawn_ranks(_gradients_rank, args=(4, free_port(), raw, str(tmp_path / f"k{k}.pt")), nprocs=4)
        grads[k] = torch.load(tmp_path / f"k{k}.pt")
    assert grads[1].keys() == grads[2].keys()
    assert any(".experts." in n and g.abs().sum() > 0 for n, g in grads[2].items())
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[2][name], grad, atol=1e-7, rtol=1e-5, msg=name)


class ExchangeOutputs(TorchDispatchMode):
    """Weak references to the storage of every `rayft::all_to_all` output dispatched while active (the rows an
    exchange received): how many of their bytes something still holds once the forward has returned."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.rayft.all_to_all.default:
            self.outputs.append((StorageWeakRef(out.untyped_storage()), out.untyped_storage().nbytes()))
        return out

    def made(self) -> int:
        return sum(nbytes for _, nbytes in self.outputs)

    def alive(self) -> int:
        gc.collect()
        return sum(nbytes for ref, nbytes in self.outputs if not ref.expired())


def _one_forward_rank(rank: int, world: int, port: int, runs: dict[str, dict], out: str) -> None:
    """For each run: the model as the job builds it, the FLOP counts the loop would log, and one forward and
    backward of this rank's own batch, with the bytes of the all-to-all outputs made in the forward and of those
    still held when it returns (what waits for the backward)."""
    from rayft.model.flops import flop_model
    from rayft.parallel.parallelize import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for label, raw in runs.items():
            torch.manual_seed(42)
            cfg = Config.from_dict(raw)
            model = build_model(cfg, on_gpu=False)
            model.train()
            flops = flop_model(model, model.config, cfg.data.max_length)
            shape = (cfg.train.per_device_train_batch_size, cfg.data.max_length)
            ids = torch.randint(3, 1000, shape, generator=torch.Generator().manual_seed(rank))
            with ExchangeOutputs() as exchanges:
                loss = model(input_ids=ids, labels=ids).loss
            kept = exchanges.alive()
            loss.backward()
            results[label] = {
                "made": exchanges.made(),
                "kept": kept,
                "base": flops.base_params,
                "lora": flops.lora_params,
            }
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_forward_each(fixtures: Fixtures, mistral4_hub: Path, tmp_path_factory) -> dict[str, tuple[dict, list]]:
    """k=2 on the tiny hub Mistral-Small-4, 2 x 24 tokens a rank: with activation checkpointing (LoRA on the routed
    experts too, FP8 base), and without (no expert LoRA: it needs checkpointing). Label → (config, each rank's
    results)."""
    out = tmp_path_factory.mktemp("one-forward")
    runs = {}
    for label, checkpointing in (("checkpointed", True), ("not checkpointed", False)):
        raw = _raw(fixtures, mistral4_hub, out, 2, "auto", experts=checkpointing)
        raw["data"]["max_length"] = 24
        raw["train"]["per_device_train_batch_size"] = 2
        runs[label] = raw
    spawn_ranks(_one_forward_rank, args=(2, free_port(), runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return {label: (raw, [r[label] for r in ranks]) for label, raw in runs.items()}


def test_the_memory_plan_counts_the_all_to_all_outputs_checkpointing_keeps(one_forward_each: dict):
    """Activation checkpointing keeps both exchanges' outputs of every MoE layer until the backward (its recompute
    reuses them): the planner's row for them equals the bytes still held after a real forward. A rank receives
    its pairs back from the combine, and the two ranks' dispatches receive every pair once between them, so the
    mean over the ranks is the planner's uniform routing exactly, however skewed the router. Without
    checkpointing nothing holds them."""
    from rayft.model.build import held_as
    from rayft.plan import meta_structure, plan_memory

    for label, (raw, ranks) in one_forward_each.items():
        cfg = Config.from_dict(raw)
        plan = plan_memory(cfg, meta_structure(cfg), 2, on_gpu=False, held=held_as(cfg.model), expert_parallel=2)
        planned = sum(gib for name, gib in plan.rows if name.startswith("all-to-all outputs kept")) * 2**30
        kept = [r["kept"] for r in ranks]
        print(label, "all-to-all outputs kept per rank", kept, "planned", planned)
        assert sum(kept) / len(kept) == planned, (label, kept, planned)
        assert kept == ([r["made"] for r in ranks] if cfg.recomputes_activations else [0, 0]), (label, ranks)


def test_flops_per_token_are_the_same_with_the_experts_split(one_forward_each: dict):
    """A worker holding 4 of 8 experts a layer (and their LoRA) counts the FLOPs per token of the whole model: what
    the weightless model with every expert counts."""
    from rayft.model.build import weightless_lora_model
    from rayft.model.flops import flop_model

    for label, (raw, ranks) in one_forward_each.items():
        cfg = Config.from_dict(raw)
        model, _ = weightless_lora_model(cfg)
        whole = flop_model(model, model.config, cfg.data.max_length)
        print(label, "whole", whole, "per rank", ranks)
        for r in ranks:
            assert (r["base"], r["lora"]) == (whole.base_params, whole.lora_params), (label, r, whole)
