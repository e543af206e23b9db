"""What quantising a bf16 checkpoint into FP8 storage costs a CPU worker while loading, before and after this change.

The same bf16 matrices (default: one decoder layer of Mistral-7B's shapes, 218M weights) are written to a
safetensors file and read back in the pieces a sharded load reads (`rayft.model.weights.CHUNK_BYTES` of fp32 a
piece); then, at 1 and at 2 threads, each way fills FP8 storage (E4M3 bytes + one fp32 scale per row) from those
pieces, the two ways alternating, several rounds:
- before: the quantising branch of `_fill_fp8_` and `quantize_rows` as they were (kept here only as the
  baseline): whole-piece ops on the host, each making a piece-sized fp32 temporary;
- after: `rayft.model.weights._fill_fp8_` of this checkout (on a CPU, `HOST_QUANTIZE_BLOCK` weights of rows at a
  time in one reused fp32 workspace).
Both must give the same bytes and scales. Reported: G weights quantised per second (best and median round; the
machine is shared, the best round is the least disturbed), and after / before at the same thread count.

    python bench/fp8_quantise.py [--size small|default] [--out bench/results/fp8_quantise_cpu.json]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _common import cli, machine

SIZES = {
    # Mistral-7B's q, k, v, o, gate, up and down: [out, in]
    "default": {"shapes": [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096),
                           (4096, 14336)], "rounds": 7},
    "small": {"shapes": [(256, 512), (64, 512), (512, 256)], "rounds": 2},
}  # fmt: skip
THREADS = (1, 2)


def _quantize_rows_before(weight: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rayft.model.fp8.quantize_rows` before this change, as it was: whole-tensor ops, each making its temporary."""
    import torch.nn.functional as F

    from rayft.model.fp8 import E4M3, E4M3_MAX, STORAGE, block_scales, storage_block

    w = weight.detach().to(torch.float32)
    block = storage_block(w.shape[-1], block)
    if block is None:
        amax = w.abs().amax(dim=-1)
    else:
        padded = F.pad(w, (0, -w.shape[-1] % block))
        amax = padded.unflatten(-1, (-1, block)).abs().amax(dim=-1)
    scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    data = (w / block_scales(scale, block, w.shape[-1])).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return data.view(STORAGE), scale


def _fill_before_(
    data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, key: str, checkpoint, start: int, block: int | None
) -> None:
    """The quantising branch of `_fill_fp8_` before this change: the whole piece at once, where the rows were read."""
    from rayft.model.weights import dequantize

    q, s = _quantize_rows_before(dequantize(rows, key, checkpoint, start), block)
    data.copy_(q)
    scale.copy_(s)


def _pieces(checkpoint, shapes: list[tuple[int, int]]) -> list[tuple[int, str, int, int, torch.Tensor]]:
    """(matrix, key, first row, end row, the rows as read) of every piece a sharded load reads."""
    from rayft.model.weights import CHUNK_BYTES

    out = []
    for i, (rows, columns) in enumerate(shapes):
        step = max(1, CHUNK_BYTES // (4 * columns))
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            out.append((i, f"{i}.weight", lo, hi, checkpoint.rows(f"{i}.weight", lo, hi)))
    return out


def _fill_all(fill, pieces, checkpoint, storage) -> float:
    """Seconds `fill` takes over every piece into `storage` ((bytes, scales) per matrix)."""
    started = time.perf_counter()
    for i, key, lo, hi, rows in pieces:
        data, scale = storage[i]
        fill(data[lo:hi], scale[lo:hi], rows, key, checkpoint, lo, None)
    return time.perf_counter() - started


def run(size_name: str) -> dict:
    from safetensors.torch import save_file

    from rayft.model.fp8_format import HOST_QUANTIZE_BLOCK
    from rayft.model.weights import SafetensorsCheckpoint, _fill_fp8_

    size = SIZES[size_name]
    shapes, rounds = size["shapes"], size["rounds"]
    generator = torch.Generator().manual_seed(0)
    weights = {f"{i}.weight": torch.randn(s, generator=generator).to(torch.bfloat16) for i, s in enumerate(shapes)}
    elements = sum(r * c for r, c in shapes)
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        save_file(weights, str(Path(tmp) / "model.safetensors"))
        del weights
        checkpoint = SafetensorsCheckpoint(Path(tmp))
        started = time.perf_counter()
        pieces = _pieces(checkpoint, shapes)
        read_s = time.perf_counter() - started
        ways = {"before": _fill_before_, "after": _fill_fp8_}
        storage = {
            way: [(torch.empty(s, dtype=torch.uint8), torch.empty(s[0], dtype=torch.float32)) for s in shapes]
            for way in ways
        }
        seconds: dict[int, dict[str, list[float]]] = {}
        for threads in THREADS:
            torch.set_num_threads(threads)
            seconds[threads] = {way: [] for way in ways}
            for round_ in range(rounds):
                order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
                for way in order:
                    seconds[threads][way].append(_fill_all(ways[way], pieces, checkpoint, storage[way]))
        checkpoint.close()
    load.append(os.getloadavg()[0])
    same = all(
        torch.equal(b[0], a[0]) and torch.equal(b[1], a[1])
        for b, a in zip(storage["before"], storage["after"], strict=True)
    )
    if not same:
        raise AssertionError("the two ways stored different FP8 bytes or scales")

    def rate(times: list[float]) -> dict[str, float]:
        """G weights a second of the best and of the median round."""
        best, median = min(times), statistics.median(times)
        return {"best": round(elements / best / 1e9, 4), "median": round(elements / median / 1e9, 4)}

    per_threads = {}
    for threads, times in seconds.items():
        before, after = rate(times["before"]), rate(times["after"])
        per_threads[str(threads)] = {
            "before_g_elements_per_s": before,
            "after_g_elements_per_s": after,
            "after_over_before": {k: round(after[k] / before[k], 2) for k in ("best", "median")},
        }
    return {
        "benchmark": "fp8_quantise",
        **machine(),
        "size": size_name,
        "shapes": [list(s) for s in shapes],
        "elements": elements,
        "pieces": len(pieces),
        "rounds": rounds,
        "host_quantize_block": HOST_QUANTIZE_BLOCK,
        "read_s": round(read_s, 3),
        "identical_bytes_and_scales": same,
        "threads": per_threads,
        "after_2_threads_over_before_1_thread": {
            k: round(per_threads["2"]["after_g_elements_per_s"][k] / per_threads["1"]["before_g_elements_per_s"][k], 2)
            for k in ("best", "median")
        },
        "load_average_1m": {"start": round(load[0], 2), "end": round(load[1], 2)},
    }


if __name__ == "__main__":
    cli(__doc__, SIZES, run, "fp8_quantise_cpu.json")
