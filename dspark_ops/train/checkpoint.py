"""A training run's checkpoints: ``OUT/step_N/`` holds the draft (``config.json`` +
``model.safetensors``), ``training_state.pt`` (optimiser, scheduler, random states, next step,
the data schedule's fingerprint), ``train_args.json`` and, at the end, ``calibration.json``;
``OUT/step_latest`` links to the newest."""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Optional

import torch

from ..models import load_draft

__all__ = ["CALIBRATION_FILE", "STATE_FILE", "load_checkpoint", "resume_path", "rng_state",
           "save_checkpoint", "set_rng_state"]

STATE_FILE = "training_state.pt"
CALIBRATION_FILE = "calibration.json"


def rng_state() -> dict:
    """Every random state a run draws from: torch (CPU and CUDA), Python's, NumPy's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    """Restores what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def save_checkpoint(out: str, draft, state: dict, args: dict,
                    calibration: Optional[dict] = None) -> str:
    """Writes ``out/step_N`` (``N``: ``state["next_step"]``) whole, then points ``step_latest``
    at it; returns its path. Written under a temporary name first, so that a run killed while
    saving leaves the previous checkpoint as the latest."""
    name = f"step_{state['next_step']}"
    path = os.path.join(out, name)
    tmp = os.path.join(out, f".{name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    draft.save_pretrained(tmp)
    torch.save(state, os.path.join(tmp, STATE_FILE))
    with open(os.path.join(tmp, "train_args.json"), "w") as f:
        json.dump(args, f, indent=2)
    if calibration is not None:
        with open(os.path.join(tmp, CALIBRATION_FILE), "w") as f:
            json.dump(calibration, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    _link_latest(out, name)
    return path


def _link_latest(out: str, name: str) -> None:
    # A new link renamed over the old one: a reader never finds step_latest missing.
    link = os.path.join(out, "step_latest")
    tmp = os.path.join(out, f".step_latest.{os.getpid()}")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, link)


def resume_path(resume: str, out: str) -> str:
    """The checkpoint directory ``--resume`` names: ``OUT/step_latest`` for ``"latest"``."""
    path = os.path.join(out, "step_latest") if resume == "latest" else resume
    if resume == "latest" and not os.path.lexists(path):
        raise SystemExit(f"--resume: no {path} (no checkpoint in --out yet)")
    return os.path.realpath(path)


def load_checkpoint(path: str) -> dict:
    """The training state of a checkpoint directory, after checking it is whole.

    Raises
    ------
    SystemExit
        Naming what is missing or unreadable.
    """
    if not os.path.isdir(path):
        raise SystemExit(f"--resume: {path} is not a checkpoint directory")
    for name in ("config.json", "model.safetensors", STATE_FILE):
        if not os.path.isfile(os.path.join(path, name)):
            raise SystemExit(f"--resume: corrupt checkpoint {path}: {name} is missing")
    try:
        state = torch.load(os.path.join(path, STATE_FILE), map_location="cpu",
                           weights_only=False)
    except Exception as error:  # a truncated or foreign file: say which
        raise SystemExit(f"--resume: corrupt checkpoint {path}: {STATE_FILE} does not load "
                         f"({type(error).__name__}: {error})") from None
    keys = {"next_step", "optimizer", "scheduler", "rng", "schedule"}
    if not isinstance(state, dict) or not keys <= set(state):
        raise SystemExit(f"--resume: corrupt checkpoint {path}: {STATE_FILE} lacks "
                         f"{sorted(keys - set(state) if isinstance(state, dict) else keys)}")
    try:
        state["draft"] = load_draft(path)
    except Exception as error:
        raise SystemExit(f"--resume: corrupt checkpoint {path}: the draft does not load "
                         f"({type(error).__name__}: {error})") from None
    return state
