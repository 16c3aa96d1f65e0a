"""``python -m dspark_ops.train``: trains a DSpark (or DFlash) draft for a transformers target,
with the target's features computed online, DeepSpec's recipe and checkpoint layout.

The recipe (DeepSpec's defaults, every one a flag):

- the draft config is the target's (a copy with ``num_hidden_layers`` draft layers, untied
  embeddings, the target layer ids and the mask token), as DeepSpec's ``build_draft_config``;
  the embedding and LM head are copied from the target and frozen;
- per sequence, 512 anchors, blocks of 7, Markov rank 256 (vanilla head), a confidence head on
  ``[h; W1[x]]``; DFlash (``--arch dflash``): no Markov or confidence head; Eagle3 (``--arch
  eagle3``): DeepSpec's one-layer Eagle3 draft, trained with its training-time test over
  ``--block-size`` steps, each step's soft cross-entropy against the target's next-token
  distribution weighted by ``--step-loss-decay ** k`` (:mod:`.eagle3`; ``ce`` in the metrics);
- the loss is :func:`dspark_ops.train.draft_loss` (fused): ``0.1 CE + 0.9 L1 + 1.0 BCE`` over
  the slots' weights ``exp(-k/4)``, CE alone for DFlash; the three denominators are summed over
  ranks and the loss multiplied by the world size, then divided by the gradient accumulation
  steps, as DeepSpec;
- AdamW (lr 6e-4, weight decay 0), linear warm-up over 4 % of the steps then cosine to 0 (``--min-lr-ratio``: to a floor),
  gradient clipping at 1.0, bfloat16 autocast on CUDA (float32 master weights);
- the target runs in the process under ``torch.no_grad`` (:class:`~.target.OnlineTarget`), or
  its features come from DeepSpec's offline cache (``--cache DIR``, written once with
  ``--write-cache``; :mod:`~.cache`).

Checkpoints: ``OUT/step_N/`` holds ``config.json`` + ``model.safetensors`` (what
:meth:`dspark_ops.models.DSparkDraft.from_pretrained` and DeepSpec's ``from_pretrained`` load),
``training_state.pt`` (optimiser, scheduler, random states, next step, the data schedule's
fingerprint) and ``train_args.json``; ``OUT/step_latest`` links to the newest. ``--resume``
continues from it exactly. At the end, the confidence head's sequential temperatures are fitted
on held-out samples (:func:`dspark_ops.fit_sequential_temperatures`) and written to the final
checkpoint's ``calibration.json``, which ``generate``/``eval`` read. Per step, ``OUT/metrics.jsonl``
gets the loss, its terms, DeepSpec's ``accept_rate@k`` and ``tau_probabilistic``, the learning
rate, gradient norm and throughput.

Data-parallel: run under ``torchrun --nproc-per-node N -m dspark_ops.train ...``
(DistributedDataParallel; gloo on CPU, NCCL on CUDA); rank 0 writes checkpoints and logs.

Example::

    python -m dspark_ops.prepare_data --target qwen3-4b --prompts prompts.jsonl --out train.jsonl
    python -m dspark_ops.train --target qwen3-4b --data train.jsonl --out runs/dspark \\
        --target-layers 1 9 17 25 33 --epochs 10 --grad-accum 64
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Optional, Sequence

import torch
from torch import nn

from ..models.registry import family_of
from ..models.vocab import DraftVocabulary, count_response_tokens
from . import flags
from .checkpoint import load_checkpoint, resume_path, rng_state, set_rng_state
from .checkpoint import save_checkpoint as write_checkpoint
from .data import Schedule, read_training_data
from .draft_config import (build_draft_config, check_target_layers, default_target_layers,
                           init_draft, text_config)
from .flags import DTYPES, check_args
from .objectives import TRAINING_LOSSES

__all__ = ["build_draft_config", "default_target_layers", "main", "parse_args", "Trainer"]


def parse_args(argv: Optional[Sequence[str]] = None):
    """The trainer's flags (:mod:`.flags`), with this module's text as their ``--help``."""
    return flags.parse_args(argv, description=__doc__)


# ------------------------------------------------------------------------------------------------
# Schedule of the learning rate


def lr_factor(step: int, total_steps: int, warmup_steps: int, floor: float = 0.0) -> float:
    """DeepSpec's schedule: ``(step + 1) / warmup`` for the first ``warmup`` steps, then a cosine
    from 1 to ``floor`` over the rest (``step`` is 0-based; DeepSpec's floor is 0). A floor
    keeps a short budget's last steps learning: cosine to 0 spends its last tenth below 2.5 %
    of the peak."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(step - warmup_steps, span) / span))
    return floor + (1.0 - floor) * cosine


# ------------------------------------------------------------------------------------------------
# Distributed helpers


@dataclasses.dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()


def _init_distributed(device_arg: Optional[str]) -> tuple:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        device = torch.device(device_arg or ("cuda" if torch.cuda.is_available() else "cpu"))
        return _Dist(), device
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device(device_arg or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend=backend)
    return _Dist(rank, world, local), device


class _DraftStep(nn.Module):
    """The draft's training forward and loss as one module, so that DistributedDataParallel sees
    one forward per micro-step; what they are is the family's objective (:mod:`.objectives`)."""

    def __init__(self, draft: nn.Module, objective):
        super().__init__()
        self.draft = draft
        self.objective = objective

    def forward(self, data: dict, features, last_hidden, denominators):
        return self.objective.forward(self.draft, data, features, last_hidden, denominators)


# ------------------------------------------------------------------------------------------------
# The trainer


def _progress(total: int, initial: int, enabled: bool, desc: str = "train", unit: str = "step"):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)


def _peak_memory(device: torch.device) -> float:
    """Peak memory in MiB: the CUDA allocator's high-water mark, or the process's peak resident
    set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:
        return float("nan")


def _import_transformers():
    try:
        import transformers
    except ImportError as error:
        raise SystemExit("training needs transformers: pip install --no-build-isolation "
                         "'.[hf]'") from error
    return transformers


class Trainer:
    """Everything of one training run; :meth:`train` runs it. Built from the parsed flags
    (:func:`parse_args`); checks everything it can before loading the target's weights."""

    def __init__(self, args):
        check_args(args)
        self.args = args
        self._set_up_device()
        transformers = _import_transformers()
        # Everything cheap first: flags, target config, data, checkpoint, cache.
        self.config = self._draft_config(transformers)
        self._split_data()
        write = self._check_cache()
        # Then the target (the long part; not needed when a resumed run reads a cache).
        model = self._load_target(transformers)
        self._fill_cache(write)
        self.draft = self._make_draft(model)
        del model
        self._set_up_vocabulary(transformers)
        self._set_up_loss()
        self._set_up_optimizer()
        self._restore_training_state()

    # -- setting up --------------------------------------------------------------------------

    def _set_up_device(self) -> None:
        args = self.args
        self.dist, self.device = _init_distributed(args.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available")
        self.dtype = DTYPES[args.dtype] if args.dtype else (
            torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.autocast = self.device.type == "cuda" and self.dtype in (torch.bfloat16,
                                                                      torch.float16)

    def _draft_config(self, transformers):
        """The target's config (``self.text``) and the draft's: the resumed checkpoint's, checked
        against the target, or one built for it (:func:`.draft_config.build_draft_config`)."""
        args = self.args
        try:
            target_config = transformers.AutoConfig.from_pretrained(args.target)
        except (OSError, ValueError) as error:
            raise SystemExit(f"--target {args.target}: {error}") from None
        self.text = text = text_config(target_config)
        self.resume_state = None
        if args.resume is None:
            tokenizer = None
            if args.mask_token_id is None and not args.config:
                try:
                    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
                except (OSError, ValueError):
                    tokenizer = None
            return build_draft_config(target_config, args, tokenizer)
        self.resume_path = resume_path(args.resume, args.out)
        self.resume_state = load_checkpoint(self.resume_path)
        config = self.resume_state["draft"].config
        width = config.target_hidden_size or config.hidden_size
        if (width != text.hidden_size or config.vocab_size != text.vocab_size
                or config.target_num_hidden_layers not in (None, text.num_hidden_layers)):
            raise SystemExit(f"--resume: the checkpoint's draft ({config.hidden_size} "
                             f"hidden, vocabulary {config.vocab_size}) does not fit the "
                             f"target {args.target}")
        check_target_layers(config.target_layer_ids, int(self.text.num_hidden_layers))
        return config

    def _split_data(self) -> None:
        """The training samples, the held-out calibration samples and the data schedule (a
        resumed run's must be the checkpoint's)."""
        args, config = self.args, self.config
        min_tokens = (args.min_loss_tokens if args.min_loss_tokens is not None
                      else 2 * config.block_size)
        samples, self.dropped = read_training_data(
            args.data, vocab_size=int(self.text.vocab_size), max_length=args.max_length,
            min_loss_tokens=min_tokens)
        holdout = args.calibration_samples
        if holdout is None:
            holdout = min(256, max(1, len(samples) // 50)) if len(samples) >= 10 else 0
        if not config.enable_confidence_head:
            holdout = 0
        if holdout >= len(samples):
            raise SystemExit(f"--calibration-samples {holdout}: only {len(samples)} samples")
        order = torch.randperm(len(samples),
                               generator=torch.Generator().manual_seed(args.seed)).tolist()
        held = sorted(order[len(samples) - holdout:]) if holdout else []
        held_set = set(held)
        self.calibration_samples = [samples[i] for i in held]
        self.train_samples = [s for i, s in enumerate(samples) if i not in held_set]
        self.schedule = Schedule(self.train_samples, batch_tokens=args.batch_tokens,
                                 world_size=self.dist.world_size, grad_accum=args.grad_accum,
                                 seed=args.seed, epochs=args.epochs, max_steps=args.max_steps)
        self.total_steps = self.schedule.total_steps
        if self.resume_state is not None:
            self._check_resumed_schedule(self.resume_state["schedule"])

    def _check_resumed_schedule(self, saved: dict) -> None:
        now = self.schedule.fingerprint()
        if saved != now:
            diff = {k: (saved.get(k), now.get(k)) for k in set(saved) | set(now)
                    if saved.get(k) != now.get(k)}
            raise SystemExit(f"--resume: the checkpoint was made with another data schedule "
                             f"(checkpoint, now): {diff}; resume with the same --data, "
                             "--seed, --batch-tokens, --grad-accum, --epochs/--max-steps "
                             "and number of processes")

    def _check_cache(self) -> bool:
        """Opens ``--cache`` when it is read (every sample's features must be there); returns
        whether it is to be written first."""
        from .cache import TargetCache

        args = self.args
        self.cache = None
        if not args.cache:
            return False
        everything = self.train_samples + self.calibration_samples
        if args.write_cache:
            try:
                existing = TargetCache(args.cache, self.config.target_layer_ids,
                                       int(self.text.hidden_size))
                return not all(s.index in existing for s in everything)
            except SystemExit:
                return True
        self.cache = TargetCache(args.cache, self.config.target_layer_ids,
                                 int(self.text.hidden_size))
        missing = [s.index for s in everything if s.index not in self.cache]
        if missing:
            raise SystemExit(f"--cache {args.cache}: no features for {len(missing)} samples of "
                             f"--data (first: row {missing[0]}); write them with --write-cache")
        return False

    def _load_target(self, transformers):
        """The target model and its feature hooks (:class:`.target.OnlineTarget`), unless a
        resumed run reads a cache; None then."""
        args = self.args
        self.target = None
        if self.cache is not None and self.resume_state is not None:
            return None
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                args.target, dtype=self.dtype, attn_implementation="sdpa")
        except (OSError, ValueError) as error:
            raise SystemExit(f"--target {args.target}: {error}") from None
        model = model.to(self.device).eval()
        from .target import OnlineTarget

        self.target = OnlineTarget(model, self.config.target_layer_ids)
        return model

    def _fill_cache(self, write: bool) -> None:
        """Writes the cache when asked to, then reads the features from it."""
        if write:
            self._write_cache(self.args, self.config, int(self.text.hidden_size))
        if self.args.cache and self.cache is None:
            from .cache import TargetCache

            self.cache = TargetCache(self.args.cache, self.config.target_layer_ids,
                                     int(self.text.hidden_size))

    def _make_draft(self, model) -> nn.Module:
        """The resumed draft, or a new one with the target's embedding and LM head (frozen),
        in float32 on the device."""
        torch.manual_seed(self.args.seed)
        if self.resume_state is not None:
            draft = self.resume_state.pop("draft")
            draft.embed_tokens.requires_grad_(False)
            draft.lm_head.requires_grad_(False)
        else:
            draft = init_draft(self.config, model,
                               float(getattr(self.text, "initializer_range", 0.02)),
                               layers_from_target=self.args.init_from_target)
        if self.cache is not None and self.target is not None:  # the cache replaces it
            self.target.close()
            self.target = None
        return draft.to(device=self.device, dtype=torch.float32)

    def _set_up_vocabulary(self, transformers) -> None:
        """``--draft-vocab N``: the draft's vocabulary, the ``N`` ids most frequent among the
        training samples' response tokens with the target's special tokens and the mask token
        always in (a resumed draft keeps the one it was saved with)."""
        size = self.args.draft_vocab
        have = getattr(self.draft, "draft_vocabulary", None)
        if have is not None or size is None:
            if size is not None and have.size != size:
                raise SystemExit(f"--draft-vocab {size}: the resumed draft has a vocabulary of "
                                 f"{have.size} ids")
            return
        vocab = self.config.vocab_size
        if not 1 <= size <= vocab:
            raise SystemExit(f"--draft-vocab must be in [1, {vocab}], got {size}")
        always = {self.config.mask_token_id}
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            ids = getattr(self.text, name, None)
            always |= set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
        try:
            always |= set(transformers.AutoTokenizer.from_pretrained(
                self.args.target).all_special_ids)
        except (OSError, ValueError):
            pass  # the config's special ids above
        counts = count_response_tokens(({"input_ids": s.input_ids, "loss_mask": s.loss_mask}
                                        for s in self.train_samples), vocab)
        vocabulary = DraftVocabulary.most_frequent(counts, size,
                                                   sorted(t for t in always if 0 <= t < vocab))
        self.draft.draft_vocabulary = vocabulary
        if self.dist.main:
            inside = int(counts[vocabulary.d2t].sum()) / max(int(counts.sum()), 1)
            print(f"draft vocabulary: {size} of {vocab} ids, {inside:.2%} of the training "
                  "answers' tokens inside", flush=True)

    def _set_up_loss(self) -> None:
        """The family's objective (:data:`.objectives.TRAINING_LOSSES`, by the registry's
        name) and the module DistributedDataParallel wraps."""
        self.objective = TRAINING_LOSSES[family_of(self.draft).training_loss](self.draft,
                                                                              self.args)
        self.coefficients = self.objective.coefficients
        self.step_module = _DraftStep(self.draft, self.objective)
        self.model = self.step_module
        if self.dist.enabled:
            unused = self.draft.confidence_head is not None and self.coefficients[2] == 0
            self.model = nn.parallel.DistributedDataParallel(
                self.step_module, device_ids=[self.device.index] if self.device.type == "cuda"
                else None, find_unused_parameters=unused)

    def _set_up_optimizer(self) -> None:
        args = self.args
        self.params = [p for p in self.draft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr,
                                           weight_decay=args.weight_decay)
        warmup = int(args.warmup_ratio * self.total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, self.total_steps, warmup, args.min_lr_ratio))

    def _restore_training_state(self) -> None:
        """A resumed run's optimiser, scheduler, step and random states: it goes on exactly."""
        self.next_step = 0
        if self.resume_state is not None:
            state = self.resume_state
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.next_step = int(state["next_step"])
            set_rng_state(state["rng"])
            self.resume_state = None

    # -- the target's features ---------------------------------------------------------------

    def _features(self, samples, data: dict):
        """The micro-batch's target features and final hidden states: from the cache, or a
        target forward."""
        if self.cache is not None:
            return self.cache.batch(samples, self.dtype, self.device)
        return self.target(data["input_ids"], data["valid"])

    def _write_cache(self, args, config, hidden_size: int) -> None:
        samples = self.train_samples + self.calibration_samples
        if self.dist.main:
            from .cache import write_cache

            bar = _progress(len(samples), 0, not args.no_progress, "cache", "sample")
            device = self.device

            def features_of(ids, valid):
                return self.target(ids.to(device), valid.to(device))

            write_cache(args.cache, samples, features_of,
                        target_layer_ids=config.target_layer_ids, hidden_size=hidden_size,
                        target_name=args.target, data_path=args.data,
                        dtype=DTYPES[args.cache_dtype], batch_tokens=args.batch_tokens,
                        progress=bar.update if bar is not None else None)
            if bar is not None:
                bar.close()
            print(f"cache: {len(samples)} samples written to {args.cache}", flush=True)
        self.dist.barrier()

    # -- one step ----------------------------------------------------------------------------

    def _micro_step(self, step: int, micro: int, sums: torch.Tensor) -> None:
        args, dist = self.args, self.dist
        epoch, samples = self.schedule.micro_batch(step, micro, dist.rank)
        data = self.objective.collate(samples, epoch, args.seed, self.device)
        features, last_hidden = self._features(samples, data)
        denominators = self.objective.denominators(data, dist)
        last = micro == args.grad_accum - 1
        sync = self.model.no_sync() if dist.enabled and not last else contextlib.nullcontext()
        with sync:
            with self._autocast():
                result = self.model(data, features, last_hidden, denominators)
            (self.objective.loss(result) * dist.world_size / args.grad_accum).backward()
        sums += self.objective.sums(result, data, args.grad_accum).to(sums)

    def _autocast(self):
        return (torch.autocast(self.device.type, dtype=self.dtype) if self.autocast
                else contextlib.nullcontext())

    def _step(self, step: int) -> dict:
        block = self.config.block_size
        sums = torch.zeros(4 + 2 * block + 2, dtype=torch.float64, device=self.device)
        for micro in range(self.args.grad_accum):
            self._micro_step(step, micro, sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.args.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums = self.dist.all_reduce(sums).cpu()
        accept, count = sums[4:4 + block], sums[4 + block:4 + 2 * block]
        row = {"step": step + 1, "loss": float(sums[0]), "ce": float(sums[1]),
               "l1": float(sums[2]), "confidence": float(sums[3]), "lr": lr,
               "grad_norm": float(grad_norm)}
        for k in range(block):
            row[f"accept_rate@{k}"] = float(accept[k] / count[k]) if count[k] else None
        blocks = float(sums[-1])
        row["tau_probabilistic"] = float(sums[-2]) / blocks if blocks else None
        return row

    # -- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, calibration: Optional[dict] = None) -> Optional[str]:
        """Writes ``OUT/step_N`` (rank 0, :func:`.checkpoint.save_checkpoint`) and points
        ``step_latest`` at it."""
        path = None
        if self.dist.main:
            state = {"format": 1, "next_step": self.next_step,
                     "total_steps": self.total_steps,
                     "optimizer": self.optimizer.state_dict(),
                     "scheduler": self.scheduler.state_dict(), "rng": rng_state(),
                     "schedule": self.schedule.fingerprint(),
                     "world_size": self.dist.world_size}
            path = write_checkpoint(self.args.out, self.draft, state, dict(vars(self.args)),
                                    calibration)
        self.dist.barrier()
        return path

    # -- calibration -------------------------------------------------------------------------

    @torch.no_grad()
    def calibrate(self) -> Optional[dict]:
        """Sequential temperature scaling of the confidence head on the held-out samples.

        The outcome of slot ``k`` is drawn from its expected acceptance ``c* = 1 - TV(p, q)``
        (the probability that the verifier accepts a draft sampled from the draft's
        distribution), slot by slot until the first rejection; slots past the eval mask are
        not verified.
        """
        if not self.calibration_samples or self.draft.confidence_head is None:
            return None
        from ..calibration import fit_sequential_temperatures

        args = self.args
        self.draft.eval()
        logits, accepted, verified = [], [], []
        g = torch.Generator().manual_seed(args.seed + 1)
        samples = self.calibration_samples
        per_batch = max(1, args.batch_tokens // max(len(s.input_ids) for s in samples))
        for start in range(0, len(samples), per_batch):
            chunk = samples[start:start + per_batch]
            data = self.objective.collate(chunk, -1, args.seed, self.device)
            features, last_hidden = self._features(chunk, data)
            with self._autocast():
                out, conf = self.step_module(data, features, last_hidden, None)
            eval_mask, keep = data["eval_mask"], data["block_keep_mask"]
            rows = (keep & eval_mask[..., 0]).reshape(-1)
            c = out.accept_rate.reshape(eval_mask.shape).reshape(-1, eval_mask.shape[-1])[rows]
            n_verified = eval_mask.reshape(-1, eval_mask.shape[-1])[rows].sum(-1)
            draws = torch.rand(c.shape, generator=g, dtype=torch.float64).to(c.device)
            success = (draws < c.double()).int().cumprod(-1).sum(-1)
            logits.append(conf.reshape(-1, eval_mask.shape[-1])[rows].float().cpu())
            accepted.append(torch.minimum(success, n_verified).cpu())
            verified.append(n_verified.cpu())
        self.draft.train()
        logits, accepted, verified = torch.cat(logits), torch.cat(accepted), torch.cat(verified)
        if logits.shape[0] == 0:
            return None
        temps = fit_sequential_temperatures(logits, accepted, num_verified=verified)
        return {"calib_temperature": [float(t) for t in temps],
                "num_blocks": int(logits.shape[0]), "num_samples": len(samples),
                "mean_accepted": float(accepted.double().mean()),
                "method": "sequential temperature scaling (fit_sequential_temperatures) on "
                          "held-out anchor blocks, outcomes drawn from c* = 1 - TV(p, q)"}

    # -- the loop ----------------------------------------------------------------------------

    def train(self) -> Optional[str]:
        """Runs the remaining steps; returns the final checkpoint's path (rank 0)."""
        args, dist = self.args, self.dist
        if dist.main:
            os.makedirs(args.out, exist_ok=True)
            metrics_path = os.path.join(args.out, "metrics.jsonl")
            if self.next_step > 0 and os.path.exists(metrics_path):
                with open(metrics_path) as f:  # drop lines past the resumed step
                    kept = [ln for ln in f if ln.strip()
                            and json.loads(ln).get("step", 0) <= self.next_step]
                with open(metrics_path, "w") as f:
                    f.writelines(kept)
            elif self.next_step == 0 and os.path.exists(metrics_path):
                os.remove(metrics_path)
            self._print_header()
        dist.barrier()
        self.draft.train()
        bar = _progress(self.total_steps, self.next_step, dist.main and not args.no_progress)
        started = time.perf_counter()
        tokens_done = 0
        row = None
        while self.next_step < self.total_steps:
            step = self.next_step
            t0 = time.perf_counter()
            row = self._step(step)
            self.next_step += 1
            elapsed = time.perf_counter() - t0
            tokens = self.schedule.tokens(step)
            tokens_done += tokens
            row.update(tokens=tokens, tokens_per_second=tokens / elapsed,
                       peak_memory_mib=_peak_memory(self.device), seconds=elapsed)
            if dist.main:
                with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
                self._show(bar, row)
            if self.next_step % args.checkpoint_every == 0 and self.next_step < self.total_steps:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        total = time.perf_counter() - started
        calibration = self.calibrate() if dist.main else None
        path = self.save_checkpoint(calibration)
        if dist.main:
            rate = tokens_done / total if total > 0 and tokens_done else float("nan")
            print(f"done: {self.total_steps} steps, {tokens_done} tokens in {total:.1f} s "
                  f"({rate:.0f} tokens/s), peak memory {_peak_memory(self.device):.0f} MiB",
                  flush=True)
            if calibration is not None:
                temps = ", ".join(f"{t:.2f}" for t in calibration["calib_temperature"])
                print(f"calibration: temperatures [{temps}] from {calibration['num_blocks']} "
                      "held-out blocks", flush=True)
            print(f"checkpoint: {path}", flush=True)
        return path

    def _print_header(self) -> None:
        trainable = sum(p.numel() for p in self.params)
        print(self.objective.describe_draft(self.config, trainable), flush=True)
        vocabulary = getattr(self.draft, "draft_vocabulary", None)
        if vocabulary is not None:
            print(f"draft vocabulary: {vocabulary.size} of {vocabulary.vocab_size} ids (the "
                  "LM head and W2 train on its rows)", flush=True)
        print(f"data: {len(self.train_samples)} training samples ({self.dropped} dropped), "
              f"{len(self.calibration_samples)} held out; {self.total_steps} steps of "
              f"{self.args.grad_accum} micro-step(s) x {self.dist.world_size} rank(s); loss "
              f"{self.objective.describe_loss(self.args)}; device {self.device}", flush=True)
        if self.next_step:
            print(f"resumed from {self.resume_path} at step {self.next_step}", flush=True)

    def _show(self, bar, row: dict) -> None:
        text = {"loss": f"{row['loss']:.3f}", "ce": f"{row['ce']:.3f}", "l1": f"{row['l1']:.3f}",
                "conf": f"{row['confidence']:.3f}"}
        if row["tau_probabilistic"] is not None:
            text["tau"] = f"{row['tau_probabilistic']:.2f}"
        if row.get("accept_rate@0") is not None:
            text["acc@0"] = f"{row['accept_rate@0']:.2f}"
        text["tok/s"] = f"{row['tokens_per_second']:.0f}"
        if bar is not None:
            bar.set_postfix(text, refresh=False)
            bar.update(1)
        elif not self.args.no_progress:
            print(f"step {row['step']}/{self.total_steps} "
                  + " ".join(f"{k} {v}" for k, v in text.items()), flush=True)

    def close(self) -> None:
        if self.target is not None:
            self.target.close()
        if self.dist.enabled:
            torch.distributed.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> Optional[str]:
    """Entry point of ``python -m dspark_ops.train``; returns the final checkpoint (rank 0)."""
    args = parse_args(argv)
    trainer = Trainer(args)
    try:
        return trainer.train()
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1:])
