"""The seeds' recipe as users run it: TRL `SFTTrainer` with the seed script's `SFTConfig` fields + PEFT LoRA, one
process per device under torchrun. Started by `train_vs_trl.py` (never on its own); every rank writes
`<out>/rank<R>.json` with its step end times, tokens and losses.

Differences from the seed script, each because it cannot run as written today or on this machine:
- `warmup_ratio` (removed from transformers' TrainingArguments) becomes `warmup_steps = ceil(ratio · max_steps)`;
- `max_seq_length` is now `max_length`; `use_cpu` and the gloo backend on a CPU machine;
- empty wikitext lines are dropped (the seed trains on them; rayft skips them): both sides see the same records;
- rayft starts every document with the BOS token; where the tokenizer's own config adds none (the tekken tokenizer
  here), the text gets `<s>` in front, so both sides train on identical token ids (`<s>` text `</s>`).

On a GPU (settings `ray.use_gpu: true`, `train_vs_trl.py --size gpu`) it runs as a user tuning it would: weights
in the model's bf16, packing with `padding_free` (best-fit packing, position ids, no padding), gradient
checkpointing, fused AdamW from the settings, Liger kernels when the package is installed, NCCL; each rank also
records its peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
from pathlib import Path

T0 = time.time()  # process start, for the time to the first step

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from peft import LoraConfig, TaskType  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402


class Timeline(TrainerCallback):
    """Wall time at the end of every optimizer step and the logged losses."""

    def __init__(self, trainer: CountingSFTTrainer):
        self.trainer = trainer
        self.steps: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"step": state.global_step, "time": time.time(), "tokens": self.trainer.tokens})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and self.steps and self.steps[-1]["step"] == state.global_step:
            self.steps[-1]["loss"] = logs["loss"]


class CountingSFTTrainer(SFTTrainer):
    """Counts the real (non-padding) tokens this rank trains on."""

    tokens = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        mask = inputs.get("attention_mask")
        self.tokens += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
        return super().training_step(model, inputs, num_items_in_batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--settings", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sequential", action="store_true", help="records in file order (the loss-parity runs)")
    args = parser.parse_args()
    s = json.loads(args.settings.read_text())
    lora, data = s["lora"], s["data"]
    rank = int(os.environ.get("RANK", "0"))  # set by torchrun
    on_gpu = bool(s["ray"].get("use_gpu")) and torch.cuda.is_available()

    files = sorted(str(p) for p in Path(data["dataset_name_or_path"]).glob("*/train-*.parquet"))
    dataset = load_dataset("parquet", data_files=files, split="train")
    dataset = dataset.filter(lambda r: bool(r[data["text_field"]].strip()))
    dtype = getattr(torch, s["model"].get("torch_dtype", "float32")) if on_gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(
        s["model"]["model_name_or_path"], dtype=dtype, use_cache=False,
        attn_implementation=s["model"].get("attn_implementation", "sdpa"),
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(s["model"]["model_name_or_path"])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer("a")["input_ids"][0] != tokenizer.bos_token_id:  # same token ids as rayft: <s> text </s>
        field = data["text_field"]
        dataset = dataset.map(lambda r: {field: tokenizer.bos_token + r[field]})
    options = gpu_options(data) if on_gpu else {"use_cpu": True, "ddp_backend": "gloo"}
    config = sft_config(s, args.out / "trainer", options, sequential=args.sequential)
    trainer = CountingSFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=lora_config(lora)
    )
    timeline = Timeline(trainer)
    trainer.add_callback(timeline)
    started = time.time()
    trainer.train()
    peak_rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"process_start": T0, "train_start": started, "steps": timeline.steps, "peak_rss_gib": peak_rss_gib}
    if on_gpu:
        record.update(
            peak_gpu_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
            peak_gpu_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
            options={k: v for k, v in gpu_options(data).items() if k != "ddp_backend"},
        )
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    if torch.distributed.is_initialized():  # gloo's threads left to interpreter exit can abort a rank (SIGABRT)
        torch.distributed.destroy_process_group()


def lora_config(lora: dict) -> LoraConfig:
    """PEFT's LoRA from the settings' `lora` section: the same adapters rayft trains."""
    return LoraConfig(
        r=lora["r"],
        lora_alpha=lora["lora_alpha"],
        lora_dropout=lora["lora_dropout"],
        target_modules=lora["target_modules"],
        bias="none",
        task_type=TaskType.CAUSAL_LM,
    )


def sft_config(s: dict, output_dir: Path, options: dict, sequential: bool = False) -> SFTConfig:
    """The seed script's `SFTConfig` fields from the settings (rayft's config, as JSON), with the device's
    `options` (`gpu_options` on a GPU): what both the file-based baseline and gpu_mfu's TRL side train with."""
    t, data = s["train"], s["data"]
    return SFTConfig(
        output_dir=str(output_dir),
        max_steps=t["max_steps"],
        per_device_train_batch_size=t["per_device_train_batch_size"],
        gradient_accumulation_steps=t["gradient_accumulation_steps"],
        gradient_checkpointing=t["gradient_checkpointing"],
        optim=t["optim"],
        learning_rate=t["learning_rate"],
        lr_scheduler_type=t["lr_scheduler_type"],
        warmup_steps=math.ceil(t["warmup_ratio"] * t["max_steps"]),
        weight_decay=t["weight_decay"],
        bf16=t["bf16"],  # on CPU: bf16 autocast, as rayft does there
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        seed=t["seed"],
        dataset_text_field=data["text_field"],
        max_length=data["max_length"],
        packing=data["packing"],
        **options,
        dataloader_drop_last=True,
        train_sampling_strategy="sequential" if sequential else "random",
        disable_tqdm=True,
    )


def liger_wanted() -> bool:
    """Liger kernels where installed, unless RAYFT_TRL_LIGER=0 (should a Liger release not work on the device)."""
    return os.environ.get("RAYFT_TRL_LIGER", "auto") != "0"


def gpu_options(data: dict) -> dict:
    """SFTConfig's fastest settings for packed LoRA training on GPUs (Liger only where it is installed)."""
    import importlib.util

    return {
        "padding_free": bool(data["packing"]),
        "use_liger_kernel": liger_wanted() and importlib.util.find_spec("liger_kernel") is not None,
        "ddp_backend": "nccl",
    }


if __name__ == "__main__":
    main()
