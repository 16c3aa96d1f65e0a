"""Checkpoint files: ``.safetensors`` read and written natively (no extra dependency), sharded
checkpoints and ``torch.save`` state dicts."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

__all__ = ["load_state_dict_file", "read_safetensors_metadata", "save_safetensors",
           "weights_file"]

#: The weights files a checkpoint directory may hold, in the order they are looked for.
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "model.pt")


def weights_file(path: str) -> str:
    """The weights file of the checkpoint directory ``path``: the first of
    :data:`WEIGHTS_FILES` it holds."""
    for name in WEIGHTS_FILES:
        weights = os.path.join(path, name)
        if os.path.exists(weights):
            return weights
    raise FileNotFoundError(f"none of {', '.join(WEIGHTS_FILES)} in {path}")


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def _read_safetensors(path: str) -> dict:
    """The tensors of a ``.safetensors`` file (8-byte header size, JSON header, raw data)."""
    with open(path, "rb") as f:
        data = f.read()
    header_size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_size])
    base = 8 + header_size
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        raw = bytearray(data[base + begin : base + end])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    return tensors


def read_safetensors_metadata(path: str) -> dict:
    """The ``__metadata__`` strings of a ``.safetensors`` file's header (the header alone is
    read)."""
    with open(path, "rb") as f:
        size = f.read(8)
        if len(size) < 8:
            raise ValueError(f"{path}: not a .safetensors file (shorter than its header)")
        header_size = int.from_bytes(size, "little")
        if header_size > 100 << 20:
            raise ValueError(f"{path}: not a .safetensors file (a {header_size}-byte header)")
        try:
            header = json.loads(f.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path}: not a .safetensors file ({error})") from error
    return dict(header.get("__metadata__") or {})


def load_state_dict_file(path: str) -> dict:
    """A state dict from ``.safetensors`` (read natively), a sharded checkpoint's
    ``*.safetensors.index.json`` (every shard it names) or a ``torch.save`` file."""
    if path.endswith(".safetensors.index.json"):
        with open(path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(_read_safetensors(os.path.join(os.path.dirname(path), shard)))
        return state
    if path.endswith(".safetensors"):
        return _read_safetensors(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def save_safetensors(tensors: dict, path: str, metadata: Optional[dict] = None) -> None:
    """Writes ``tensors`` (name -> tensor) as one ``.safetensors`` file, readable by the
    ``safetensors`` library and by :func:`load_state_dict_file`; ``metadata`` (string -> string)
    goes into the header's ``__metadata__`` (default ``{"format": "pt"}``)."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise ValueError("save_safetensors: 'metadata' maps strings to strings")
    names = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
    header, blobs, offset = {"__metadata__": dict(metadata or {"format": "pt"})}, [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in names:
            raise ValueError(f"tensor {name!r}: dtype {tensor.dtype} has no safetensors name")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)

