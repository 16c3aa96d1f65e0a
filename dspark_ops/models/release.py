"""A released draft: one small ``.safetensors`` file that rebuilds a trained draft together with
its target.

A draft checkpoint holds copies of the target's token embedding and LM head (DSpark and DFlash
train with them frozen; Eagle3 with its embedding frozen). For SmolLM2-135M those copies are
56.6 M of a DSpark draft's 71.7 M parameters. A release leaves them out and takes them from the
target when it loads, and stores the rest in bfloat16:

- every other tensor of the draft's state dict, floating point ones in bfloat16;
- with a draft vocabulary, only the ``N`` rows of the Markov head's ``W2`` that it drafts from
  (the others are never read: :class:`~dspark_ops.models.vocab.VocabularyHeads`), and the
  vocabulary's ``d2t`` as ``draft_vocab.d2t``;
- for each tensor left out, ``target_check.<name>``: its values at 512 fixed positions, so a
  release loaded with another target is refused instead of drafting nonsense;
- in the file's metadata: the format and version, the draft's ``config.json`` values, the names
  left out and the confidence head's calibration temperatures, when there are any.

:func:`save_release` writes one; :func:`read_release` returns what
:func:`~dspark_ops.models.registry.load_draft` builds the draft from (``load_draft(file,
target=model)``). ``python -m dspark_ops.release`` is the command.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional

import torch

from .checkpoint import _read_safetensors, read_safetensors_metadata, save_safetensors
from .vocab import DraftVocabulary

__all__ = ["RELEASE_FORMAT", "Release", "read_release", "release_metadata", "save_release",
           "target_tensors"]

RELEASE_FORMAT = "dspark_ops.draft_release"
RELEASE_VERSION = "1"
#: The draft tensors a release may take from the target, and which of the target's they are.
COPIED = {"embed_tokens.weight": "input", "lm_head.weight": "output"}
_CHECK_POINTS = 512
#: The Markov head's W2, stored with the draft vocabulary's rows only.
W2 = "markov_head.markov_w2.weight"
_D2T = "draft_vocab.d2t"


def target_tensors(target) -> Dict[str, torch.Tensor]:
    """The target's token embedding (``"input"``) and LM head (``"output"``) weights: a
    transformers model's ``get_input_embeddings()`` / ``get_output_embeddings()``, or a module's
    ``embed_tokens`` / ``lm_head`` (:class:`~dspark_ops.models.TinyTarget`)."""
    if hasattr(target, "get_input_embeddings"):
        embedding, head = target.get_input_embeddings(), target.get_output_embeddings()
    else:
        embedding, head = getattr(target, "embed_tokens", None), getattr(target, "lm_head", None)
    if embedding is None or head is None:
        raise TypeError(f"'target': {type(target).__name__} has no token embedding and LM head "
                        "to read")
    return {"input": embedding.weight.detach(), "output": head.weight.detach()}


def _check_positions(numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, numel, (_CHECK_POINTS,), generator=generator)


def _same(draft_tensor: torch.Tensor, target_tensor: torch.Tensor) -> bool:
    """Whether a draft tensor is the target's copy (to bfloat16 rounding: the target may be
    loaded in another precision than the draft was trained with)."""
    if draft_tensor.shape != target_tensor.shape:
        return False
    a, b = draft_tensor.detach().float().cpu(), target_tensor.detach().float().cpu()
    return torch.allclose(a, b, rtol=1 / 128, atol=1e-3 * float(b.abs().max()) + 1e-12)


@dataclasses.dataclass
class Release:
    """What a release file rebuilds a draft from.

    Attributes
    ----------
    config : dict
        The draft's ``config.json`` values.
    state : dict
        The draft's whole state dict (the target's copies put back, ``W2`` scattered back to
        ``[V, r]`` with zero rows outside the vocabulary), in the release's dtypes.
    vocabulary : DraftVocabulary or None
    calibration : list of float or None
        The confidence head's temperatures (``calib_temperature``).
    """

    config: dict
    state: Dict[str, torch.Tensor]
    vocabulary: Optional[DraftVocabulary]
    calibration: Optional[List[float]]


def save_release(draft, target, path: str, *, calibration: Optional[List[float]] = None,
                 dtype: torch.dtype = torch.bfloat16) -> dict:
    """Writes ``draft`` as a release file at ``path`` (module docstring); returns a summary:
    ``bytes``, ``parameters`` (stored), ``left_out`` (names taken from the target) and
    ``w2_rows`` (stored rows of ``W2``).

    ``target`` is the target the draft was trained for (:func:`target_tensors`): a draft tensor
    named in :data:`COPIED` is left out only where it equals the target's; one that was trained
    (Eagle3's LM head) stays in the file."""
    if not dtype.is_floating_point:
        raise ValueError(f"save_release: 'dtype' must be a floating-point dtype, got {dtype}")
    state = draft.state_dict()
    sources = target_tensors(target)
    tensors, left_out = {}, {}
    for name, which in COPIED.items():
        if name in state and _same(state[name], sources[which]):
            source = sources[which].float().cpu().reshape(-1)
            tensors["target_check." + name] = source[_check_positions(source.numel())]
            left_out[name] = list(state[name].shape)
    vocabulary = getattr(draft, "draft_vocabulary", None)
    w2_rows = None
    for name, tensor in state.items():
        if name in left_out:
            continue
        tensor = tensor.detach().cpu()
        if name == W2 and vocabulary is not None and tensor.shape[0] == vocabulary.vocab_size:
            tensor = tensor[vocabulary.d2t]
            w2_rows = tensor.shape[0]
        tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    if vocabulary is not None:
        tensors[_D2T] = vocabulary.d2t
    config = draft.config.to_dict()
    config["dtype"] = str(dtype).replace("torch.", "")
    metadata = {"format": RELEASE_FORMAT, "version": RELEASE_VERSION,
                "config": json.dumps(config, sort_keys=True), "left_out": json.dumps(left_out)}
    if calibration is not None:
        metadata["calibration"] = json.dumps([float(t) for t in calibration])
    save_safetensors(tensors, path, metadata=metadata)
    stored = sum(t.numel() for n, t in tensors.items() if not n.startswith("target_check."))
    return {"bytes": os.path.getsize(path), "parameters": stored, "left_out": left_out,
            "w2_rows": w2_rows}


def release_metadata(path: str) -> dict:
    """A release file's metadata (``config``, ``left_out`` and ``calibration`` decoded from
    JSON); raises ``ValueError`` for a file that is not a release."""
    metadata = read_safetensors_metadata(path)
    if metadata.get("format") != RELEASE_FORMAT:
        raise ValueError(f"{path}: not a draft release (a checkpoint directory, or a file "
                         f"written by python -m dspark_ops.release, is expected)")
    if metadata.get("version") != RELEASE_VERSION:
        raise ValueError(f"{path}: release format version {metadata.get('version')!r}; this "
                         f"library reads version {RELEASE_VERSION}")
    out = dict(metadata)
    for key in ("config", "left_out", "calibration"):
        if key in out:
            out[key] = json.loads(out[key])
    return out


def read_release(path: str, target) -> Release:
    """The draft a release file rebuilds with ``target``'s embedding and LM head (refused, by
    name, when they are not the ones the draft was released with)."""
    metadata = release_metadata(path)
    stored = _read_safetensors(path)
    sources = target_tensors(target)
    state = {n: t for n, t in stored.items() if not n.startswith("target_check.") and n != _D2T}
    for name, shape in metadata["left_out"].items():
        source = sources[COPIED[name]]
        if list(source.shape) != shape:
            raise ValueError(f"{path}: 'target' is not the model this draft was released for "
                             f"(its {name} is {list(source.shape)}, the draft's {shape})")
        flat = source.detach().float().cpu().reshape(-1)
        check = stored["target_check." + name]
        if not torch.allclose(flat[_check_positions(flat.numel())], check, rtol=1 / 64,
                              atol=1e-3 * float(check.abs().max()) + 1e-12):
            raise ValueError(f"{path}: 'target' is not the model this draft was released for "
                             f"(its {name} differs from the one the draft copied)")
        state[name] = source.detach().cpu()
    vocabulary = None
    if _D2T in stored:
        vocabulary = DraftVocabulary(stored[_D2T], int(metadata["config"]["vocab_size"]))
        rows = state.get(W2)
        if rows is not None and rows.shape[0] == vocabulary.size:
            full = rows.new_zeros(vocabulary.vocab_size, rows.shape[1])
            full[vocabulary.d2t] = rows
            state[W2] = full
    return Release(metadata["config"], state, vocabulary, metadata.get("calibration"))
