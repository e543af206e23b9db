"""The TRL side of one `bench/gpu_mfu.py` configuration: TRL `SFTTrainer` + PEFT LoRA on the same work, in a process
of its own (started by gpu_mfu.py, never on its own).

TRL patches transformers when it is imported, so it never shares the rayft measuring process. The model is built
on the device from the same transformers config and seed (random weights, no files); the data are the documents of
the same synthetic packed rows (`gpu_mfu.step_batches`), pre-tokenized in an in-memory `datasets.Dataset`, one
step's documents per optimizer step; TRL packs them itself with the options a user picks for speed (packing with
`padding_free`: position ids restarting at each document, no padding), the same attention implementation, gradient
checkpointing as the rayft configuration has it, LoRA with the same targets and rank (`trl_baseline.sft_config`,
`lora_config`, `gpu_options`: Liger kernels where `liger_kernel` is installed, unless `RAYFT_TRL_LIGER=0`). Timed
like rayft's side: the first optimizer step a warm-up, the rest timed between step ends (CUDA events on a GPU,
wall clock on CPU).

    python bench/gpu_mfu_trl.py --case NAME --result FILE [--toy]

FILE gets one JSON object: the figures, or `{"error": "trl not importable: ..."}` where TRL, PEFT or datasets is
missing (the device has none unless the kit carries them), which is an answer, not a failure (exit 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import gpu_mfu  # noqa: E402  (bench/ is no package; imports no torch)
from transformers import TrainerCallback  # noqa: E402


def documents(case: gpu_mfu.Case, size: dict[str, Any], vocab: int, max_length: int) -> list[list[int]]:
    """The token ids of every document of the step rayft times (its packed variant), cut where the row's position
    ids restart: the same documents, for TRL to pack."""
    import torch

    group, _ = gpu_mfu.step_batches("packed", max_length, size["accumulation"], vocab)
    docs = []
    for batch in group:
        ids, positions = batch["input_ids"][0], batch["position_ids"][0]
        starts = (positions == 0).nonzero().flatten().tolist()[1:]
        docs += [part.tolist() for part in torch.tensor_split(ids, starts)]
    return docs


def tokenizer(config: Any) -> Any:
    """A tokenizer built in memory for the trainer's special tokens (the rows are token ids already): no files."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": config.bos_token_id or 1, "</s>": config.eos_token_id or 2}
    vocab["<pad>"] = config.pad_token_id if config.pad_token_id not in (None, *vocab.values()) else 3
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>")  # fmt: skip


class StepClock(TrainerCallback):
    """The train start and the end of every optimizer step (a CUDA event on a GPU, else `time.perf_counter`) with
    the real tokens trained so far; the peak-memory counts restart at the train start, as rayft's side restarts
    them before its warm-up step."""

    def __init__(self, trainer: Any, device: Any) -> None:
        import torch

        self.trainer, self.device, self.torch = trainer, device, torch
        self.marks: list[Any] = []
        self.tokens: list[int] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from rayft.train.metrics import reset_peaks

        reset_peaks(self.device)
        self.mark()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.mark()

    def mark(self) -> None:
        if self.device.type == "cuda":
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        self.tokens.append(self.trainer.tokens)

    def seconds(self) -> list[float]:
        """Seconds of each optimizer step, the warm-up first."""
        if self.device.type == "cuda":
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def build(case: gpu_mfu.Case, toy: bool, out: Path) -> tuple[Any, Any, dict[str, Any]]:
    """The trainer over `case`'s model and documents (TRL's own packing, padding-free), its clock, the options."""
    import torch
    import trl_baseline
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    size = gpu_mfu.SIZES["toy" if toy else "gpu"]
    on_gpu = not toy and torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    s = gpu_mfu.settings(case, size, out)
    config = gpu_mfu.model_config(case.kind, case.toy if toy else case.shape)
    if toy:
        config.vocab_size = gpu_mfu.TOY_VOCAB
    torch.manual_seed(0)  # as rayft's side seeds its random weights
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, s["model"]["torch_dtype"]),
                                                 attn_implementation=s["model"]["attn_implementation"])  # fmt: skip
    model.config.use_cache = False
    steps = s["train"]["max_steps"]
    dataset = Dataset.from_dict(
        {"input_ids": documents(case, size, config.vocab_size, s["data"]["max_length"]) * steps}
    )
    options = {**(trl_baseline.gpu_options(s["data"]) if on_gpu else {"use_cpu": True}), "padding_free": True}
    options.pop("ddp_backend", None)  # one process, no torchrun
    trainer = trl_baseline.CountingSFTTrainer(
        model=model, args=trl_baseline.sft_config(s, out / "trainer", options), train_dataset=dataset,
        processing_class=tokenizer(config), peft_config=trl_baseline.lora_config(s["lora"]),
    )  # fmt: skip
    clock = StepClock(trainer, device)
    trainer.add_callback(clock)
    return trainer, clock, {**options, "attn_implementation": s["model"]["attn_implementation"],
                            "gradient_checkpointing": s["train"]["gradient_checkpointing"]}  # fmt: skip


def measure(case: gpu_mfu.Case, toy: bool, out: Path) -> dict[str, Any]:
    """Build and train `case` through TRL: its tokens/s after the warm-up step and its peak memory."""
    import torch

    from rayft.train.metrics import GIB, peak_rss_gib

    began = time.perf_counter()
    trainer, clock, options = build(case, toy, out)
    build_s = time.perf_counter() - began
    rss_before = gpu_mfu.rss_gib()
    trainer.train()
    seconds = clock.seconds()
    timed, tokens = seconds[1:], clock.tokens[-1] - clock.tokens[1]
    cuda = clock.device.type == "cuda"
    return {
        "tokens_per_s": tokens / sum(timed),
        "tokens_per_step": tokens // len(timed),
        "warmup_s": round(seconds[0], 4),
        "step_s": [round(x, 4) for x in timed],
        "build_s": round(build_s, 2),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3) if cuda else None,
        "peak_rss_delta_gib": None if cuda else round(peak_rss_gib() - rss_before, 4),
        "options": options,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, choices=[c.name for c in gpu_mfu.CASES])
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--toy", action="store_true")
    args = parser.parse_args(argv)
    case = next(c for c in gpu_mfu.CASES if c.name == args.case)
    try:
        import datasets  # noqa: F401
        import peft  # noqa: F401
        import trl  # noqa: F401  (what the device may lack; the rest of the TRL side imports it)
    except ImportError as error:
        result: dict[str, Any] = {"error": f"trl not importable: {error}"}
    else:
        result = {**measure(case, args.toy, args.result.parent), "trl_versions": versions()}
    args.result.write_text(json.dumps(result))
    return 0


def versions() -> dict[str, str]:
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in ("trl", "peft", "datasets", "transformers")}


if __name__ == "__main__":
    sys.exit(main())
