"""DeepSpec's offline target cache (format version 2): the target's features written once, read
by every epoch and every run instead of running the target.

A cache is a directory:

- ``manifest.json``: ``version`` 2, ``num_samples``, ``num_shards``, ``target_layer_ids``,
  ``hidden_size``, the dtypes, ``index_record_size`` (56), the shards, the target's name and
  the data file it was made from;
- ``samples.idx``: one 56-byte little-endian record per sample, ``<QIIQQQQQ>``: the sample id
  (its row in the data file), the shard, the sequence length ``S``, then the byte offsets of its
  five tensors in that shard;
- ``shard-NNNNN.bin``: the tensors of each sample, one after the other: ``input_ids`` int32
  ``[S]``, ``attention_mask`` uint8 ``[S]``, ``loss_mask`` uint8 ``[S]``, ``target_hidden_states``
  ``[S, n * H]`` (the hooked layers' outputs, concatenated) and ``target_last_hidden_states``
  ``[S, H]`` (after the final norm), both bfloat16 by default.

Features can be computed ahead of the cache (``python -m dspark_ops.prepare_data --cache`` captures
them while the target generates the answers): :class:`FeatureStage` keeps them, one file per
sample, until :func:`write_cache` assembles the cache from them (``staged``).

A cache costs ``6 + 2 (n + 1) H`` bytes per token in bfloat16 (n = 5, H = 576: 6,918 bytes; a
Qwen3-4B target: 30,726), which is why training reads features online by default.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["CACHE_VERSION", "FeatureStage", "TargetCache", "write_cache"]

CACHE_VERSION = 2
RECORD = struct.Struct("<QIIQQQQQ")
MAX_SHARD_BYTES = 64 << 30
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shard(index: int) -> str:
    return f"shard-{index:05d}.bin"


def write_cache(path: str, samples, features_of, *, target_layer_ids: Sequence[int],
                hidden_size: int, target_name: str, data_path: str,
                dtype: torch.dtype = torch.bfloat16, batch_tokens: int = 4096,
                max_shard_bytes: int = MAX_SHARD_BYTES, progress=None, staged=None) -> int:
    """Writes the cache of ``samples`` into ``path`` (replacing it; written into a temporary
    directory first, so an interrupted write leaves no cache behind).

    Parameters
    ----------
    samples : sequence of :class:`~.data.Sample`
    features_of : callable or None
        ``features_of(input_ids [B, L] int64, valid [B, L] bool) -> (features [B, L, n * H],
        last_hidden [B, L, H])``, e.g. an :class:`~.target.OnlineTarget`: the features of the
        samples ``staged`` has none for (None when it has them all).
    dtype : torch.dtype
        Of the two hidden-state tensors (DeepSpec: bfloat16).
    staged : callable, optional
        ``staged(sample) -> (features [S, n * H], last_hidden [S, H])`` of a sample whose
        features were computed before (e.g. captured while its answer was generated, see
        :class:`FeatureStage`), or None; those samples skip ``features_of``.

    Returns
    -------
    int
        How many samples went through ``features_of``.
    """
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    width = len(target_layer_ids) * hidden_size
    records: List[bytes] = []
    shards: List[dict] = []
    shard_id, shard_bytes, handle = 0, 0, open(os.path.join(tmp, _shard(0)), "wb")
    order = sorted(samples, key=lambda s: len(s.input_ids))  # similar lengths batch together

    def put(s, feats: torch.Tensor, last: torch.Tensor) -> None:
        nonlocal shard_id, shard_bytes, handle
        n = len(s.input_ids)
        if feats.shape != (n, width) or last.shape != (n, hidden_size):
            raise ValueError(f"sample {s.index}: features {tuple(feats.shape)} / "
                             f"{tuple(last.shape)}; the manifest says ({n}, {width}) / "
                             f"({n}, {hidden_size})")
        parts = [torch.tensor(s.input_ids, dtype=torch.int32),
                 torch.ones(n, dtype=torch.uint8),
                 torch.tensor(s.loss_mask, dtype=torch.uint8),
                 feats.to("cpu", dtype).contiguous(), last.to("cpu", dtype).contiguous()]
        size = sum(p.numel() * p.element_size() for p in parts)
        if shard_bytes and shard_bytes + size > max_shard_bytes:
            handle.close()
            shards.append({"file": _shard(shard_id), "bytes": shard_bytes})
            shard_id, shard_bytes = shard_id + 1, 0
            handle = open(os.path.join(tmp, _shard(shard_id)), "wb")
        offsets = []
        for p in parts:
            offsets.append(shard_bytes)
            data = p.view(torch.uint8) if p.dtype != torch.uint8 else p
            handle.write(data.numpy().tobytes())
            shard_bytes += p.numel() * p.element_size()
        records.append((s.index, RECORD.pack(s.index, shard_id, n, *offsets)))

    computed = 0
    try:
        if staged is not None:
            pending = []
            for s in order:
                found = staged(s)
                if found is None:
                    pending.append(s)
                    continue
                put(s, *found)
                if progress is not None:
                    progress(1)
            order = pending
        if order and features_of is None:
            raise ValueError(f"{len(order)} samples have no staged features and features_of "
                             "is None")
        start = 0
        while start < len(order):
            stop = start + 1
            while (stop < len(order)
                   and (stop - start + 1) * len(order[stop].input_ids) <= batch_tokens):
                stop += 1
            chunk = order[start:stop]
            longest = max(len(s.input_ids) for s in chunk)
            ids = torch.zeros(len(chunk), longest, dtype=torch.long)
            valid = torch.zeros(len(chunk), longest, dtype=torch.bool)
            for row, s in enumerate(chunk):
                ids[row, :len(s.input_ids)] = torch.tensor(s.input_ids)
                valid[row, :len(s.input_ids)] = True
            with torch.no_grad():
                feats, last = features_of(ids, valid)
            if feats.shape[-1] != width or last.shape[-1] != hidden_size:
                raise ValueError(f"features of width {feats.shape[-1]} / {last.shape[-1]}; the "
                                 f"manifest says {width} / {hidden_size}")
            feats, last = feats.to("cpu", dtype), last.to("cpu", dtype)
            for row, s in enumerate(chunk):
                n = len(s.input_ids)
                put(s, feats[row, :n], last[row, :n])
            computed += len(chunk)
            if progress is not None:
                progress(len(chunk))
            start = stop
    finally:
        handle.close()
    shards.append({"file": _shard(shard_id), "bytes": shard_bytes})
    with open(os.path.join(tmp, "samples.idx"), "wb") as f:
        for _, record in sorted(records):
            f.write(record)
    manifest = {"version": CACHE_VERSION, "num_samples": len(records),
                "num_shards": len(shards), "target_layer_ids": [int(i) for i in target_layer_ids],
                "hidden_size": int(hidden_size),
                "dtypes": {"input_ids": "int32", "attention_mask": "uint8", "loss_mask": "uint8",
                           "target_hidden_states": _name(dtype),
                           "target_last_hidden_states": _name(dtype)},
                "index_record_size": RECORD.size, "shards": shards,
                "target_model": target_name, "source": os.path.abspath(data_path)}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return computed


class FeatureStage:
    """Features of samples computed before their cache is written: a directory of one file per
    sample, named by the sample's row in the data file, each written atomically.

    ``stage.json`` records what the features are (target layers, hidden size, dtype, target); a
    stage made for anything else is emptied when opened. Rows are matched to samples by their
    tokens when the cache is assembled (:meth:`get`), so a stale file costs a recomputation,
    never a wrong feature.

    Parameters
    ----------
    path : str
        The directory (created if needed).
    target_layer_ids : sequence of int
    hidden_size : int
    dtype : torch.dtype
        The features are stored in it (the cache's dtype).
    target_name : str
    """

    def __init__(self, path: str, *, target_layer_ids: Sequence[int], hidden_size: int,
                 dtype: torch.dtype, target_name: str):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        self.path, self.dtype = path, dtype
        self.width = len(target_layer_ids) * int(hidden_size)
        self.hidden_size = int(hidden_size)
        description = {"target_layer_ids": [int(i) for i in target_layer_ids],
                       "hidden_size": int(hidden_size), "dtype": _name(dtype),
                       "target_model": target_name}
        manifest = os.path.join(path, "stage.json")
        try:
            with open(manifest) as f:
                same = json.load(f) == description
        except (OSError, ValueError):
            same = False
        if not same:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
            with open(manifest + ".tmp", "w") as f:
                json.dump(description, f, indent=1)
            os.replace(manifest + ".tmp", manifest)

    def _file(self, row: int) -> str:
        return os.path.join(self.path, f"row-{row:09d}.pt")

    def rows(self) -> List[int]:
        """The rows that have staged features, ascending."""
        return sorted(int(name[4:-3]) for name in os.listdir(self.path)
                      if name.startswith("row-") and name.endswith(".pt"))

    def put(self, row: int, input_ids: Sequence[int], features: torch.Tensor,
            last_hidden: torch.Tensor) -> None:
        """Stores the features ``[S, n * H]`` and ``[S, H]`` of the ``S`` tokens ``input_ids``
        of the sample in data row ``row``."""
        n = len(input_ids)
        if features.shape != (n, self.width) or last_hidden.shape != (n, self.hidden_size):
            raise ValueError(f"row {row}: features {tuple(features.shape)} / "
                             f"{tuple(last_hidden.shape)} for {n} tokens; the stage holds "
                             f"({n}, {self.width}) / ({n}, {self.hidden_size})")
        file = self._file(row)
        torch.save({"input_ids": torch.tensor(list(input_ids), dtype=torch.int32),
                    "features": features.detach().to("cpu", self.dtype).contiguous(),
                    "last_hidden": last_hidden.detach().to("cpu", self.dtype).contiguous()},
                   file + ".tmp")
        os.replace(file + ".tmp", file)

    def discard_from(self, row: int) -> int:
        """Removes the rows ``>= row`` (staged for data lines an interruption never wrote);
        returns how many."""
        stale = [r for r in self.rows() if r >= row]
        for r in stale:
            os.remove(self._file(r))
        return len(stale)

    def get(self, sample) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(features [S, n * H], last_hidden [S, H])`` of ``sample`` (a
        :class:`~.data.Sample`) when its row is staged with its tokens (or with more tokens that
        begin with them: a sample truncated shorter), else None."""
        file = self._file(sample.index)
        if not os.path.isfile(file):
            return None
        data = torch.load(file, weights_only=True)
        n = len(sample.input_ids)
        if data["input_ids"].shape[0] < n or data["input_ids"][:n].tolist() != list(
                sample.input_ids):
            return None
        return data["features"][:n], data["last_hidden"][:n]

    def remove(self) -> None:
        """Deletes the stage (once its features are in a cache)."""
        shutil.rmtree(self.path, ignore_errors=True)


class TargetCache:
    """A cache directory opened for reading: the features of a sample by its id.

    Raises
    ------
    SystemExit
        A missing or unreadable cache, another format version, or a cache made for other target
        layers or another hidden size (``target_layer_ids``/``hidden_size``, when given).
    """

    def __init__(self, path: str, target_layer_ids: Optional[Sequence[int]] = None,
                 hidden_size: Optional[int] = None):
        manifest_path = os.path.join(path, "manifest.json")
        if not os.path.isfile(manifest_path):
            raise SystemExit(f"--cache {path}: no manifest.json (write one with --write-cache)")
        try:
            with open(manifest_path) as f:
                manifest = json.load(f)
        except ValueError as error:
            raise SystemExit(f"--cache {path}: manifest.json does not parse ({error})") from None
        if manifest.get("version") != CACHE_VERSION:
            raise SystemExit(f"--cache {path}: format version {manifest.get('version')}; this "
                             f"library reads version {CACHE_VERSION}")
        if manifest.get("index_record_size") != RECORD.size:
            raise SystemExit(f"--cache {path}: index records of "
                             f"{manifest.get('index_record_size')} bytes, expected {RECORD.size}")
        if (target_layer_ids is not None
                and list(manifest["target_layer_ids"]) != [int(i) for i in target_layer_ids]):
            raise SystemExit(f"--cache {path}: made for target layers "
                             f"{manifest['target_layer_ids']}; the draft reads "
                             f"{list(target_layer_ids)}")
        if hidden_size is not None and manifest["hidden_size"] != hidden_size:
            raise SystemExit(f"--cache {path}: made for hidden size {manifest['hidden_size']}; "
                             f"the target's is {hidden_size}")
        self.path, self.manifest = path, manifest
        self.hidden_size = int(manifest["hidden_size"])
        self.width = len(manifest["target_layer_ids"]) * self.hidden_size
        dtypes = manifest["dtypes"]
        self.dtype = _DTYPES[dtypes["target_hidden_states"]]
        self.last_dtype = _DTYPES[dtypes["target_last_hidden_states"]]
        with open(os.path.join(path, "samples.idx"), "rb") as f:
            raw = f.read()
        if len(raw) != RECORD.size * manifest["num_samples"]:
            raise SystemExit(f"--cache {path}: samples.idx holds {len(raw) // RECORD.size} "
                             f"records, the manifest {manifest['num_samples']}")
        self.records: Dict[int, tuple] = {}
        for i in range(manifest["num_samples"]):
            sample_id, *rest = RECORD.unpack_from(raw, i * RECORD.size)
            self.records[int(sample_id)] = tuple(rest)
        self._shards: Dict[int, torch.Tensor] = {}

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self.records

    def _bytes(self, shard: int) -> torch.Tensor:
        if shard not in self._shards:  # mapped, not read: pages come in as samples are used
            file = os.path.join(self.path, self.manifest["shards"][shard]["file"])
            size = os.path.getsize(file)
            self._shards[shard] = torch.from_file(file, shared=False, size=size,
                                                  dtype=torch.uint8)
        return self._shards[shard]

    def read(self, sample_id: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor]:
        """``(input_ids int64 [S], loss_mask float32 [S], features [S, n * H],
        last_hidden [S, H])`` of one sample, the hidden states in the cache's dtype."""
        if sample_id not in self.records:
            raise SystemExit(f"--cache {self.path}: no sample {sample_id} (the cache was made "
                             "from other data; write it again with --write-cache)")
        shard, length, o_ids, _, o_loss, o_feat, o_last = self.records[sample_id]
        data = self._bytes(shard)

        def take(offset, count, dtype):
            itemsize = torch.empty((), dtype=dtype).element_size()
            raw = data[offset:offset + count * itemsize]
            # A view of the mapped shard where the offset is aligned (DeepSpec does not align
            # its tensors), else a copy; the batch copies it into its padded rows either way.
            return (raw if offset % itemsize == 0 else raw.clone()).view(dtype)

        ids = take(o_ids, length, torch.int32).long()
        loss = take(o_loss, length, torch.uint8).float()
        feats = take(o_feat, length * self.width, self.dtype).view(length, self.width)
        last = take(o_last, length * self.hidden_size, self.last_dtype).view(length,
                                                                            self.hidden_size)
        return ids, loss, feats, last

    def find(self, sample) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(features [S, n * H], last_hidden [S, H])`` of ``sample`` when the cache holds its
        row with its tokens (or more tokens that begin with them), else None."""
        if sample.index not in self.records:
            return None
        ids, _, feats, last = self.read(sample.index)
        n = len(sample.input_ids)
        if ids.shape[0] < n or ids[:n].tolist() != list(sample.input_ids):
            return None
        return feats[:n], last[:n]

    def batch(self, samples, dtype: torch.dtype, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(features [B, L, n * H], last_hidden [B, L, H])`` of a micro-batch, right-padded
        with zeros as :class:`~.target.OnlineTarget` returns them, in ``dtype`` on ``device``.

        Raises
        ------
        SystemExit
            When a sample's tokens differ from the cached ones (another data file).
        """
        length = max(len(s.input_ids) for s in samples)
        feats = torch.zeros(len(samples), length, self.width, dtype=dtype)
        last = torch.zeros(len(samples), length, self.hidden_size, dtype=dtype)
        for row, s in enumerate(samples):
            ids, _, f, h = self.read(s.index)
            n = len(s.input_ids)
            if ids.shape[0] != n or ids.tolist() != list(s.input_ids):
                raise SystemExit(f"--cache {self.path}: sample {s.index} holds other tokens than "
                                 "--data's row (the cache was made from other data or another "
                                 "--max-length; write it again with --write-cache)")
            feats[row, :n] = f
            last[row, :n] = h
        return feats.to(device), last.to(device)
