"""Fill an FSDP2-sharded model from safetensors files: each rank reads only the rows it owns.

No rank ever holds the whole checkpoint: every parameter's local shard (dim-0 rows, FSDP2's `Shard(0)`) is read
as exactly those bytes of the file, mapped from the checkpoint's key layout (the hub's per-expert tensors of a fused
experts parameter: just the experts a rank holds, `rayft.model.hub_keys`), dequantised from FP8 when the
checkpoint is quantised (static per-tensor or per-expert scales, or DeepSeek-V3's block-wise ones, applied per
slice) and cast to the model dtype, or quantised into FP8 or NF4 storage on the device where it will live.
Every read is planned and checked (key, shape, dtype, FP8 scale) before the first byte is copied, so a checkpoint
that does not fit the model fails whole, naming the tensors, instead of half-filling it. Tied word embeddings
(Llama-3.2, Qwen2.5, Gemma, SmolLM2: the head is the embedding matrix, stored once) are one parameter, read once.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from io import BufferedReader
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rayft.model.fp8 import block_scales, fp8_block, fp8_scale_params, quantize_rows_into_, rows_scale, scales
from rayft.model.fp8_format import EXPERT_WEIGHTS, weight_block
from rayft.model.hub_keys import ExpertParts, checkpoint_names, expert_parts
from rayft.model.nf4 import Nf4Experts, Nf4Linear, block_absmax, double_quantize, encode, quantize, storage_of, store_
from rayft.model.safetensors_format import SAFETENSORS_DTYPES
from rayft.model.vision import VISION_PARTS

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CHUNK_BYTES = 32 * 2**20  # fp32-equivalent size of the rows read (and dequantised) at once
PEFT_PREFIX = "base_model.model."


class CheckpointKeyError(RuntimeError):
    """A model tensor has no counterpart in the checkpoint: loading must fail, never leave random weights."""


class CheckpointShapeError(CheckpointKeyError):
    """A checkpoint tensor's shape or dtype does not fit the model's parameter (a transposed or resized tensor, a
    config that does not match the weights): copying its bytes anyway would give a silently wrong model."""


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the tensor's data in the file


class SafetensorsCheckpoint:
    """Reads row ranges of the tensors in a model directory's `*.safetensors` files.

    Only the headers are parsed up front; `rows()` reads exactly the requested bytes with `readinto` into the
    destination tensor — no mmap, so a rank's resident memory holds its own rows only, not the file pages it
    touched, and a network volume serves just those byte ranges.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.weight_block = weight_block(self.directory)
        self.entries: dict[str, _Entry] = {}
        for file in sorted(self.directory.glob("*.safetensors")):
            with open(file, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for key, info in header.items():
                if key != "__metadata__":
                    start = 8 + header_len + info["data_offsets"][0]
                    self.entries[key] = _Entry(file, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), start)
        self._files: dict[Path, BufferedReader] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    @property
    def weight_map(self) -> dict[str, str]:
        return {key: entry.file.name for key, entry in self.entries.items()}

    def shape(self, key: str) -> list[int]:
        return list(self.entries[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key].dtype

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor along dim 0 (the whole tensor when it is 0-d)."""
        entry = self.entries[key]
        if entry.shape and not 0 <= start <= stop <= entry.shape[0]:
            raise CheckpointShapeError(
                f"rows [{start}, {stop}) of '{key}' lie outside its shape {list(entry.shape)} in {entry.file}"
            )
        if not entry.shape:
            out, first = torch.empty((), dtype=entry.dtype), 0
        else:
            out, first = torch.empty((stop - start, *entry.shape[1:]), dtype=entry.dtype), start
        row_bytes = out[0].numel() * out.element_size() if out.ndim else 0
        # numpy arrays export the buffer protocol; numpy 2.3's stubs do not declare it
        buffer = memoryview(out.view(torch.uint8).numpy() if out.ndim else out.reshape(1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        f = self._files.get(entry.file) or self._files.setdefault(entry.file, open(entry.file, "rb"))  # noqa: SIM115
        f.seek(entry.offset + first * row_bytes)
        done = 0
        while done < len(buffer):
            n = f.readinto(buffer[done:])
            if not n:
                raise CheckpointKeyError(f"{entry.file} ends inside tensor '{key}' (truncated download?)")
            done += n
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def checkpoint_key(name: str, checkpoint: SafetensorsCheckpoint) -> str:
    """Where a text model's tensor lives in the checkpoint: plain causal LM, llava-style VLM wrapper
    (`language_model.model.*`, `language_model.lm_head.*`) or transformers-5 wrapper (`model.language_model.*`);
    and a whole wrapper's tensor (`model.vision: true`, its transformers-5 names) in the llava-style hub layout."""
    for candidate in _wrapper_forms(name):
        if candidate in checkpoint:
            return candidate
    raise CheckpointKeyError(f"'{name}' is not in the checkpoint at {checkpoint.directory}")


def _wrapper_forms(name: str) -> tuple[str, str, str, str]:
    """A text model's tensor name as a plain causal LM, the llava-style and the transformers-5 VLM wrapper store it;
    last, a whole wrapper's name (`model.language_model.*`, `model.vision_tower.*`, ...) in the llava-style layout."""
    return name, f"language_model.{name}", f"model.language_model.{name.removeprefix('model.')}", _llava_form(name)


def _llava_form(name: str) -> str:
    """A transformers-5 wrapper name as the llava-style hub files hold it (the text model's under
    `language_model.model.`, the tower's and projector's at the top); other names as they are."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith(tuple(f"model.{part}." for part in VISION_PARTS)):
        return name.removeprefix("model.")
    return name


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Head name → embedding name (the base model's own names, as in checkpoints: `lm_head.weight` →
    `model.embed_tokens.weight`) for the weights the model's config ties; {} when nothing is tied.

    transformers decides this (`tie_word_embeddings` and the class's `_tied_weights_keys`); a tied head is the same
    parameter as its embedding, so a checkpoint stores it once and needs only one of the two names."""
    base = cast("PeftModel", model).get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel
    expand = getattr(base, "get_expanded_tied_weights_keys", None)
    return dict(expand(all_submodels=True)) if expand is not None else {}


def tie_weights_(model: nn.Module) -> None:
    """Make every tied head the very parameter of its embedding (one tensor, one FSDP shard, read once).

    Call it before `fully_shard` so FSDP2 manages the pair as one parameter; a later `to_empty` of a plain (unsharded)
    model splits them again (`nn.Module._apply` makes a new parameter per module), which calling this again undoes."""
    owners: dict[str, list[tuple[nn.Module, str, nn.Parameter]]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        module_name, _, attr = name.rpartition(".")
        owners[model_param_name(name)].append((model.get_submodule(module_name), attr, param))
    for head, embedding in tied_parameters(model).items():
        if not owners.get(head) or not owners.get(embedding):
            continue
        shared = owners[embedding][0][2]
        for module, attr, param in owners[head]:
            if param is shared:
                continue
            if isinstance(param, DTensor) or isinstance(shared, DTensor):
                raise RuntimeError(f"'{head}' and '{embedding}' were sharded as two parameters: tie before fully_shard")
            setattr(module, attr, shared)


def model_param_name(name: str) -> str:
    """The base model's own name for a parameter of the PEFT-wrapped model; a `modules_to_save` module's frozen
    original and its trained copy both start as the base model's tensor."""
    name = re.sub(r"(\.base_layer)+\.", ".", name.removeprefix(PEFT_PREFIX))  # nested wrappers: experts
    return re.sub(r"\.(original_module|modules_to_save\.[^.]+)\.", ".", name)


def load_sharded_(model: nn.Module, directory: Path) -> None:
    """Copy every base parameter's local shard from the checkpoint and give the LoRA parameters a fresh init.
    Nothing is copied unless every tensor is there with the model's shape and a usable dtype."""
    checkpoint = SafetensorsCheckpoint(directory)
    try:
        tie_weights_(model)
        reads = plan_reads(model, checkpoint)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_" in name and DORA_MAGNITUDE not in name:
                    local, start, shape = _lora_rows(model, name, param)
                    _init_lora_(name, local, shape, start)
            for read in reads:
                _copy_rows_(read, checkpoint)
            _init_dora_magnitudes_(model)
    finally:
        checkpoint.close()


@dataclass(frozen=True)
class _Read:
    """One parameter's local shard and where its rows come from: one checkpoint tensor, or (a fused experts
    parameter in the hub's per-expert layout) each of its experts' part tensors."""

    key: str  # the tensor, or the first expert's first part (for messages)
    local: torch.Tensor
    start: int
    scale: tuple[torch.Tensor, int] | None = None  # FP8 storage (`rayft.model.fp8`): its row scales, filled with it
    experts: ExpertParts | None = None
    block: int | None = None  # FP8 storage: the column block width of its scales (None: one per row)
    nf4: tuple[Nf4Linear | Nf4Experts, str] | None = None  # NF4 storage (`rayft.model.nf4`): its module and weight name


def plan_reads(model: nn.Module, checkpoint: SafetensorsCheckpoint) -> list[_Read]:
    """Every base parameter's checkpoint tensors, checked against the checkpoint's shape and dtype; raises
    `CheckpointKeyError` for missing tensors and `CheckpointShapeError` for ones that do not fit, naming them all."""
    partners = {}
    for head, embedding in tied_parameters(model).items():
        partners[head], partners[embedding] = embedding, head  # either name serves the one tied parameter
    fp8_scales, nf4_weights = fp8_scale_params(model), _nf4_weights(model)
    filled_with_weight = {id(p) for p in fp8_scales.values()} | {
        id(p) for module, weight in nf4_weights.values() for p in storage_of(module, weight)[1:]
    }
    model_type = _model_type(model)
    reads, missing, misfits = [], [], []
    for name, param in model.named_parameters():
        if ".lora_" in name or id(param) in filled_with_weight:
            continue
        base_name, nf4 = model_param_name(name), nf4_weights.get(name)
        wanted, fp8_storage = _global_shape(model, name, param), name in fp8_scales or nf4 is not None
        if nf4 is not None:  # codes, two a byte: the checkpoint's tensor is the whole weight
            wanted = (_nf4_shape(*nf4), param.dtype)
        source = _find_source(model_type, base_name, checkpoint) or _find_source(
            model_type, partners.get(base_name), checkpoint
        )
        if source is None:
            missing.append(base_name)
            continue
        key, parts = source
        if parts is None:
            problems = [p for p in [_misfit(base_name, wanted, key, checkpoint, fp8_storage)] if p]
        else:
            problems, absent = _expert_misfits(base_name, wanted, parts, checkpoint, fp8_storage)
            missing += absent
        if problems:
            misfits += problems
            continue
        local, start = _rows(model, name, param)
        scale = _rows(model, name, fp8_scales[name]) if name in fp8_scales else None
        block = fp8_block(model, name) if name in fp8_scales else None
        reads.append(_Read(key, local, start, scale, parts, block, nf4))
    reads += _buffer_reads(model, model_type, checkpoint, misfits)
    if missing:
        raise CheckpointKeyError(
            f"the checkpoint at {checkpoint.directory} lacks {len(missing)} model tensors: {_first(missing)}"
        )
    if misfits:
        raise CheckpointShapeError(
            f"the checkpoint at {checkpoint.directory} does not fit the model ({len(misfits)} tensors): "
            f"{_first(misfits, shown=2)}; is model_name_or_path the checkpoint this config describes?"
        )
    return reads


def _buffer_reads(
    model: nn.Module, model_type: str, checkpoint: SafetensorsCheckpoint, misfits: list[str]
) -> list[_Read]:
    """The persistent buffers the checkpoint holds, read whole (FSDP does not shard buffers): DeepSeek-V3's routing
    bias `mlp.gate.e_score_correction_bias` is a buffer, and a trained one. A buffer the file lacks keeps its
    computed value, as `from_pretrained` keeps it."""
    reads = []
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            base_name = model_param_name(f"{module_name}.{name}" if module_name else name)
            source = _find_source(model_type, base_name, checkpoint)
            if source is None or source[1] is not None:
                continue
            misfit = _misfit(base_name, (list(buffer.shape), buffer.dtype), source[0], checkpoint)
            if misfit:
                misfits.append(misfit)
            else:
                reads.append(_Read(source[0], buffer, 0))
    return reads


def _model_type(model: nn.Module) -> str:
    base = cast("PeftModel", model).get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel
    config = getattr(base, "config", None)
    text = config.get_text_config() if config is not None else None  # a vision wrapper: its language model's layout
    return getattr(text, "model_type", "") or ""


def _find_source(
    model_type: str, name: str | None, checkpoint: SafetensorsCheckpoint
) -> tuple[str, ExpertParts | None] | None:
    """(key, None) for a parameter stored whole (under its own or its hub name); (its first expert's first part,
    the part names) for a fused experts parameter stored per expert; None when the checkpoint has neither."""
    if name is None:
        return None
    for candidate in checkpoint_names(model_type, name):
        key = _find_key(candidate, checkpoint)
        if key is not None:
            return key, None
    for parts in expert_parts(model_type, name):
        for form, first in enumerate(_wrapper_forms(parts.keys(0)[0])):
            if first in checkpoint:  # every part in the wrapper form the first expert's key has
                return first, parts.renamed(lambda key, form=form: _wrapper_forms(key)[form])
    return None


def _find_key(name: str | None, checkpoint: SafetensorsCheckpoint) -> str | None:
    if name is None:
        return None
    try:
        return checkpoint_key(name, checkpoint)
    except CheckpointKeyError:
        return None


def _misfit(
    name: str,
    param: tuple[list[int], torch.dtype],
    key: str,
    checkpoint: SafetensorsCheckpoint,
    fp8_storage: bool = False,
) -> str | None:
    """Why the checkpoint's `key` cannot fill a parameter of (global shape, dtype) `param`, or None. FP8 storage
    (E4M3 bytes in a uint8 parameter) takes any floating-point tensor: its own bytes, or quantised per row while
    loading."""
    (wanted, param_dtype), stored = param, checkpoint.shape(key)
    if stored != wanted:
        return f"'{key}' has shape {stored} in the checkpoint, the model's '{name}' has {wanted}"
    return _dtype_misfit(name, param_dtype, key, checkpoint, fp8_storage)


def _dtype_misfit(
    name: str, param_dtype: torch.dtype, key: str, checkpoint: SafetensorsCheckpoint, fp8_storage: bool
) -> str | None:
    dtype = checkpoint.dtype(key)
    wanted_float = fp8_storage or param_dtype.is_floating_point
    if wanted_float != dtype.is_floating_point or (not wanted_float and dtype != param_dtype):
        return f"'{key}' is {dtype} in the checkpoint, the model's '{name}' is {param_dtype}"
    if dtype in FP8_DTYPES:
        try:
            fp8_scale_key(key, checkpoint)
        except CheckpointKeyError as e:
            return str(e)
    return None


def _expert_misfits(
    name: str,
    param: tuple[list[int], torch.dtype],
    parts: ExpertParts,
    checkpoint: SafetensorsCheckpoint,
    fp8_storage: bool,
) -> tuple[list[str], list[str]]:
    """(misfits, missing keys) of a fused `[E, rows, ...]` parameter stored per expert: every expert's parts are
    there, each `[part rows, ...]` with the parameter's trailing shape, and the parts' rows add up to `rows`."""
    (wanted, param_dtype), misfits, missing = param, [], []
    for expert in range(wanted[0]):
        keys = list(parts.keys(expert))
        absent = [key for key in keys if key not in checkpoint]
        if absent:
            missing += absent
            continue
        shapes = [checkpoint.shape(key) for key in keys]
        if any(shape[1:] != wanted[2:] for shape in shapes) or sum(shape[0] for shape in shapes) != wanted[1]:
            misfits.append(
                f"'{keys[0]}' ({' + '.join(map(str, shapes))} concatenated) does not make expert {expert} of the "
                f"model's '{name}' {wanted}"
            )
        misfits += [p for key in keys if (p := _dtype_misfit(name, param_dtype, key, checkpoint, fp8_storage))]
    return misfits, missing


def _first(items: list[str], shown: int = 5) -> str:
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def _copy_rows_(read: _Read, checkpoint: SafetensorsCheckpoint) -> None:
    """Fill a local shard piece by piece (`_pieces`): the temporaries (raw rows, their fp32 dequantisation) stay a
    bounded size however large the tensor (a 128-expert fused weight is GBs)."""
    if read.local.ndim == 0:
        read.local.copy_(dequantize(checkpoint.rows(read.key, 0, 1), read.key, checkpoint, 0).reshape(()))
        return
    if read.nf4 is not None:
        _fill_nf4_(read, checkpoint)
        return
    scale = None
    if read.scale is not None:
        scale = scales(read.scale[0])  # fp32 view of the int32 scale storage
        if read.scale[1] != read.start or scale.shape[0] != read.local.shape[0]:
            raise RuntimeError(f"'{read.key}': its FP8 row scales are sharded unlike its rows")
    for index, key, lo, hi in _pieces(read, checkpoint):
        rows = checkpoint.rows(key, lo, hi)
        if scale is None:
            read.local[index].copy_(dequantize(rows, key, checkpoint, lo))
        else:
            _fill_fp8_(read.local[index], scale[index], rows, key, checkpoint, lo, read.block)


def _pieces(read: _Read, checkpoint: SafetensorsCheckpoint) -> Iterator[tuple[tuple[int | slice, ...], str, int, int]]:
    """(index into the local shard, checkpoint key, first row, end row) of each read: bounded chunks of rows of one
    tensor, or for a parameter stored per expert each held expert's parts (a global row is an expert)."""
    local = read.local
    if read.experts is None:
        step = max(1, CHUNK_BYTES // max(1, 4 * math.prod(local.shape[1:])))
        for lo in range(0, local.shape[0], step):
            hi = min(lo + step, local.shape[0])
            yield (slice(lo, hi),), read.key, read.start + lo, read.start + hi
        return
    for i in range(local.shape[0]):
        offset = 0
        for key in read.experts.keys(read.start + i):
            rows = checkpoint.shape(key)[0]
            yield (i, slice(offset, offset + rows)), key, 0, rows
            offset += rows


def _fill_fp8_(
    data: torch.Tensor,
    scale: torch.Tensor,
    rows: torch.Tensor,
    key: str,
    checkpoint: SafetensorsCheckpoint,
    start: int,
    block: int | None,
) -> None:
    """Fill a piece of FP8 storage (E4M3 bytes + scales per row or `block`-wide column block, `rayft.model.fp8`) from
    checkpoint rows (from row `start`): an E4M3 checkpoint's bytes and scales as they are, where the storage's
    layout holds them losslessly; anything else quantised where it will live (a GPU's rows on the GPU)."""
    stored = (
        _stored_scale(rows, key, checkpoint, start, scale.shape, block) if rows.dtype == torch.float8_e4m3fn else None
    )
    if stored is not None:
        data.copy_(rows.view(data.dtype))
        scale.copy_(stored)
    else:
        rows = rows.to(data.device)  # quantised where it will live
        quantize_rows_into_(data, scale, dequantize(rows, key, checkpoint, start), block)


def _nf4_weights(model: nn.Module) -> dict[str, tuple[Nf4Linear | Nf4Experts, str]]:
    """Full name of each NF4 code parameter → its module and the weight's name there."""
    found: dict[str, tuple[Nf4Linear | Nf4Experts, str]] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        weights = (
            ("weight",) if isinstance(module, Nf4Linear) else EXPERT_WEIGHTS if isinstance(module, Nf4Experts) else ()
        )
        found.update({prefix + weight: (cast("Nf4Linear | Nf4Experts", module), weight) for weight in weights})
    return found


def _nf4_shape(module: Nf4Linear | Nf4Experts, weight: str) -> list[int]:
    """The whole weight an NF4 parameter holds the codes of (all experts)."""
    if isinstance(module, Nf4Linear):
        return [module.out_features, module.in_features]
    return list(module.shapes[weight])


def _fill_nf4_(read: _Read, checkpoint: SafetensorsCheckpoint) -> None:
    """Fill this rank's shards of an NF4 weight: a linear from its rows, experts whole, one at a time, in the dtype
    the module quantises in (what `from_pretrained` would have loaded)."""
    assert read.nf4 is not None  # `_copy_rows_` sends NF4 reads alone here
    module, weight = read.nf4
    if isinstance(module, Nf4Experts):
        local = [_local_rows(p)[0] for p in storage_of(module, weight)]
        expert = torch.empty(module.shapes[weight][1:], dtype=module.quant_dtype, device=read.local.device)
        for i in range(read.local.shape[0]):
            for index, key, lo, hi in _expert_pieces(read, checkpoint, i):
                rows = checkpoint.rows(key, lo, hi).to(expert.device)  # quantised where it will live
                expert[index].copy_(dequantize(rows, key, checkpoint, lo).reshape(expert[index].shape))
            store_(tuple(t[i] for t in local), quantize(expert))
        return
    _fill_nf4_rows_(read, checkpoint, module)


def _expert_pieces(read: _Read, checkpoint: SafetensorsCheckpoint, i: int) -> Iterator[tuple[slice, str, int, int]]:
    """(rows of the expert, checkpoint key, first row, end row) of local expert `i`: its parts' tensors, or its
    row of the fused tensor."""
    expert = read.start + i
    if read.experts is None:
        yield slice(None), read.key, expert, expert + 1
        return
    offset = 0
    for key in read.experts.keys(expert):
        rows = checkpoint.shape(key)[0]
        yield slice(offset, offset + rows), key, 0, rows
        offset += rows


def _fill_nf4_rows_(read: _Read, checkpoint: SafetensorsCheckpoint, layer: Nf4Linear) -> None:
    """An NF4 linear's shards from this rank's rows of the weight. The scalers' mean and group factors are over the
    whole weight: the ranks' block maxima (1/64 of the weight) are all-gathered once, so every rank stores what
    quantising the whole weight gives, having read only its own rows."""
    start, count = read.start, read.local.shape[0]
    rows = checkpoint.rows(read.key, start, start + count).to(read.local.device)  # quantised where it will live
    rows = dequantize(rows, read.key, checkpoint, start).to(layer.quant_dtype)
    absmax = block_absmax(rows)
    whole = _gathered_shards(absmax.view(count, -1), layer.weight, layer.out_features)
    scalers, factors, mean = double_quantize(whole.flatten())
    read.local.copy_(encode(rows, absmax).view(count, -1))
    for param, values in (
        (layer.weight_scalers, scalers.view(layer.out_features, -1)),
        (layer.weight_factors, factors),
        (layer.weight_mean, mean),
    ):
        local, first = _local_rows(param)
        (local if param.dtype == values.dtype else local.view(values.dtype)).copy_(values[first : first + len(local)])


def _gathered_shards(local: torch.Tensor, param: torch.Tensor, rows: int) -> torch.Tensor:
    """The whole of a tensor sharded on dim 0 as `param` is (FSDP2's even chunks, the last ones short or empty):
    every rank's `local` part, gathered over the param's shard group as bytes (gloo has no bf16)."""
    if not isinstance(param, DTensor):
        return local
    mesh_dim = next(i for i, p in enumerate(param.placements) if isinstance(p, Shard))
    group = param.device_mesh.get_group(mesh_dim)
    chunk = -(-rows // group.size())
    padded = local.new_zeros(chunk, *local.shape[1:])
    padded[: len(local)] = local
    parts = [torch.empty_like(padded.view(torch.uint8)) for _ in range(group.size())]
    dist.all_gather(parts, padded.view(torch.uint8), group=group)
    return torch.cat(parts).view(local.dtype)[:rows]


def _stored_scale(
    rows: torch.Tensor, key: str, checkpoint: SafetensorsCheckpoint, start: int, shape: torch.Size, block: int | None
) -> torch.Tensor | None:
    """The file's scales of E4M3 `rows` in the storage's layout (`shape`: per row, or per row and `block`-wide
    column block), or None where that layout cannot hold them (block-wise scales of another width)."""
    scale, kind = fp8_scale(rows, key, checkpoint, start), _scale_kind(key, checkpoint)[1]
    if kind != "block":
        per_row = rows_scale(scale, rows.shape)
        return per_row if block is None else per_row.unsqueeze(-1).expand(shape)
    if block is None:
        return scale.squeeze(-1) if scale.shape[-1] == 1 else None
    assert checkpoint.weight_block is not None  # block-wise scales: `_scale_kind` found the config's block size
    return scale if block == checkpoint.weight_block[1] and scale.shape == shape else None


def dequantize(rows: torch.Tensor, key: str, checkpoint: SafetensorsCheckpoint, start: int) -> torch.Tensor:
    """FP8 rows × their static scale: a 0-d per-tensor scale, one per row of dim 0 ([E,1,1] for experts), or one per
    block of a block-wise checkpoint."""
    if rows.dtype not in FP8_DTYPES:
        return rows
    scale = fp8_scale(rows, key, checkpoint, start).to(rows.device, torch.float32)
    kind = _scale_kind(key, checkpoint)[1]
    if kind == "block":
        assert checkpoint.weight_block is not None  # as `_scale_kind` found it
        scale = block_scales(scale, checkpoint.weight_block[1], rows.shape[-1])
    elif kind == "row":
        scale = scale.reshape(scale.shape[0], *[1] * (rows.ndim - 1))
    return rows.to(torch.float32) * scale


def fp8_scale(rows: torch.Tensor, key: str, checkpoint: SafetensorsCheckpoint, start: int) -> torch.Tensor:
    """The static scale of FP8 `rows` (from row `start`): 0-d per tensor, the rows' own ([n,1,1] per expert), or for
    a block-wise checkpoint `[n, column blocks]`, each row given its row block's scales."""
    scale_key, kind = _scale_kind(key, checkpoint)
    if kind == "tensor":
        return checkpoint.rows(scale_key, 0, 1).reshape(())
    if kind == "row":
        return checkpoint.rows(scale_key, start, start + rows.shape[0])
    assert checkpoint.weight_block is not None  # block-wise scales: `_scale_kind` found the config's block size
    row_block, n = checkpoint.weight_block[0], rows.shape[0]
    first = start // row_block
    blocks = checkpoint.rows(scale_key, first, max(first, (start + n - 1) // row_block + 1))
    return blocks[torch.arange(start, start + n) // row_block - first]


def fp8_scale_key(key: str, checkpoint: SafetensorsCheckpoint) -> str:
    """The scale of an FP8 tensor: static per tensor (one value) or per row of dim 0 (per expert), or block-wise."""
    return _scale_kind(key, checkpoint)[0]


def _scale_kind(key: str, checkpoint: SafetensorsCheckpoint) -> tuple[str, str]:
    """(scale key, `tensor` | `row` | `block`) of an FP8 tensor; raises naming the key when it has none that fits."""
    scale_key = next(
        (k for k in (f"{key}_scale_inv", f"{key.rsplit('.', 1)[0]}.weight_scale_inv") if k in checkpoint), None
    )
    if scale_key is None:
        raise CheckpointKeyError(f"FP8 tensor '{key}' has no '{key}_scale_inv' / 'weight_scale_inv' scale")
    scale_shape, shape, block = checkpoint.shape(scale_key), checkpoint.shape(key), checkpoint.weight_block
    if math.prod(scale_shape) == 1:
        return scale_key, "tensor"
    if scale_shape and scale_shape[0] == shape[0] and math.prod(scale_shape[1:]) == 1:
        return scale_key, "row"
    if (
        block is not None
        and len(shape) == 2
        and scale_shape == [math.ceil(n / b) for n, b in zip(shape, block, strict=True)]
    ):
        return scale_key, "block"
    raise CheckpointShapeError(
        f"'{scale_key}' has shape {scale_shape}: neither a static per-tensor / per-row FP8 scale nor the block-wise "
        f"scales of the config's quantization_config.weight_block_size ({list(block) if block else None}) for "
        f"'{key}' {shape}; is config.json the one of these weights?"
    )


def _expert_rows(model: nn.Module, name: str) -> tuple[int, int, int] | None:
    """(first expert, experts held, E) when `name` belongs to routed experts split by expert parallelism
    (`rayft.parallel.expert`: the experts module's `ep_rows`), else None."""
    if ".lora_" in name:  # a LoRA factor: its wrapper's base layer (for expert LoRA, the experts)
        wrapper = model.get_submodule(name.split(".lora_")[0])
        owner = cast("BaseTunerLayer", wrapper).get_base_layer() if hasattr(wrapper, "get_base_layer") else wrapper
    else:
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return getattr(owner, "ep_rows", None)


def _global_shape(model: nn.Module, name: str, param: torch.Tensor) -> tuple[list[int], torch.dtype]:
    """The parameter's whole shape (all experts for an expert-parallel one) and its dtype."""
    shape, rows = list(param.shape), _expert_rows(model, name)
    if rows is not None:
        shape[0] = rows[2]
    return shape, param.dtype


def _lora_rows(model: nn.Module, name: str, param: torch.Tensor) -> tuple[torch.Tensor, int, torch.Size]:
    """A LoRA factor's local rows, the global row they start at and the whole factor's shape. An expert-parallel
    lora_A ([experts·r, in], expert-major) holds its experts' rows of the one all E experts would have, so it
    starts as those rows of the same random draw."""
    rows = _expert_rows(model, name)
    if rows is None or ".lora_A." not in name:
        local, start = _local_rows(param)
        return local, start, param.shape
    first, held, total = rows
    rank = param.shape[0] // held
    return param.data, first * rank, torch.Size((total * rank, *param.shape[1:]))


def _rows(model: nn.Module, name: str, param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of a parameter and the global row they start at (its FSDP shard, or its experts)."""
    rows = _expert_rows(model, name)
    if rows is None:
        return _local_rows(param)
    return param.data, rows[0]


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's shard of a parameter and the global row it starts at."""
    if not isinstance(param, DTensor):
        return param.data, 0
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), (offset[0] if offset else 0)


def _init_lora_(name: str, local: torch.Tensor, shape: torch.Size, start: int) -> None:
    """PEFT's default init (`LoraLayer.reset_lora_parameters`), so the adapter starts as a zero delta: linear layers
    A ~ kaiming-uniform, B = 0; embeddings the other way round, `lora_embedding_A` = 0, `lora_embedding_B` ~ N(0, 1).
    Every rank draws the whole (small) random matrix from the same seeded stream and keeps its rows, so the adapter
    starts the same however the weights are sharded or replicated."""
    if ".lora_B." in name or ".lora_embedding_A." in name:
        local.zero_()
        return
    full = torch.empty(shape, dtype=local.dtype, device=local.device)
    if ".lora_embedding_B." in name:
        nn.init.normal_(full)
    else:
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
    local.copy_(full[start : start + local.shape[0]])


DORA_MAGNITUDE = ".lora_magnitude_vector."


def _init_dora_magnitudes_(model: nn.Module) -> None:
    """DoRA's magnitude starts, as in PEFT (`DoraLinearLayer.update_layer`, B = 0), as the norm of each row of the
    loaded base weight. FSDP2 cuts the weight [out, in] and the magnitude [out] into the same row blocks, so each rank
    computes its own rows from its own shard, nothing gathered."""
    for name, param in model.named_parameters():
        if DORA_MAGNITUDE not in name:
            continue
        layer = cast("BaseTunerLayer", model.get_submodule(name.split(DORA_MAGNITUDE)[0]))  # DoRA's LoRA layer
        local_weight, _ = _local_rows(cast(torch.Tensor, layer.get_base_layer().weight))
        local, _ = _local_rows(param)
        local.copy_(torch.linalg.norm(local_weight, dim=1).to(local.dtype))


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """`to_empty` wipes buffers too; computed ones (rotary frequencies) are not in checkpoints: put them back."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    yield
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in saved and buffer.shape == saved[name].shape:
                buffer.copy_(saved[name].to(buffer.device))
