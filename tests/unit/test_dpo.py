"""DPO without Ray: preference records → pairs (and the bad ones counted or refused), the collate, the loss formulas,
the log-probs of the fused head, and parity with TRL's DPOTrainer (one gloo rank each, same model, data, LoRA init,
order and beta)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import Fixtures
from fixtures.preference import Settings, in_process, make_pairs
from fixtures.work import WorkCounter
from torch.nn import functional as F

from rayft.config import Config, ConfigError, DataConfig, DpoConfig, ModelConfig
from rayft.data.pipeline import _check_usable, count, finish
from rayft.data.preference import PairLimits, PreferenceCollate, PreferenceTokenize, pair_key
from rayft.data.records import record_format
from rayft.data.reference_table import ReferenceTable
from rayft.data.tokenizer import tokenizer_facts
from rayft.model.loss import sequence_logprobs
from rayft.train.dpo import pair_scores

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def actor(fx: Fixtures, max_length: int = 64, max_prompt_length: int | None = None, overlong="truncate", **model):
    model_cfg = ModelConfig(model_name_or_path=str(fx.model), **model)
    facts = dataclasses.asdict(tokenizer_facts(model_cfg))
    limits = dataclasses.asdict(PairLimits(max_length, max_prompt_length, overlong))
    return PreferenceTokenize(dataclasses.asdict(model_cfg), facts, "json", limits)


def raw(records: list) -> pa.Table:
    """Records as JSON lines, as rayft reads a .jsonl file (each line decoded in the actor)."""
    return pa.table({"_raw": pa.array([json.dumps(r).encode() for r in records], type=pa.binary())})


def ids(fx: Fixtures, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fx.model))(text, add_special_tokens=False)["input_ids"]


def test_preference_records_are_detected_and_need_dpo(fixtures: Fixtures):
    assert record_format(DataConfig(), ["prompt", "chosen", "rejected"], "x").kind == "preference"
    assert record_format(DataConfig(), ["chosen", "rejected"], "x").kind == "preference"
    with pytest.raises(ConfigError, match=r"dpo.loss_type: unknown value 'dpo'"):
        Config.from_dict({"dpo": {"loss_type": "dpo"}})
    with pytest.raises(ConfigError, match=r"dpo.beta must be > 0"):
        Config.from_dict({"dpo": {"beta": 0}})
    with pytest.raises(ConfigError, match=r"dpo.label_smoothing must be in"):
        Config.from_dict({"dpo": {"label_smoothing": 0.5}})
    with pytest.raises(ConfigError, match=r"dpo.reference: unknown value 'teacher'"):
        Config.from_dict({"dpo": {"reference": "teacher"}})
    with pytest.raises(ConfigError, match=r"data.packing: true cannot hold preference pairs"):
        Config.from_dict({"train": {"objective": "dpo"}, "data": {"packing": True}})
    with pytest.raises(ConfigError, match=r"unknown key 'dpo.bta'.*beta"):
        Config.from_dict({"dpo": {"bta": 0.1}})


@pytest.mark.torch_agnostic
def test_explicit_and_implicit_prompts_give_the_same_pair(fixtures: Fixtures):
    """prompt + completion ids as the tokenizer gives them for the whole text, BOS first, EOS last; the completion
    starts where both sequences leave the prompt, whether the prompt is given or implicit (TRL's common prefix)."""
    # completions whose first characters differ: their first tokens differ in any vocabulary, so the implicit
    # prompt (the common prefix) ends where the explicit one does
    explicit = {"prompt": "Which fruit?", "chosen": " An apple.", "rejected": " The stone."}
    implicit = {"chosen": "Which fruit? An apple.", "rejected": "Which fruit? The stone."}
    rows = actor(fixtures)(raw([explicit, implicit])).to_pylist()
    prompt = ids(fixtures, "Which fruit?")
    chosen, rejected = ids(fixtures, "Which fruit? An apple."), ids(fixtures, "Which fruit? The stone.")
    for row in rows:
        assert row["skip"] == ""
        assert row["chosen_ids"] == [1, *chosen, 2] and row["rejected_ids"] == [1, *rejected, 2]
        assert row["prompt_length"] == 1 + len(prompt) and chosen[: len(prompt)] == prompt


@pytest.mark.torch_agnostic
def test_conversational_pairs_use_the_chat_template(fixtures: Fixtures, tmp_path):
    from transformers import AutoTokenizer

    tok_dir = tmp_path / "chat-tokenizer"
    hf_tok = AutoTokenizer.from_pretrained(str(fixtures.model))
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(str(tok_dir))
    record = {
        "prompt": [{"role": "user", "content": "Name?"}],
        "chosen": [{"role": "assistant", "content": "Ray"}],
        "rejected": [{"role": "assistant", "content": "Stone"}],
    }
    implicit = {"chosen": record["prompt"] + record["chosen"], "rejected": record["prompt"] + record["rejected"]}
    rows = actor(fixtures, tokenizer_name_or_path=str(tok_dir))(raw([record, implicit])).to_pylist()
    user = ids(fixtures, "Name?")
    for row in rows:  # [BOS] [INST] Name? [/INST] | Ray </s>   (the template's own specials, none added)
        assert row["skip"] == ""
        assert row["chosen_ids"] == [1, 3, *user, 4, *ids(fixtures, "Ray"), 2]
        assert row["rejected_ids"] == [1, 3, *user, 4, *ids(fixtures, "Stone"), 2]
        assert row["prompt_length"] == 3 + len(user)
    no_template = actor(fixtures)(raw([record])).to_pylist()[0]
    assert no_template["skip"] == "chat_template"


def test_bad_preference_records_are_counted_and_refused_on_error(fixtures: Fixtures):
    """Missing rejected, an empty completion, a prompt that leaves no room, a non-text field, a broken line: each
    counted under its reason and never a training row; `data.bad_records: error` refuses the split."""
    good = {"prompt": "Which fruit?", "chosen": " An apple.", "rejected": " A stone."}
    long_prompt = {"prompt": "word " * 80, "chosen": " yes", "rejected": " no"}
    records = [
        good,
        {"prompt": "Q", "chosen": " A"},
        {"prompt": "Q", "chosen": "  ", "rejected": " B"},
        long_prompt,
        {"prompt": "Q", "chosen": 3, "rejected": " B"},
        good,
    ]
    table = actor(fixtures, max_length=32)(pa.concat_tables([raw(records), pa.table({"_raw": [b"{not json"]})]))
    assert table.column("skip").to_pylist() == [
        "",
        "missing_field",
        "empty",
        "no_completion",
        "not_text",
        "",
        "bad_json",
    ]
    kept = finish(table, 32, packing=False, counting=False)
    assert kept.num_rows == 2 and kept.column_names == ["chosen_ids", "rejected_ids", "prompt_length"]
    stats = count(RowsAtHand(finish(table, 32, packing=False, counting=True)), "x")
    assert (stats.records, stats.examples, stats.rows) == (7, 2, 2)
    assert stats.skipped == {"empty": 1, "missing_field": 1, "not_text": 1, "bad_json": 1, "no_completion": 1}
    _check_usable(stats, "x", DataConfig(bad_records="skip"))
    with pytest.raises(ConfigError, match=r"skipped 5 \(.*missing_field 1.*set data.bad_records: skip"):
        _check_usable(stats, "x", DataConfig(bad_records="error"))

    # With max_prompt_length the long prompt keeps its end and the pair trains; overlong: skip drops long pairs.
    row = actor(fixtures, max_length=32, max_prompt_length=16)(raw([long_prompt])).to_pylist()[0]
    assert row["skip"] == "" and row["prompt_length"] == 16 and len(row["chosen_ids"]) <= 32
    assert row["chosen_ids"][:16] == ids(fixtures, "word " * 80)[-16:]
    long_answer = {"prompt": "Q", "chosen": " yes" * 60, "rejected": " no"}
    assert actor(fixtures, 32, overlong="skip")(raw([long_answer])).column("skip").to_pylist() == ["too_long"]
    cut = actor(fixtures, 32)(raw([long_answer])).to_pylist()[0]
    assert cut["truncated"] and len(cut["chosen_ids"]) == 32 and cut["rejected_ids"][-1] == 2


class RowsAtHand:
    """What count() reads from a Ray dataset (`take_all()`), for rows already at hand."""

    def __init__(self, table: pa.Table):
        self.table = table

    def take_all(self) -> list[dict]:
        return self.table.to_pylist()


def test_collate_keeps_pairs_together_and_scores_completions_only():
    batch = {
        "chosen_ids": [[1, 5, 6, 7, 2], [1, 8, 9, 2]],
        "rejected_ids": [[1, 5, 6, 3, 3, 2], [1, 8, 4, 2]],
        "prompt_length": [3, 2],
    }
    out = PreferenceCollate(pad_id=0, multiple=8, max_length=64)(batch)
    assert out["input_ids"].shape == (4, 8)
    assert out["input_ids"][:, :6].tolist() == [
        [1, 5, 6, 7, 2, 0],
        [1, 8, 9, 2, 0, 0],
        [1, 5, 6, 3, 3, 2],
        [1, 8, 4, 2, 0, 0],
    ]
    assert out["labels"][:, :6].tolist() == [
        [-100, -100, -100, 7, 2, -100],
        [-100, -100, 9, 2, -100, -100],
        [-100, -100, -100, 3, 3, 2],
        [-100, -100, 4, 2, -100, -100],
    ]
    assert out["attention_mask"].sum(1).tolist() == [5, 4, 6, 4]


def test_loss_formulas_match_the_papers():
    """Hand-computed from the definitions (DPO, conservative DPO, robust DPO, IPO with length-averaged ratios)."""
    policy = torch.tensor([-4.0, -9.0, -7.0, -5.0])  # chosen 0, 1 then rejected 0, 1
    reference = torch.tensor([-5.0, -8.0, -6.0, -6.5])
    counts = torch.tensor([2, 4, 5, 2])
    beta = 0.5
    chosen_ratio, rejected_ratio = [1.0, -1.0], [-1.0, 1.5]
    delta = [c - r for c, r in zip(chosen_ratio, rejected_ratio, strict=True)]

    def logsig(x: float) -> float:
        return -math.log1p(math.exp(-x))

    def check(loss_type: str, eps: float, want: list[float]):
        got = pair_scores(policy, reference, counts, DpoConfig(beta=beta, loss_type=loss_type, label_smoothing=eps))
        assert got.losses.tolist() == pytest.approx(want, rel=1e-6)
        assert got.chosen_rewards.tolist() == pytest.approx([beta * r for r in chosen_ratio])
        assert got.rejected_rewards.tolist() == pytest.approx([beta * r for r in rejected_ratio])
        assert got.chosen_logps.tolist() == [-4.0, -9.0] and got.rejected_logps.tolist() == [-7.0, -5.0]

    check("sigmoid", 0.0, [-logsig(beta * d) for d in delta])
    check("sigmoid", 0.1, [-0.9 * logsig(beta * d) - 0.1 * logsig(-beta * d) for d in delta])
    check("robust", 0.1, [(-0.9 * logsig(beta * d) + 0.1 * logsig(-beta * d)) / 0.8 for d in delta])
    averaged = [1.0 / 2 - (-1.0) / 5, -1.0 / 4 - 1.5 / 2]
    check("ipo", 0.0, [(a - 1 / (2 * beta)) ** 2 for a in averaged])


@pytest.mark.parametrize("drop_unscored", [True, False], ids=["cpu-branch", "gpu-branch"])
@pytest.mark.parametrize("lora_head", [False, True], ids=["fused", "lora-head"])
def test_sequence_logprobs_equal_full_logits(lora_head: bool, drop_unscored: bool):
    """Sums of completion log-probs and their gradient against log_softmax over the full logits, in both branches:
    the prompt positions dropped before the head (CPU) or masked after it (GPU: no host sync, counted)."""
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64)
    labels = torch.randint(0, 50, (3, 7))
    labels[0, :3] = labels[1, 5:] = labels[2, :] = -100
    labels[2, 4] = 11
    upstream = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)

    def reference():
        logp = torch.log_softmax(hidden @ weight.T, -1)[:, :-1]
        target = labels[:, 1:]
        picked = logp.gather(-1, target.clamp_min(0)[..., None])[..., 0] * (target != -100)
        return picked.sum(-1), (target != -100).sum(-1)

    want, want_counts = reference()
    (want * upstream).sum().backward()
    want_grad, hidden.grad = hidden.grad, None
    head = {"head": lambda h: F.linear(h, weight)} if lora_head else {"weight": weight}
    with WorkCounter() as work:
        got, counts = sequence_logprobs(hidden, labels, drop_unscored=drop_unscored, **head)
    assert sum(work.syncs.values()) == drop_unscored, work.syncs  # the scored positions' count, or nothing
    (got * upstream).sum().backward()
    assert counts.tolist() == want_counts.tolist() == [4, 4, 1]
    assert torch.allclose(got.double(), want, atol=1e-5)
    assert torch.allclose(hidden.grad, want_grad, atol=1e-5)


def gap(a: list[dict], b: list[dict], key: str) -> float:
    return max(abs(x[key] - y[key]) for x, y in zip(a, b, strict=True))


PARITY = [("sigmoid", 0.1), ("ipo", 0.5)]


@pytest.mark.torch_agnostic
def test_dpo_matches_trl_dpotrainer(fixtures: Fixtures, tmp_path):
    """Same tiny Mistral, pairs, file order, initial LoRA weights and beta, 10 steps of 2 × 2 pairs, for sigmoid
    and ipo: the first step is ln 2 (sigmoid) or 1/(4β²) (ipo) on both sides (policy = reference before any
    update); the per-step loss and rewards/accuracies stay as close to TRL's as rayft is to itself under another
    seed (another LoRA init). One process per system runs both losses (start-up is most of the cost)."""
    records = make_pairs(40, seed=3)
    settings = [Settings(model=str(fixtures.model), steps=10, batch=2, loss_type=lt, beta=b) for lt, b in PARITY]
    ours = in_process("run_each", "run_rayft", settings, records, tmp_path / "rayft")
    adapters = [str(tmp_path / "rayft" / str(i) / "initial-adapter") for i in range(len(settings))]
    theirs = in_process("run_each", "run_trl", settings, records, tmp_path / "trl", *adapters)
    reseeded = [dataclasses.replace(s, seed=s.seed + 1) for s in settings]
    other = in_process("run_each", "run_rayft", reseeded, records, tmp_path / "reseeded")
    for (loss_type, beta), a, b, c in zip(PARITY, ours, theirs, other, strict=True):
        print(
            loss_type,
            json.dumps(
                {
                    k: [round(r["loss"], 5) for r in run["steps"]]
                    for k, run in (("rayft", a), ("trl", b), ("reseeded", c))
                }
            ),
        )
        print(
            loss_type,
            json.dumps(
                {
                    k: [r["rewards/accuracies"] for r in run["steps"]]
                    for k, run in (("rayft", a), ("trl", b), ("reseeded", c))
                }
            ),
        )
        assert a["first_ids"] == b["first_ids"]  # same token ids, BOS and EOS included
        a, b, c = a["steps"], b["steps"], c["steps"]
        assert len(a) == len(b) == 10
        first = math.log(2) if loss_type == "sigmoid" else 1 / (2 * beta) ** 2
        assert a[0]["loss"] == pytest.approx(first, abs=1e-5) and b[0]["loss"] == pytest.approx(first, abs=1e-4)
        yardstick = gap(a, c, "loss")
        assert gap(a, b, "loss") <= max(yardstick, 1e-4), (loss_type, gap(a, b, "loss"), yardstick)
        assert a[-1]["loss"] < a[0]["loss"] and b[-1]["loss"] < b[0]["loss"]  # both learn
        accuracy_gap = gap(a, b, "rewards/accuracies")
        assert accuracy_gap <= max(gap(a, c, "rewards/accuracies"), 0.25), (loss_type, accuracy_gap)


def test_eval_result_line_for_preference_pairs():
    from rayft.cli import eval_summary
    from rayft.train.metrics import progress_line

    result = {
        "split": "validation",
        "rows": 16,
        "eval_loss": 0.61,
        "eval_rewards/chosen": 0.2,
        "eval_rewards/rejected": -0.1,
        "eval_rewards/accuracies": 0.875,
        "eval_rewards/margins": 0.3,
        "eval_logps/chosen": -20.0,
        "eval_logps/rejected": -25.0,
        "eval_s": 1.0,
    }
    assert eval_summary(result, adapter=True) == (
        "rayft: eval base + adapter on 'validation' (16 pairs): DPO loss 0.6100, rewards/chosen 0.2000, "
        "rewards/rejected -0.1000, rewards/accuracies 0.8750, rewards/margins 0.3000, logps/chosen -20.0000, "
        "logps/rejected -25.0000"
    )
    line = progress_line(
        {"step": 3, "epoch": 0.5, "loss": 0.6, "rewards/margins": 0.25, "rewards/accuracies": 0.75}, 10, None
    )
    assert line == "step 3/10 | epoch 0.50 | loss 0.6000 | rewards/margins 0.2500 | rewards/accuracies 0.7500"


def test_reference_pass_leaves_every_lora_weight_trainable_and_checkpointed(fixtures: Fixtures, tmp_path):
    """PEFT's disable_adapter() re-enables requires_grad on the gathered parameters FSDP2 has registered at that
    moment, leaving the sharded ones frozen (out of checkpoints: a resume then failed on a missing key);
    rayft's reference pass flips only the adapter switch."""
    found = in_process("trainable_after_reference_passes", str(fixtures.model), tmp_path)
    assert found["frozen"] == []
    assert found["after"] == found["before"] and len(found["before"]) == 6  # A and B: q_proj × 2 layers, lm_head


def test_reference_table_finds_each_pair_by_its_tokens_whatever_the_batch():
    """Keys come from the tokens alone (list or int32/int64 arrays alike; another prompt length is another pair);
    the collate hands each row its pair's reference values in row order (chosen rows, then rejected), NaN and a
    count for a pair the table lacks; the table survives its bytes and keeps one entry per repeated pair."""
    pairs = [([1, 5, 6], [1, 5, 7], 1), ([1, 2, 3, 4], [1, 2, 9], 2), ([1, 8], [1, 9], 1)]
    keys = [pair_key(*p) for p in pairs]
    assert len(set(keys)) == 3
    assert pair_key(np.array([1, 5, 6], np.int32), np.array([1, 5, 7], np.int64), 1) == keys[0]
    assert pair_key([1, 5, 6], [1, 5, 7], 2) != keys[0]
    values = np.array([[-1.0, -2.0], [-3.0, -4.0]])
    table = ReferenceTable.merge([(np.array(keys[:2]), values), (np.array(keys[:1]), values[:1])], {"model": "m"})
    assert len(table) == 2
    table = ReferenceTable.from_bytes(table.to_bytes())
    assert table.identity == {"model": "m"}
    batch = {
        "chosen_ids": [p[0] for p in pairs[::-1]],
        "rejected_ids": [p[1] for p in pairs[::-1]],
        "prompt_length": [p[2] for p in pairs[::-1]],
    }
    out = PreferenceCollate(pad_id=0, reference=table)(batch)
    assert out["pair_key"].tolist() == keys[::-1]
    got = out["reference_logps"].tolist()
    assert got[1:3] == [-3.0, -1.0] and got[4:] == [-4.0, -2.0] and math.isnan(got[0]) and math.isnan(got[3])
    assert int(out["reference_missing"]) == 1
    assert "reference_logps" not in PreferenceCollate(pad_id=0)(batch)


def test_precomputed_reference_trains_as_the_live_one_with_half_the_forwards(fixtures: Fixtures, tmp_path):
    """`dpo.reference: precomputed` (a first pass over the pairs, then one forward per micro-batch) against the
    reference scored live under the adapter switched off (two forwards): the same losses and rewards, step by step;
    and so with a table lacking the first step's first pair (that step alone scores its reference live)."""
    records = make_pairs(24, seed=5)
    settings = [
        Settings(model=str(fixtures.model), steps=6, batch=2, reference=r, reference_dropped=n)
        for r, n in (("adapter_off", 0), ("precomputed", 0), ("precomputed", 1))
    ]
    live, precomputed, patched = in_process("run_each", "run_rayft", settings, records, tmp_path)
    assert live["forwards_per_micro_batch"] == 2 and precomputed["forwards_per_micro_batch"] == 1
    assert patched["forwards_per_micro_batch"] == (2 * 2 + 1 * 10) / 12  # step 1's two micro-batches live
    for a, b, c in zip(live["steps"], precomputed["steps"], patched["steps"], strict=True):
        for key in ("loss", "rewards/margins"):
            assert a[key] == pytest.approx(b[key], abs=1e-6) and a[key] == pytest.approx(c[key], abs=1e-6)
    assert live["steps"][0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert live["steps"][-1]["loss"] < live["steps"][0]["loss"]  # it learns: the check compares moving numbers
