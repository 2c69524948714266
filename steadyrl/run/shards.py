"""Reading a sharded (format-3) checkpoint's `shards/` folder safely: its `.metadata` pickle is
read only through an allow-list unpickler (`shard_metadata`: DCP's metadata classes,
torch.Size, dtypes, layouts, a PosixPath; anything else is refused unresolved), and the
whole tables are reassembled on one process (`read_shards`)."""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from steadyrl.run.tensors import CheckpointError

# torch.distributed.checkpoint (DCP) takes seconds to import: the format-3 (sharded) functions
# import it themselves (`# lazy: heavy (torch DCP)`).
if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata


#: (module, name) a format-3 `.metadata` pickle may name: torch.distributed.checkpoint's
#: metadata dataclasses and what their fields hold. Everything else is refused unresolved.
_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),   # torch.layout pickles as _get_layout("torch.strided")
    ("pathlib", "PosixPath"),                 # StorageMeta.checkpoint_id: the folder it was written to
})


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only _METADATA_GLOBALS and torch's dtypes; refuses any other global before it is
    imported or called (and any persistent id: the default `persistent_load` raises)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"names {module}.{name}, which a checkpoint's metadata does not hold "
                              "(refused, not loaded)")


def shard_metadata(folder: Path, data: bytes | None = None) -> Metadata:
    """The torch.distributed.checkpoint `Metadata` of a format-3 shards folder (its `.metadata`,
    or `data`), unpickled through an allow-list (_METADATA_GLOBALS), so nothing in it runs.

    Also checks what `read` relies on: every entry is a tensor of the `model` or `optimizer`
    table, and every piece of data lies in a plain file of `folder` with no transform.
    Raises CheckpointError naming the folder and what is refused (a global outside the list,
    an unexpected entry, a path, a file that is not DCP's metadata)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # lazy: heavy (torch DCP)
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata  # lazy: heavy (torch DCP)

    where = Path(folder) / ".metadata"
    try:
        raw = data if data is not None else where.read_bytes()
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign pickle: UnpicklingError, EOFError, TypeError, ...
        raise CheckpointError(f"{where}: not a distributed checkpoint's metadata: {type(e).__name__}: {e}") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{where}: not a distributed checkpoint's metadata (a {type(md).__name__})")
    for key, entry in md.state_dict_metadata.items():
        if str(key).partition(".")[0] not in ("model", "optimizer") or not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{folder}: unexpected entry {key!r} in the shards' metadata")
    for info in md.storage_data.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) \
                or not re.fullmatch(r"[\w.-]+", info.relative_path) or info.relative_path.startswith(".") \
                or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{folder}: the shards' metadata points at {info!r}: only plain files of "
                                  "the folder, untransformed, are read")
    return md


def _safe_reader(folder: Path) -> FileSystemReader:
    """A torch.distributed.checkpoint FileSystemReader of `folder` whose metadata is read by
    `shard_metadata` (torch's own reader unpickles it unrestricted)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader  # lazy: heavy (torch DCP)
    from torch.distributed.checkpoint.metadata import StorageMeta  # lazy: heavy (torch DCP)

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            md = shard_metadata(folder)
            storage_meta = getattr(md, "storage_meta", None)
            if storage_meta is None:
                storage_meta = md.storage_meta = StorageMeta()
            storage_meta.load_id = self.load_id
            return md

    return Reader(str(folder))


def read_shards(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole `model` and `optimizer` tables of a torch.distributed.checkpoint folder, on this
    process alone (no collective: DCP's no_dist load reassembles every rank's shards). The
    metadata is read through `shard_metadata`'s allow-list, here and inside DCP's load."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load  # lazy: heavy (torch DCP)

    reader = _safe_reader(folder)
    tables: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optimizer": {}}
    for key, md in reader.read_metadata().state_dict_metadata.items():   # shard_metadata checked each
        table, _, name = key.partition(".")
        tensor = cast("TensorStorageMetadata", md)   # shard_metadata refused every other kind of entry
        tables[table][name] = torch.empty(tensor.size, dtype=tensor.properties.dtype)
    with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(tables, storage_reader=reader, no_dist=True)
    return tables["model"], tables["optimizer"]
