"""Training state in DCP without pickles: tensors go to DCP as tensors, everything else as JSON inside a tensor.

DCP stores a non-tensor value (an int, a tuple, a NumPy RNG state) by pickling it and reads it back with
`torch.load(weights_only=False)`, and it reads every checkpoint's `.metadata` with `pickle.load`: resuming from a
directory someone else wrote would run their code. Here the non-tensor parts of a state dict (progress, scheduler,
optimizer hyperparameters, Python/NumPy RNG) travel as one JSON document stored as a uint8 tensor, and the metadata
is read by an unpickler that knows only DCP's own metadata classes.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

if TYPE_CHECKING:
    import io

    from torch.distributed.checkpoint.planner import ReadItem

_TENSOR = "__tensor__"  # placeholder in the JSON tree where a tensor sits in the state dict
_TUPLE = "__tuple__"  # JSON has no tuples; RNG states and optimizer betas must come back as tuples


class CheckpointFormatError(ValueError):
    """A checkpoint this rayft cannot (or will not) read: one line naming the checkpoint and what to do."""


def split(tree: Any, path: str = "") -> tuple[Any, Any]:
    """(tensors, document): the tensors of a nested state dict, nested the same way, and the rest as JSON-able data
    with a placeholder where each tensor was."""
    if isinstance(tree, torch.Tensor):
        return tree, _TENSOR
    if isinstance(tree, dict):
        tensors, doc = {}, {}
        for key, value in tree.items():
            if not isinstance(key, str):
                raise TypeError(f"training state: key {key!r} under {path or '/'} is not a string")
            sub_tensors, doc[key] = split(value, f"{path}/{key}")
            if sub_tensors is not None:
                tensors[key] = sub_tensors
        return tensors or None, doc
    if isinstance(tree, list | tuple):
        items = [split(value, f"{path}/{i}") for i, value in enumerate(tree)]
        if any(t is not None for t, _ in items):
            raise TypeError(f"training state: {path} is a sequence holding tensors; use a dict")
        docs = [d for _, d in items]
        return None, {_TUPLE: docs} if isinstance(tree, tuple) else docs
    if tree is None or isinstance(tree, bool | int | float | str):
        return None, tree
    raise TypeError(f"training state: {path} is a {type(tree).__name__}, neither a tensor nor JSON data")


def join(doc: Any, tensors: Any) -> Any:
    """The inverse of `split`: the document with each placeholder replaced by its (loaded) tensor."""
    if doc == _TENSOR:
        return tensors
    if isinstance(doc, dict):
        if set(doc) == {_TUPLE}:
            return tuple(join(d, None) for d in doc[_TUPLE])
        return {k: join(v, (tensors or {}).get(k)) for k, v in doc.items()}
    if isinstance(doc, list):
        return [join(d, None) for d in doc]
    return doc


def to_tensor(doc: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(doc, allow_nan=True).encode()), dtype=torch.uint8).clone()


def from_tensor(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.tolist()).decode())


class _MetadataUnpickler(pickle.Unpickler):
    """Only what DCP's own `.metadata` holds: its metadata classes, torch dtypes/sizes/layouts, paths."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module in ("torch._utils", "torch.serialization") and name == "_get_layout")
            or (module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath"))
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} has no place in a DCP checkpoint's metadata")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader, reading `.metadata` through the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, AttributeError, EOFError) as e:
                raise CheckpointFormatError(f"{self.path}: unreadable DCP metadata ({e})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointFormatError(f"{self.path}: .metadata holds a {type(metadata).__name__}, not DCP metadata")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None  # set just above where it was not
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """Refuses DCP's pickled (bytes) entries: every value rayft loads is a tensor."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointFormatError(f"{read_item.dest_index.fqn}: a pickled entry; rayft loads tensors only")


def read_metadata(checkpoint_id: str | Path) -> Metadata:
    return SafeReader(str(checkpoint_id)).read_metadata()


def stored_tensor_size(metadata: Metadata, key: str) -> torch.Size | None:
    """The size of a plain tensor entry, None if the checkpoint has no such tensor."""
    entry = metadata.state_dict_metadata.get(key)
    return entry.size if isinstance(entry, TensorStorageMetadata) else None


def load_tensors(tensors: dict[str, Any], checkpoint_id: str | Path) -> None:
    """dcp.load of a tensors-only state dict, in place, with the safe reader and planner."""
    # dcp.load is public: torch re-exports it without an __all__, which strict mypy does not count as an export
    dcp.load(tensors, storage_reader=SafeReader(str(checkpoint_id)), planner=_TensorsOnlyPlanner())  # type: ignore[attr-defined]
