"""What ``python -m dspark_ops.generate`` and ``python -m dspark_ops.eval`` share: the flags, loading
a transformers target with its tokenizer and a DSpark/DFlash draft from local directories, and
timing the speculative and the plain decoder on the same prompts and seeds."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import List, Optional, Sequence

import torch

from .costs import CostTable, cost_key, load_or_profile_costs
from .decoder import SCHEDULERS, SpeculativeDecoder, generate_target_only
from .models import DSparkDraft, load_draft
from .models.release import release_metadata
from .prompts import chat_prompt, stop_token_ids
from .proposers import PromptLookupProposer, make_proposer

#: ``--draft``'s value for prompt lookup (no draft model).
PROMPT_LOOKUP = "prompt-lookup"

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True,
                        help="local directory of a transformers causal LM and its tokenizer")
    parser.add_argument("--draft", required=True,
                        help="local directory of a DeepSpec DSpark, DFlash or Eagle3 draft "
                             "checkpoint, a release file (python -m dspark_ops.release), or "
                             "'prompt-lookup' (n-gram drafts from the request's own tokens, no "
                             "model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="of both models (default: bfloat16 on CUDA, float32 on CPU; "
                             "float64 runs the draft in float32)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=None,
                        help="drafts per round G (default: the draft's block_size)")
    parser.add_argument("--scheduler", choices=SCHEDULERS, default="goodput",
                        help="how many drafts to draft and verify per round (default: "
                             "'goodput', from the machine's measured cost table: speculation "
                             "only where it pays; 'fixed': every draft, as in the paper's "
                             "Table 1)")
    parser.add_argument("--cost-table", default=None,
                        help="a cost table (python -m dspark_ops.profile) for --scheduler "
                             "goodput; default: the cached one for this target, draft, device, "
                             "dtype and thread count, measured on first use (seconds)")
    parser.add_argument("--seed", type=int, default=0,
                        help="request i samples with seed + i, in both decoders")
    parser.add_argument("--calibration", default=None,
                        help="JSON with the confidence head's 'calib_temperature' (default: the "
                             "draft directory's calibration.json, written by dspark_ops.train)")
    add_sampling_arguments(parser)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The sampling flags; :func:`sampling_kwargs` turns them into ``generate`` arguments."""
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy (the default); drafts sample at the same temperature")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most probable tokens")
    parser.add_argument("--top-p", type=float, default=None,
                        help="keep the most probable tokens up to this total probability")
    parser.add_argument("--min-p", type=float, default=None,
                        help="keep the tokens at least this fraction as probable as the top one")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``SpeculativeDecoder.generate`` and ``generate_target_only``
    that the sampling flags set."""
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 0:
        raise SystemExit(f"--top-k must be >= 0, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise SystemExit(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        raise SystemExit(f"--min-p must be in [0, 1], got {args.min_p}")
    filters = {k: getattr(args, k) for k in ("top_k", "top_p", "min_p")
               if getattr(args, k) is not None}
    return {"temperature": args.temperature, **filters}


@dataclasses.dataclass
class Models:
    tokenizer: object
    target: object  # HFTarget
    draft: object  # DSparkDraft, Eagle3Draft or PromptLookupProposer
    decoder: SpeculativeDecoder
    stop_token_ids: List[int]


def load_models(args: argparse.Namespace) -> Models:
    """The target (:class:`dspark_ops.hf.HFTarget`), its tokenizer and the draft (any family:
    :func:`dspark_ops.load_draft`), checked against each other."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise SystemExit("these commands need transformers: pip install --no-build-isolation "
                         "'.[hf]'") from error
    from .hf import HFTarget

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    # The drafting ops take 16/32-bit floats: a float64 target gets a float32 draft.
    draft_dtype = torch.float32 if dtype == torch.float64 else dtype
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype,
                                                 attn_implementation="sdpa").to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target_config = getattr(model.config, "text_config", None) or model.config
    stop = stop_token_ids(model, tokenizer)
    if args.draft == PROMPT_LOOKUP:
        proposer = PromptLookupProposer(args.block_size or 10)
        target = HFTarget(model, [-1])  # one feature layer: no draft reads them
        return Models(tokenizer, target, proposer,
                      _decoder(args, target, proposer, stop, None), stop)
    try:  # a checkpoint directory, or a release file rebuilt with this target's embeddings
        draft = load_draft(args.draft, dtype=draft_dtype, device=device, target=model).eval()
    except (OSError, ValueError) as error:
        raise SystemExit(f"--draft {args.draft}: {error}") from error
    config = draft.config
    depth = target_config.num_hidden_layers
    if config.target_num_hidden_layers not in (None, depth):
        raise SystemExit(f"the draft was trained on a {config.target_num_hidden_layers}-layer "
                         f"target; {args.target} has {depth} layers")
    if target_config.vocab_size != config.vocab_size:
        raise SystemExit(f"vocab sizes differ: target {target_config.vocab_size}, draft "
                         f"{config.vocab_size}")
    features = getattr(config, "target_hidden_size", None) or config.hidden_size
    if target_config.hidden_size != features:
        raise SystemExit(f"the draft reads {features}-wide target features; the target's hidden "
                         f"size is {target_config.hidden_size}")
    target = HFTarget(model, config.target_layer_ids)
    calib = load_calibration(args, draft)
    proposer = make_proposer(draft, block_size=args.block_size, calib_temperature=calib)
    return Models(tokenizer, target, draft, _decoder(args, target, proposer, stop, calib), stop)


def _decoder(args: argparse.Namespace, target, proposer, stop, calib) -> SpeculativeDecoder:
    """The decoder of ``--scheduler``, with the cost table of ``--cost-table`` (refused when
    measured on another setting) or the cached one, profiled on first use."""
    costs = None
    if args.scheduler == "goodput" or getattr(args, "cost_table", None):
        key = cost_key(target, proposer, device=target.device, dtype=target.dtype)
        try:
            costs = (CostTable.load(args.cost_table, key) if getattr(args, "cost_table", None)
                     else load_or_profile_costs(target, proposer))
        except (OSError, ValueError) as error:
            raise SystemExit(f"--cost-table: {error}") from error
    try:
        return SpeculativeDecoder(target, proposer, scheduler=args.scheduler, costs=costs,
                                  eos_token_id=stop, calib_temperature=calib)
    except ValueError as error:  # e.g. a DFlash draft (no confidence head) with --scheduler
        raise SystemExit(f"--scheduler {args.scheduler}: {error}") from error


def draft_kind(draft) -> str:
    """``"eagle3"`` (a chain-drafting family, by its name), ``"dflash"`` (no sequential head),
    ``"dspark"`` or ``"prompt-lookup"``."""
    from .models.registry import family_of

    if isinstance(draft, PromptLookupProposer):
        return PROMPT_LOOKUP
    family = family_of(draft)
    if family.drafting == "chain":
        return family.name
    return "dflash" if draft.config.is_dflash else "dspark"


def load_calibration(args: argparse.Namespace, draft: DSparkDraft) -> Optional[torch.Tensor]:
    """The confidence head's temperatures (float32 ``[G]``) from ``--calibration``, the draft
    directory's ``calibration.json`` or the release file's; None without any or without a
    confidence head."""
    explicit = getattr(args, "calibration", None)
    path = explicit or os.path.join(args.draft, "calibration.json")
    if explicit is None and os.path.isfile(args.draft):  # a release file carries its own
        temps, path = release_metadata(args.draft).get("calibration"), args.draft
        if temps is None or draft.confidence_head is None:
            return None
    elif draft.confidence_head is None or not os.path.isfile(path):
        if getattr(args, "calibration", None):
            raise SystemExit(f"--calibration {path}: no such file, or the draft has no "
                             "confidence head")
        return None
    else:
        with open(path) as f:
            temps = json.load(f).get("calib_temperature")
    block = args.block_size or draft.config.block_size
    if not isinstance(temps, list) or len(temps) < block:
        raise SystemExit(f"{path}: 'calib_temperature' must list at least {block} temperatures")
    return torch.tensor(temps[:block], dtype=torch.float32)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Comparison:
    """One batch through both decoders."""

    speculative: object  # GenerateOutput
    plain_tokens: List[List[int]]
    speculative_seconds: float
    plain_seconds: float

    @property
    def speculative_forwards(self) -> int:
        """Target forwards: the prefill and one verify per round."""
        return 1 + len(self.speculative.rounds)

    @property
    def plain_forwards(self) -> int:
        """The prefill and one forward per token after the first."""
        return max(len(t) for t in self.plain_tokens)


def compare(models: Models, prompts: Sequence[Sequence[int]], args: argparse.Namespace,
            first_seed: Optional[int] = None) -> Comparison:
    """The prompts through the speculative decoder and plain target decoding, same seeds."""
    seed0 = args.seed if first_seed is None else first_seed
    seeds = torch.arange(seed0, seed0 + len(prompts), dtype=torch.int64)
    kwargs = sampling_kwargs(args)
    _sync(args.device)
    started = time.perf_counter()
    out = models.decoder.generate(prompts, args.max_new_tokens, seed=seeds, **kwargs)
    _sync(args.device)
    middle = time.perf_counter()
    plain = generate_target_only(models.target, prompts, args.max_new_tokens, seed=seeds,
                                 eos_token_id=models.stop_token_ids, **kwargs)
    _sync(args.device)
    return Comparison(out, plain, middle - started, time.perf_counter() - middle)


def warm_up(models: Models, args: argparse.Namespace) -> None:
    """One short run of both decoders, so that one-time costs (kernel loading, allocator
    growth) are not timed."""
    short = argparse.Namespace(**{**vars(args), "max_new_tokens": min(8, args.max_new_tokens)})
    compare(models, [[0, 1, 2, 3]], short)


def progress(iterable, total: int, description: str, enabled: bool = True):
    """tqdm's progress bar on stderr when tqdm is installed (transformers brings it)."""
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=description, unit="prompt", leave=False)


def speedup(plain_seconds: float, speculative_seconds: float) -> float:
    return plain_seconds / speculative_seconds if speculative_seconds > 0 else float("nan")
