"""The draft families: one entry each, the one place that tells them apart.

A family is a config class and a draft class in one module of :mod:`dspark_ops.models`, named in
a ``config.json`` by its ``architectures`` or ``model_type``, and chosen for training by the
trainer's ``--arch`` and the target's ``model_type``. Its entry also says how it drafts (a
parallel ``"block"`` or a one-token-per-slot ``"chain"``) and which training loss it learns from
(:data:`dspark_ops.train.objectives.TRAINING_LOSSES` holds one per name). Every loader, the
trainer, the proposers and the command line ask this module; adding a family is one entry in
:data:`FAMILIES` plus its module.

The classes are looked up by name on first use (as vLLM's model registry does), so that the base
config and draft classes can ask the registry without importing the families built on them.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Optional, Tuple

import torch

__all__ = ["DraftFamily", "FAMILIES", "GEMMA4_MODEL_TYPES", "family_named", "family_of",
           "family_of_config", "family_to_train", "load_draft", "trainer_archs"]

# model_type values of Gemma4 configs: DeepSpec copies the target's text config, whose type is
# one of these (Gemma4 or its unified variant, top-level or text).
GEMMA4_MODEL_TYPES = ("gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified")


@dataclasses.dataclass(frozen=True)
class DraftFamily:
    """One draft family.

    Attributes
    ----------
    name : str
        ``"qwen3"``, ``"gemma4"`` or ``"eagle3"``.
    module : str
        Its module in :mod:`dspark_ops.models`, holding the two classes below.
    config_class_name, draft_class_name : str
    architectures : tuple of str
        ``config.json`` ``architectures`` values that name this family before its
        ``model_type`` is read (the block families are told apart by ``model_type``: their
        parsers then check the architecture).
    model_types : tuple of str
        ``config.json`` ``model_type`` values read as this family when no architecture names
        one; the target ``model_type`` values it is trained for.
    trainer_archs : tuple of str
        The trainer's ``--arch`` values this family serves.
    drafting : str
        ``"block"``: one parallel pass over the block; ``"chain"``: one step per slot.
    training_loss : str
        ``"dspark"``: the anchor-parallel forward and DSpark's loss; ``"ttt"``: Eagle3's
        training-time test.
    """

    name: str
    module: str
    config_class_name: str
    draft_class_name: str
    architectures: Tuple[str, ...]
    model_types: Tuple[str, ...]
    trainer_archs: Tuple[str, ...]
    drafting: str
    training_loss: str

    def _attribute(self, name: str):
        return getattr(importlib.import_module(f".{self.module}", __package__), name)

    @property
    def config_class(self):
        return self._attribute(self.config_class_name)

    @property
    def draft_class(self):
        return self._attribute(self.draft_class_name)


# In lookup order: a family named by its architectures first, the Qwen3 block draft last (what
# a config or target that names no other family is read as).
FAMILIES = (
    DraftFamily(name="eagle3", module="eagle3", config_class_name="Eagle3Config",
                draft_class_name="Eagle3Draft",
                architectures=("Qwen3Eagle3Model", "Gemma4Eagle3Model"), model_types=(),
                trainer_archs=("eagle3",), drafting="chain", training_loss="ttt"),
    DraftFamily(name="gemma4", module="gemma4", config_class_name="Gemma4DSparkConfig",
                draft_class_name="Gemma4DSparkDraft", architectures=(),
                model_types=GEMMA4_MODEL_TYPES, trainer_archs=("dspark", "dflash"),
                drafting="block", training_loss="dspark"),
    DraftFamily(name="qwen3", module="draft", config_class_name="DSparkConfig",
                draft_class_name="DSparkDraft", architectures=(),
                model_types=("qwen3",), trainer_archs=("dspark", "dflash"), drafting="block",
                training_loss="dspark"),
)


def family_named(name: str) -> DraftFamily:
    """The family called ``name``."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"draft family {name!r}: one of {[f.name for f in FAMILIES]}")


def _choose(candidates, architectures, model_type) -> DraftFamily:
    for family in candidates:
        if any(a in family.architectures for a in architectures):
            return family
    for family in candidates:
        if model_type in family.model_types:
            return family
    return candidates[-1]


def family_of_config(values: dict, drafting: Optional[str] = None) -> DraftFamily:
    """The family of a draft's ``config.json`` values: named by its architecture (Eagle3's),
    else by ``model_type``, else Qwen3's (whose parser then says what it refuses). ``drafting``: among the families that draft that way only."""
    candidates = [f for f in FAMILIES if drafting in (None, f.drafting)]
    return _choose(candidates, values.get("architectures") or (), values.get("model_type"))


def trainer_archs() -> Tuple[str, ...]:
    """The trainer's ``--arch`` values, the Qwen3 family's first."""
    return tuple(dict.fromkeys(a for f in reversed(FAMILIES) for a in f.trainer_archs))


def family_to_train(arch: str, target_model_type: Optional[str]) -> DraftFamily:
    """The family the trainer builds for ``--arch`` on a target of ``target_model_type``."""
    candidates = [f for f in FAMILIES if arch in f.trainer_archs]
    if not candidates:
        raise ValueError(f"--arch {arch!r}: one of {trainer_archs()}")
    return _choose(candidates, (), target_model_type)


def family_of(model_or_config) -> DraftFamily:
    """The family of a draft model or its config (its class or a subclass of it)."""
    kind = type(model_or_config)
    for family in FAMILIES:  # the exact class first: a family may subclass another's
        if kind in (family.config_class, family.draft_class):
            return family
    for family in FAMILIES:
        if issubclass(kind, (family.config_class, family.draft_class)):
            return family
    raise TypeError(f"{kind.__name__} is not a draft or config of any family")


def load_draft(path: str, *, dtype=None, device=None, target=None):
    """Loads any draft this library runs: a checkpoint directory, by its ``config.json``, through
    the family's ``from_pretrained`` (an Eagle3 draft for ``Qwen3Eagle3Model`` /
    ``Gemma4Eagle3Model``, else a Qwen3 or Gemma4 DSpark or DFlash draft); or a release file
    (:mod:`.release`), rebuilt with ``target``'s token embedding and LM head (a transformers
    model or a :class:`~dspark_ops.models.TinyTarget`). ``dtype`` defaults to float32."""
    if os.path.isfile(path):
        from .release import read_release

        if target is None:
            raise ValueError(f"load_draft: {path} is a release file, which takes the target's "
                             "embedding and LM head: pass 'target'")
        release = read_release(path, target)
        family = family_of_config(release.config)
        model = family.draft_class(family.config_class.from_dict(release.config))
        model.load_state_dict(release.state, strict=True)
        if release.vocabulary is not None:
            model.draft_vocabulary = release.vocabulary
        return model.to(device=device, dtype=dtype or torch.float32)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"load_draft: {path} is neither a draft checkpoint directory "
                                "(no config.json) nor a release file")
    with open(os.path.join(path, "config.json")) as f:
        family = family_of_config(json.load(f))
    return family.draft_class.from_pretrained(path, dtype=dtype, device=device)
