"""torch.distributed.checkpoint planners and reader for explicit tensor blocks.

Each tensor leaf is a block of a global tensor at a known offset (a whole tensor is the block at
offset zero). The save planner turns every block that this rank owns into one DCP chunk; the
load planner asks DCP for exactly the overlap of every stored chunk with every block this rank
wants, which is what makes loading under another parallel layout work. Neither needs DTensor or
an initialised process group.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from mcore_ckpt.compat import load_pickle, remap_pickle_module
from mcore_ckpt.errors import CheckpointCorruptError, CheckpointVersionError
from mcore_ckpt.format import DCP_METADATA_FILE

__all__ = ["Block", "BlockSavePlanner", "BlockLoadPlanner", "RemapFileSystemReader"]


@dataclass(slots=True)
class Block:
    """A rank's block of one global tensor.

    Attributes:
        tensor: The block's data (read from on save, copied into on load).
        global_shape: Shape of the full tensor.
        offset: Index of ``tensor``'s first element in the full tensor.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def chunk(self) -> ChunkStorageMetadata:
        """The block as DCP chunk metadata."""
        return ChunkStorageMetadata(
            offsets=torch.Size(self.offset), sizes=torch.Size(self.tensor.shape)
        )


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    return bool(
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


class BlockSavePlanner(DefaultSavePlanner):
    """Writes the given blocks and objects of this rank.

    Objects present on several ranks are written once (DCP deduplicates equal keys), so they
    must be equal on every rank.

    Args:
        blocks: Blocks this rank writes, by dotted path.
        objects: Python objects this rank writes, by dotted path.
    """

    def __init__(self, blocks: dict[str, Block], objects: dict[str, Any]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._blocks = blocks
        self._objects = objects

    def set_up_planner(
        self,
        state_dict: Any,
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Records the coordinator flag; the blocks were given to the constructor.

        Args:
            state_dict: Ignored (DCP's view of the state dict).
            storage_meta: Ignored.
            is_coordinator: Whether this rank builds the global plan.
        """
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        """Lists one write per owned block and per object.

        Returns:
            This rank's save plan.
        """
        items = [
            WriteItem(
                index=MetadataIndex(fqn, block.offset),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=block.chunk,
                    properties=TensorProperties(dtype=block.tensor.dtype),
                    size=torch.Size(block.global_shape),
                ),
            )
            for fqn, block in self._blocks.items()
        ]
        items += [
            WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in self._objects
        ]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """Returns the tensor or the serialised object of one write.

        Args:
            write_item: An item of this rank's final plan.

        Returns:
            The block's tensor (a compact copy if it is a view into a larger storage) or the
            object serialised with ``torch.save``.
        """
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(self._objects[fqn], buffer)
            buffer.seek(0)
            return buffer
        tensor = self._blocks[fqn].tensor.detach()
        # torch.save writes a view's whole storage; copy views so only the block is stored.
        return (
            tensor
            if _owns_its_storage(tensor)
            else tensor.clone(memory_format=torch.contiguous_format)
        )


class BlockLoadPlanner(DefaultLoadPlanner):
    """Reads into the given blocks (resharding from the stored chunks) and loads objects.

    Args:
        blocks: Blocks to fill in place, by dotted path.
        objects: Dotted paths of the objects to load; results land in :attr:`loaded_objects`.
    """

    def __init__(self, blocks: dict[str, Block], objects: list[str]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._blocks = blocks
        self._object_fqns = list(objects)
        self.loaded_objects: dict[str, Any] = {}

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        """Keeps the storage metadata; the blocks were given to the constructor.

        Args:
            state_dict: Ignored (DCP's view of the state dict).
            metadata: The checkpoint's storage metadata.
            is_coordinator: Whether this rank builds the global plan.
        """
        self.state_dict = {}
        self.original_state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        """Lists the reads that fill every block from the overlapping stored chunks.

        Returns:
            This rank's load plan.
        """
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        for fqn, block in self._blocks.items():
            tensor_md = stored.get(fqn)
            if not isinstance(tensor_md, TensorStorageMetadata):
                raise CheckpointCorruptError(
                    f"the storage metadata of the checkpoint does not describe tensor {fqn!r}"
                )
            items += create_read_items_for_chunk_list(fqn, tensor_md, [block.chunk])
        for fqn in self._object_fqns:
            items.append(
                ReadItem(
                    type=LoadItemType.BYTE_IO,
                    dest_index=MetadataIndex(fqn),
                    dest_offsets=torch.Size((0,)),
                    storage_index=MetadataIndex(fqn),
                    storage_offsets=torch.Size((0,)),
                    lengths=torch.Size((0,)),
                )
            )
        return LoadPlan(items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickles one object, applying registered class renames.

        Args:
            read_item: The read being served.
            value: The serialised object.
        """
        self.loaded_objects[read_item.dest_index.fqn] = torch.load(
            value, map_location="cpu", weights_only=False, pickle_module=remap_pickle_module
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """Returns the part of a block that one read fills.

        Args:
            read_item: The read being served.

        Returns:
            A view into the block that DCP copies the stored data into.
        """
        view = self._blocks[read_item.dest_index.fqn].tensor.detach()
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Nothing to do: :meth:`resolve_tensor` returned a view, already filled.

        Args:
            read_item: The read served.
            tensor: The filled view.
        """


class RemapFileSystemReader(FileSystemReader):
    """A DCP file-system reader that unpickles the storage metadata through the rename table.

    The metadata is read once and cached, so reading it before handing the reader to DCP
    surfaces its errors with their own types (DCP folds them into an assertion message).

    Args:
        path: The checkpoint directory.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._directory = Path(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Reads ``.metadata`` with :class:`~mcore_ckpt.compat.RemapUnpickler`.

        Args:
            *args: Unused; accepted for DCP's signature.
            **kwargs: Unused; accepted for DCP's signature.

        Returns:
            The checkpoint's storage metadata.

        Raises:
            CheckpointCorruptError: If the file is missing, truncated or not DCP metadata.
            CheckpointVersionError: If it names a class that no longer exists.
        """
        if self._metadata is not None:
            return self._metadata
        target = self._directory / DCP_METADATA_FILE
        try:
            with open(target, "rb") as stream:
                metadata = load_pickle(stream)
        except CheckpointVersionError:
            raise
        except Exception as error:
            raise CheckpointCorruptError(f"{target} is unreadable: {error!r}") from error
        if not isinstance(metadata, Metadata):
            raise CheckpointCorruptError(
                f"{target} holds a {type(metadata).__name__}, expected DCP Metadata"
            )
        # DCP's own reader fills these; planners of newer torch versions expect them.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        if metadata.storage_meta is not None and hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        self._metadata = metadata
        return metadata
