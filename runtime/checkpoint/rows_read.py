"""Reading rows of a DCP checkpoint's entries: DCP is asked for those rows alone, and only their bytes
are read.

Reading a rank's rows (``dcp_format.read_rows``, ``dcp_format.load_optimizer_state``) asks DCP for those rows only: a
``DefaultLoadPlanner`` (``RowsPlanner``) whose local plan describes each wanted entry as one chunk of
the full tensor (offset ``lo`` along the shard dimension, ``hi - lo`` rows), turned into read items
by DCP's own resharding helper (``create_read_items_for_chunk_list``): the read items name only the
stored chunks that overlap those rows, and each copies only the overlap into a tensor of the rows'
shape. DCP's file-system reader would still load every chunk it touches whole before narrowing it
(a whole tensor per rank for a checkpoint written by one process), so ``RowsReader`` reads only
the overlap's bytes from the chunk's uncompressed data instead.
"""
from __future__ import annotations

import io
import itertools
import math
import struct
import sys
import zipfile
from typing import Any, Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future


Rows = tuple  # (dim, lo, hi): rows [lo, hi) of a tensor along dim


class RowsPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that the entries of ``rows`` (key -> ``(dim, lo, hi)``) are
    read as rows ``[lo, hi)`` along ``dim`` only, into state-dict tensors of that shape (module
    docstring); every other entry is read whole, as ``dcp.load`` does."""

    def __init__(self, rows: Mapping[str, Rows]) -> None:
        super().__init__()
        self.rows = dict(rows)

    def create_local_plan(self) -> LoadPlan:
        entries = self.metadata.state_dict_metadata
        whole = {k: v for k, v in self.state_dict.items() if k not in self.rows}
        items = list(create_default_local_load_plan(whole, self.metadata, True).items)
        for key, (dim, lo, hi) in self.rows.items():
            md = entries.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise RuntimeError(f"Missing key in checkpoint state_dict: {key}.")
            offsets, sizes = [0] * len(md.size), list(md.size)
            offsets[dim], sizes[dim] = lo, hi - lo
            if tuple(self.state_dict[key].shape) != tuple(sizes):
                raise ValueError(f"rows of {key}: the target has shape {list(self.state_dict[key].shape)}, "
                                 f"the rows {sizes}")
            if hi > lo:
                items += create_read_items_for_chunk_list(
                    key, md, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        # the read items of a rows entry address it by the rows' offset; its target is the plain tensor
        if index.fqn in self.rows:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of a file as a seekable file of their own (for ``zipfile``)."""

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        super().__init__()
        self.stream, self.offset, self.length, self.pos = stream, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.length - self.pos)
        if n <= 0:
            return 0
        self.stream.seek(self.offset + self.pos)
        got = self.stream.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


_LOCAL_HEADER = struct.Struct("<4s22xHH")   # a zip entry's local header: signature ... name and extra lengths


class RowsReader(dcp.FileSystemReader):
    """DCP's file-system reader, except that a read item asking for part of a stored chunk reads only
    the bytes of that part (one run of bytes for rows cut along the first dimension, one run per row
    for a cut along a later one) instead of loading the whole chunk and narrowing it.

    A chunk is a ``torch.save`` archive whose tensor data is one uncompressed zip entry in row-major
    order; its offset is found from the archive's directory (``zipfile``), the dtype and shape from
    the checkpoint's metadata. Any item that does not fit that form (bytes entries, a chunk written
    through a storage transform or compressed, a storage other than the tensor's own elements, a
    big-endian archive) goes to ``FileSystemReader.read_data`` unchanged. ``reads`` lists what was
    read: (entry, bytes) per region, or per chunk read whole (its stored bytes)."""

    def __init__(self, path: Any) -> None:
        super().__init__(path)
        self.reads: list[tuple[str, int]] = []       # (entry, bytes) per read: a region, or a chunk whole
        self.known_metadata: Any = None              # the .metadata read already (``read_metadata``)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self.known_metadata is None:
            return super().read_metadata(*args, **kwargs)
        self.known_metadata.storage_meta = self.known_metadata.storage_meta or StorageMeta()
        self.known_metadata.storage_meta.load_id = self.load_id
        return self.known_metadata

    def read_data(self, plan: LoadPlan, planner: Any):
        others = []
        per_file: dict[str, list] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                others.append(item)
            else:
                per_file.setdefault(info.relative_path, []).append(item)
        for relative_path, items in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for item in items:
                    region = self._region(stream, item, planner.metadata)
                    if region is None:
                        others.append(item)
                        continue
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(region)
                    planner.commit_tensor(item, target)
        if others:
            self.reads += [(i.storage_index.fqn, self.storage_data[i.storage_index].length) for i in others]
            return super().read_data(LoadPlan(others), planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _region(self, stream: Any, item: Any, metadata: Any) -> Optional[torch.Tensor]:
        """The elements ``item`` asks of its stored chunk, read from the chunk's data entry alone
        (None: the chunk is not in the plain form; the caller reads it the default way)."""
        md = metadata.state_dict_metadata.get(item.storage_index.fqn)
        if not isinstance(md, TensorStorageMetadata) or not md.size:
            return None
        chunk = next((c for c in md.chunks if list(c.offsets) == list(item.storage_index.offset)), None)
        if chunk is None:
            return None
        info = self.storage_data[item.storage_index]
        view = _Slice(stream, info.offset, info.length)
        try:
            archive = zipfile.ZipFile(view)
            names = archive.namelist()
            data = [n for n in names if n.endswith("/data/0")]
            order = [n for n in names if n.endswith("/byteorder")]
            if len(data) != 1 or len([n for n in names if "/data/" in n and not n.endswith(".pkl")]) != 1:
                return None
            entry = archive.getinfo(data[0])
            if (order and archive.read(order[0]) != b"little") or sys.byteorder != "little":
                return None
        except (zipfile.BadZipFile, OSError, KeyError):
            return None
        dtype = md.properties.dtype
        sizes = list(chunk.sizes)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != math.prod(sizes) * itemsize:
            return None
        view.seek(entry.header_offset)
        signature, name_len, extra_len = _LOCAL_HEADER.unpack(view.read(_LOCAL_HEADER.size))
        if signature != b"PK\x03\x04":
            return None
        start = entry.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        # the region is a run of contiguous elements per index of its dimensions before ``cut``, the
        # last dimension it does not span whole (rows cut along dim 0: one run)
        cut = max([d for d in range(len(sizes)) if lengths[d] != sizes[d]], default=0)
        run = lengths[cut] * strides[cut] * itemsize
        raw = bytearray(math.prod(lengths) * itemsize)
        at = 0
        for outer in itertools.product(*(range(n) for n in lengths[:cut])):
            first = sum((o + i) * s for o, i, s in zip(offsets, outer, strides)) + offsets[cut] * strides[cut]
            view.seek(start + first * itemsize)
            if view.readinto(memoryview(raw)[at:at + run]) != run:
                return None
            at += run
        self.reads.append((item.storage_index.fqn, len(raw)))
        return torch.frombuffer(raw, dtype=dtype).reshape(lengths) if raw else torch.empty(lengths, dtype=dtype)
