"""rayft's DPO step against TRL's DPOTrainer on CPU, side by side, alternating; and the memory of a DPO run against an
SFT run of the same batch.

Both systems train one process each (rayft: one gloo rank, FSDP2 + PEFT, `rayft.train.step.train_step` with
`rayft.train.dpo.PreferenceLoss`, fed by `PreferenceTokenize` → `PreferenceCollate`; TRL: `DPOTrainer` as users run it
on CPU) on the same tiny Mistral-architecture model (real tekken tokenizer, 131k vocab; the SFT bench's size), the same
pairs in the same order, the same initial LoRA weights (TRL loads rayft's initial adapter), LoRA r=16 on the seven
projections (TRL refuses LoRA on lm_head for DPO), beta 0.1, sigmoid loss, fp32, AdamW, constant LR; 48 pairs with
20-word prompts and 20-40-word completions (≤ 128 tokens), 2 pairs × 2 accumulation per step, 8 steps. The reference is
the base with the adapter switched off on both sides. Reported per system (median over repeats): steady-state tokens/s
(real tokens of chosen + rejected sequences, padding not counted; steps after the first), step time, peak RSS; the ratio
rayft/TRL; then rayft's DPO peak RSS against rayft's SFT step on the same rows (no second model: within 10%); and rayft
with `dpo.reference: precomputed` (one forward per micro-batch; its first pass over the pairs timed apart).

    python bench/dpo_vs_trl.py [--size smoke|default] [--out bench/results/dpo_vs_trl_cpu.json]
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

from _common import cli, machine

from rayft.demo import make_tiny_mistral

MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
SIZES = {
    "default": {"steps": 8, "repeats": 2, "pairs": 48},
    "smoke": {"steps": 2, "repeats": 1, "pairs": 16},
}


def steady(run: dict) -> dict:
    """tokens/s and seconds per step over the steps after the first (its end is the start of the window)."""
    steps = run["steps"]
    later = steps[1:] or steps
    seconds = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else steps[0]["time"]
    return {
        "tokens_per_s": sum(s["tokens"] for s in later) / seconds,
        "step_time_s": seconds / len(later),
        "peak_rss_gib": run["peak_rss_gib"],
        "losses": [round(s["loss"], 4) for s in steps],
    }


def median(runs: list[dict]) -> dict:
    keys = ("tokens_per_s", "step_time_s", "peak_rss_gib")
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in keys} | {"losses": runs[0]["losses"]}


def run(size: str) -> dict:
    from fixtures.preference import Settings, in_process, make_pairs  # tests/ is on the path through _common

    p = SIZES[size]
    root = Path(tempfile.mkdtemp(prefix="rayft-dpo-bench-"))
    model = make_tiny_mistral(root / "model", **MODEL)
    records = make_pairs(p["pairs"], seed=0, words=(20, 40), prompt_words=20)
    s = Settings(model=str(model), steps=p["steps"], batch=2, accumulation=2, max_length=128, lora_r=16)
    precomputed = dataclasses.replace(s, reference="precomputed")
    runs: dict[str, list[dict]] = {"rayft": [], "trl": [], "rayft_precomputed": []}
    for r in range(p["repeats"]):  # alternating, so both see the same machine load on average
        ours = in_process("run_rayft", s, records, root / f"rayft-{r}")
        runs["rayft"].append(steady(ours))
        theirs = in_process("run_trl", s, records, root / f"trl-{r}", str(root / f"rayft-{r}" / "initial-adapter"))
        runs["trl"].append(steady(theirs))
        once = in_process("run_rayft", precomputed, records, root / f"precomputed-{r}")
        runs["rayft_precomputed"].append(steady(once) | {"reference_pass_s": once["reference_pass_s"]})
    sft = steady(in_process("run_rayft_sft", s, records, root / "sft"))
    ours, theirs = median(runs["rayft"]), median(runs["trl"])
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    once = median(runs["rayft_precomputed"])
    once["reference_pass_s"] = round(statistics.median(r["reference_pass_s"] for r in runs["rayft_precomputed"]), 3)
    memory = runs["rayft"][0]["peak_rss_gib"] / sft["peak_rss_gib"]
    return {
        "benchmark": "dpo_vs_trl",
        "size": size,
        **machine(),
        "trl_version": __import__("trl").__version__,
        "settings": {**s.__dict__, "model": MODEL, "pairs": p["pairs"], "repeats": p["repeats"]},
        "rayft": ours,
        "trl": theirs,
        "ratio_tokens_per_s": round(ratio, 3),
        "target_ratio": 1.3,
        # dpo.reference: precomputed — one forward per micro-batch after a first pass over the pairs (timed apart)
        "rayft_precomputed": once,
        "ratio_precomputed_over_adapter_off": round(once["tokens_per_s"] / ours["tokens_per_s"], 3),
        "memory": {
            "dpo_peak_rss_gib": runs["rayft"][0]["peak_rss_gib"],
            "sft_peak_rss_gib": sft["peak_rss_gib"],
            "ratio": round(memory, 3),
            "target": "<= 1.10",
        },
        "runs": runs,
        "sft_run": sft,
    }


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "dpo_vs_trl_cpu.json")
