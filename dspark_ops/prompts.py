"""``python -m dspark_ops.prompts``: offline, deterministic prompt sets for training and evaluating
drafts: math, code and chat, with held-out evaluation sets disjoint from training; and a prompt as
a chat model reads it (:func:`chat_prompt`) with the ids its answer stops at
(:func:`stop_token_ids`).

Every prompt comes from a *unit*, and the units of a category are split once, independently of
the seed, into training units and held-out units; a held-out file draws only from held-out units,
the training file only from training units, so no held-out prompt can be a training prompt (and
the writer checks it anyway).

- **math** — units are templates (arithmetic, algebra, number theory, geometry and word problems)
  filled with seeded numbers, names and objects; a fixed list of templates is held out.
- **code** — units are functions and methods of Python's standard library whose docstring opens
  with a clean one-line imperative summary ("Return the ..."), turned into tasks ("Write a Python
  function that returns the ..."); summaries that two functions share count once, and a function
  is held out by a hash of its qualified name. The units depend on the Python version's
  docstrings, so the code prompts are reproducible for a given Python version.
- **chat** — units are topics (concepts, skills, history, places, comparisons, creative themes),
  each asked through its kind's question templates with an optional style instruction; a topic is
  held out by a hash of its text.

Prompts are drawn round-robin over the units in a seeded order, each unit with its own seeded
stream, so the sets spread evenly over the units and a smaller set is a prefix of a larger one
with the same seed. The same seed and sizes write byte-identical files::

    python -m dspark_ops.prompts --out prompts [--train-per-category 2000]
        [--eval-per-category 40] [--seed 0]

writes ``train.jsonl`` (every category, interleaved: any prefix is balanced),
``eval_math.jsonl``, ``eval_code.jsonl``, ``eval_chat.jsonl`` — one
``{"id": ..., "category": ..., "turns": [prompt]}`` per line, the format
``python -m dspark_ops.eval --data`` reads — and ``manifest.json`` (sizes, seed, held-out
units).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import inspect
import itertools
import json
import math
import os
import random
import re
import sys
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["CATEGORIES", "Unit", "build", "chat_prompt", "code_tasks", "held_out", "main",
           "stop_token_ids", "units", "write"]

CATEGORIES = ("math", "code", "chat")

# Fraction of code functions and chat topics held out (by a hash of their key; see held_out).
HELD_OUT_FRACTION = {"code": 0.15, "chat": 0.2}


@dataclasses.dataclass(frozen=True)
class Unit:
    """One source of prompts: a math template, a standard-library function or a chat topic.

    Attributes
    ----------
    key : str
        Unique within its category; decides the split.
    held_out : bool
        Whether the unit belongs to the held-out evaluation sets.
    stream : callable
        ``stream(rng)`` yields the unit's prompts (finitely many for code and chat units).
    """

    key: str
    held_out: bool
    stream: Callable[[random.Random], Iterator[str]]


def chat_prompt(tokenizer, text: str) -> List[int]:
    """``text`` as the user's turn through the tokenizer's chat template, with the assistant's
    turn opened and thinking off (as DeepSpec's evaluator encodes it; generate, eval and the
    real-model benchmarks encode every prompt so)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def stop_token_ids(model, tokenizer) -> List[int]:
    """The generation config's EOS ids (one or several), else the tokenizer's, as DeepSpec's
    evaluator resolves them."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else list(dict.fromkeys(int(t) for t in eos))


def held_out(category: str, key: str) -> bool:
    """Whether the code function or chat topic ``key`` is held out: the first 32 bits of
    ``sha256("category/key")`` fall below the category's held-out fraction. Independent of the
    seed and of which other units exist."""
    digest = hashlib.sha256(f"{category}/{key}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") < HELD_OUT_FRACTION[category] * 2 ** 32


def _shuffled(items: Sequence[str]) -> Callable[[random.Random], Iterator[str]]:
    def stream(rng: random.Random) -> Iterator[str]:
        order = list(items)
        rng.shuffle(order)
        yield from order
    return stream


# -- math ------------------------------------------------------------------------------------

_WOMEN = ("Amara", "Beatriz", "Chloe", "Dana", "Elena", "Fatima", "Grace", "Hana", "Ines", "Julia",
          "Keiko", "Lena", "Maya", "Nadia", "Olivia", "Priya", "Rosa", "Sofia", "Tara", "Yara")
_MEN = ("Ahmed", "Ben", "Carlos", "David", "Emeka", "Felix", "Gabriel", "Hiro", "Ivan", "James",
        "Kofi", "Liam", "Mateo", "Noah", "Omar", "Pavel", "Raj", "Samuel", "Tomas", "Wei")
_OBJECTS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "seashells",
            "trading cards", "balloons", "oranges", "coins", "crayons", "cupcakes", "postcards",
            "toy cars", "beads", "muffins", "notebooks", "flowers")
_ITEMS = (("notebook", 3), ("sandwich", 6), ("T-shirt", 12), ("mug", 8), ("pen", 2),
          ("backpack", 35), ("umbrella", 15), ("lamp", 24), ("pair of socks", 5), ("puzzle", 18))
_VEHICLES = ("car", "train", "bus", "delivery van", "truck", "ferry", "motorbike")
_ACTIVITIES = ("homework", "a run", "baking a cake", "cleaning the garage", "a piano lesson",
               "painting a picture", "a board game")
_DISHES = ("pancakes", "muffins", "cookies", "bread rolls", "waffles")
_ENDINGS = ("", "", " Show your work.", " Explain your reasoning step by step.",
            " Give the final answer on its own line.")


def _person(rng: random.Random) -> Tuple[str, str, str, str]:
    """A name with its subject, object and possessive pronouns."""
    if rng.random() < 0.5:
        return rng.choice(_WOMEN), "she", "her", "her"
    return rng.choice(_MEN), "he", "him", "his"


def _two_people(rng: random.Random):
    first = _person(rng)
    second = _person(rng)
    while second[0] == first[0]:
        second = _person(rng)
    return first, second


def _m_add(r):
    return f"What is {r.randint(100, 9999)} + {r.randint(100, 9999)}?"


def _m_sub(r):
    a = r.randint(500, 9999)
    return f"Calculate {a} - {r.randint(100, a)}."


def _m_mul(r):
    return f"What is {r.randint(12, 999)} times {r.randint(3, 99)}?"


def _m_div(r):
    b = r.randint(3, 40)
    return f"What is {b * r.randint(5, 250)} divided by {b}?"


def _m_mixed(r):
    return (f"Evaluate {r.randint(10, 99)} + {r.randint(2, 20)} × {r.randint(2, 20)} - "
            f"{r.randint(1, 50)}, following the order of operations.")


def _m_paren(r):
    return f"Compute ({r.randint(5, 99)} + {r.randint(5, 99)}) × {r.randint(2, 15)}."


def _m_squares(r):
    return f"What is {r.randint(2, 30)} squared plus {r.randint(2, 30)} squared?"


def _m_percent(r):
    return f"What is {r.choice((5, 10, 12, 15, 20, 25, 30, 40, 75))}% of {r.randint(2, 80) * 10}?"


def _m_fraction_add(r):
    b, d = r.randint(2, 12), r.randint(2, 12)
    return (f"Add the fractions {r.randint(1, b - 1)}/{b} and {r.randint(1, d - 1)}/{d} and "
            "simplify the result.")


def _m_simplify(r):
    a, b = r.randint(1, 12), r.randint(2, 15)
    while math.gcd(a, b) != 1 or a >= b:
        a, b = r.randint(1, 12), r.randint(2, 15)
    k = r.randint(2, 12)
    return f"Simplify the fraction {a * k}/{b * k}."


def _m_decimal(r):
    return f"What is {r.randint(100, 9999) / 100:.2f} + {r.randint(100, 9999) / 100:.2f}?"


def _m_linear(r):
    a, x, b = r.randint(2, 12), r.randint(-10, 20), r.randint(1, 50)
    return f"Solve for x: {a}x + {b} = {a * x + b}."


def _m_two_step(r):
    a, x, b = r.randint(2, 9), r.randint(1, 25), r.randint(1, 30)
    return f"If {a}x - {b} = {a * x - b}, what is x?"


def _m_system(r):
    x, y = r.randint(1, 40), r.randint(1, 40)
    return f"Solve the system of equations x + y = {x + y} and x - y = {x - y}."


def _m_gcd(r):
    k = r.randint(2, 15)
    return (f"What is the greatest common divisor of {k * r.randint(2, 20)} and "
            f"{k * r.randint(2, 20)}?")


def _m_lcm(r):
    return f"Find the least common multiple of {r.randint(2, 30)} and {r.randint(2, 30)}."


def _m_remainder(r):
    return f"What is the remainder when {r.randint(50, 5000)} is divided by {r.randint(3, 19)}?"


def _m_prime(r):
    return f"Is {r.randint(20, 500)} a prime number? Explain how you know."


def _m_sqrt(r):
    return f"What is the square root of {r.randint(4, 40) ** 2}?"


def _m_mean(r):
    values = ", ".join(str(r.randint(1, 100)) for _ in range(r.randint(4, 7)))
    return f"What is the average of {values}?"


def _m_rectangle(r):
    return (f"A rectangle is {r.randint(2, 30)} cm wide and {r.randint(3, 40)} cm long. What are "
            "its area and its perimeter?")


def _m_circle(r):
    return (f"A circle has a radius of {r.randint(2, 20)} meters. What is its area? Use 3.14 "
            "for pi.")


def _m_have_more(r):
    (name, she, _, _), (other, _, _, _) = _two_people(r)
    obj, a, b = r.choice(_OBJECTS), r.randint(5, 60), r.randint(2, 30)
    return (f"{name} has {a} {obj}. {she.capitalize()} buys {b} more and then gives "
            f"{r.randint(1, a + b)} to {other}. How many {obj} does {name} have now?")


def _m_change(r):
    name, she, _, _ = _person(r)
    item, price = r.choice(_ITEMS)
    n = r.randint(2, 6)
    bill = next(x for x in (10, 20, 50, 100, 200, 500) if x >= n * price)
    return (f"{name} buys {n} of the same {item} at ${price} each and pays with a ${bill} bill. "
            f"How much change does {she} get?")


def _m_distance(r):
    return (f"A {r.choice(_VEHICLES)} travels at {r.randint(10, 120)} km per hour for "
            f"{r.randint(2, 9)} hours. How far does it travel?")


def _m_clock(r):
    name, she, _, _ = _person(r)
    return (f"{name} starts {r.choice(_ACTIVITIES)} at {r.randint(7, 11)}:"
            f"{r.choice(range(0, 60, 5)):02d} and finishes {r.randint(25, 170)} minutes later. "
            f"At what time does {she} finish?")


def _m_share(r):
    name, _, _, _ = _person(r)
    k, obj = r.randint(2, 9), r.choice(_OBJECTS)
    return (f"{name} shares {k * r.randint(2, 15)} {obj} equally among {k} friends. How many "
            f"{obj} does each friend get?")


def _m_savings(r):
    name, _, her, _ = _person(r)
    a = r.randint(3, 40)
    return (f"{name} saves ${a} every week. How many weeks does it take {her} to save "
            f"${a * r.randint(4, 30)}?")


def _m_ages(r):
    (name, _, _, _), (other, _, _, _) = _two_people(r)
    return (f"{name} is {r.randint(3, 15)} years old. {other} is {r.randint(2, 4)} times as old "
            f"as {name}. How old will {other} be in {r.randint(2, 12)} years?")


def _m_discount(r):
    item, price = r.choice(_ITEMS)
    return (f"A {item} costs ${price * r.randint(2, 5)}. It is on sale for "
            f"{r.choice((10, 20, 25, 30, 50))}% off. What is the sale price?")


def _m_work(r):
    (name, _, _, _), (other, _, _, _) = _two_people(r)
    return (f"{name} can paint a fence in {r.randint(2, 8)} hours and {other} can paint it in "
            f"{r.randint(3, 10)} hours. How long does it take them working together?")


def _m_recipe(r):
    dish, n = r.choice(_DISHES), r.randint(2, 6) * 4
    return (f"A recipe for {n} {dish} needs {r.randint(1, 4)} cups of flour. How many cups of "
            f"flour are needed for {n * r.randint(2, 4) // 2} {dish}?")


def _m_pages(r):
    name, _, _, _ = _person(r)
    p, d = r.randint(8, 40), r.randint(2, 9)
    return (f"{name} reads {p} pages a day. The book has {p * d + r.randint(10, 200)} pages. "
            f"How many pages are left after {d} days?")


def _m_garden(r):
    name, _, _, _ = _person(r)
    rows, cols = r.randint(3, 15), r.randint(4, 20)
    return (f"A garden has {rows} rows with {cols} plants in each row. {name} removes "
            f"{r.randint(1, rows * cols // 2)} plants. How many plants are left?")


def _m_temperature(r):
    return (f"The temperature was {r.randint(-5, 30)}°C in the morning and dropped by "
            f"{r.randint(3, 25)} degrees by midnight. What was the temperature at midnight?")


def _m_tickets(r):
    adult = r.randint(8, 25)
    return (f"Adult tickets cost ${adult} and child tickets cost ${r.randint(3, adult - 1)}. How "
            f"much do {r.randint(1, 5)} adults and {r.randint(1, 6)} children pay in total?")


def _m_interest(r):
    name, she, _, _ = _person(r)
    return (f"{name} puts ${r.randint(2, 50) * 100} in a savings account that pays "
            f"{r.randint(1, 8)}% simple interest per year. How much interest does {she} earn in "
            f"{r.randint(2, 10)} years?")


_MATH_TEMPLATES = {name[3:]: fn for name, fn in sorted(globals().items())
                   if name.startswith("_m_") and callable(fn)}
# A mix of kinds: arithmetic, algebra, number theory, geometry and word problems.
_MATH_HELD_OUT = frozenset({"paren", "two_step", "lcm", "circle", "share", "discount", "recipe",
                            "tickets"})


def _math_stream(template: Callable[[random.Random], str]):
    def stream(rng: random.Random) -> Iterator[str]:
        while True:
            yield template(rng) + rng.choice(_ENDINGS)
    return stream


def _math_units() -> List[Unit]:
    return [Unit(key, key in _MATH_HELD_OUT, _math_stream(fn))
            for key, fn in _MATH_TEMPLATES.items()]


# -- code ------------------------------------------------------------------------------------

# Pure computation, the same on every platform.
_CODE_MODULES = ("base64", "binascii", "bisect", "calendar", "cmath", "colorsys", "copy",
                 "datetime", "decimal", "difflib", "fnmatch", "fractions", "heapq", "html",
                 "ipaddress", "json", "keyword", "math", "posixpath", "quopri", "random", "re",
                 "shlex", "statistics", "string", "textwrap", "unicodedata", "urllib.parse",
                 "zlib")
_CODE_TYPES = (str, bytes, list, dict, set, int, float, complex, tuple)
# Imperative verbs a summary may open with; their third-person forms are accepted as well.
_VERBS = ("add", "append", "apply", "build", "calculate", "check", "choose", "collapse", "compare",
          "compute", "concatenate", "construct", "convert", "count", "create", "decode",
          "determine", "encode", "escape", "expand", "extract", "find", "format", "generate",
          "insert", "join", "locate", "make", "match", "merge", "normalize", "pad", "parse",
          "partition", "pop", "push", "quote", "remove", "replace", "return", "reverse", "round",
          "scan", "search", "shorten", "shuffle", "sort", "split", "strip", "test", "transform",
          "translate", "turn", "unquote", "validate", "wrap")
_SUMMARY = re.compile(r"[A-Z][A-Za-z0-9 ,'\-/]+\.")
_UNCLEAR = re.compile(r"\b(platform|deprecated|alias|internal|undocumented|self|this object|"
                      r"implementation|C)\b", re.I)
_LATER_VERB = re.compile(rf"\b(and|then) ({'|'.join(_VERBS)})\b")
_CODE_TEMPLATES = (
    "Write a Python function that {vp}",
    "Write a Python function `{name}` that {vp} Do not use `{qual}` from the standard library.",
    "Implement a Python function that {vp} Include a docstring and type hints.",
    "Write a Python function that {vp} Then show an example of calling it.",
    "Write a Python function that {vp} Also write three pytest unit tests for it.",
    "Explain how you would write a Python function that {vp} Then give the code.",
    "Write an efficient Python function that {vp} What is its time complexity?",
    "In Python, how do I write a function that {vq}?",
    "Write a short, readable Python function that {vp} Add comments to the tricky parts.",
)


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _task(summary: str) -> Optional[str]:
    """``"Return the x."`` -> ``"returns the x."``; ``None`` unless the summary is one clean
    imperative sentence."""
    if not (20 <= len(summary) <= 140 and _SUMMARY.fullmatch(summary)) or _UNCLEAR.search(summary):
        return None
    first, _, rest = summary.partition(" ")
    verb = first.lower()
    forms = {v: _third_person(v) for v in _VERBS}
    if verb in forms:
        verb = forms[verb]
    elif verb not in forms.values():
        return None
    if not rest:
        return None
    # "Pop and return ...", "Convert data to floats and compute ...": the later verbs too.
    rest = _LATER_VERB.sub(lambda m: f"{m.group(1)} {forms[m.group(2)]}", rest)
    return f"{verb} {rest}"


def _summary(obj) -> Optional[str]:
    doc = inspect.getdoc(obj)
    if not doc:
        return None
    return " ".join(doc.split("\n\n", 1)[0].split())


def _stdlib_functions() -> Iterator[Tuple[str, str, object]]:
    """(qualified name, short name, object), in a fixed order: modules as listed, then
    attributes by name; classes contribute their methods."""
    for module_name in _CODE_MODULES:
        module = importlib.import_module(module_name)
        own = (module_name, "_" + module_name)
        for name in sorted(dir(module)):
            if name.startswith("_"):
                continue
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isbuiltin(obj):
                if getattr(obj, "__module__", None) in own + (None,):
                    yield f"{module_name}.{name}", name, obj
            elif inspect.isclass(obj) and obj.__module__ in own:
                for attribute in sorted(vars(obj)):
                    if not attribute.startswith("_") and callable(getattr(obj, attribute)):
                        yield (f"{module_name}.{name}.{attribute}", attribute,
                               getattr(obj, attribute))
    for cls in _CODE_TYPES:
        for attribute in sorted(vars(cls)):
            if not attribute.startswith("_") and callable(getattr(cls, attribute)):
                yield f"{cls.__name__}.{attribute}", attribute, getattr(cls, attribute)


def code_tasks(summary: str, name: str, qualified: str) -> Optional[List[str]]:
    """The coding tasks that ask for a function ``name`` (``qualified``: its full name) whose
    docstring summary is ``summary``, one per code template; None unless the summary is one
    clean imperative sentence."""
    vp = _task(summary)
    if vp is None:
        return None
    return [t.format(vp=vp, vq=vp[:-1], name=name, qual=qualified) for t in _CODE_TEMPLATES]


def _code_units() -> List[Unit]:
    seen, result = set(), []
    for qual, name, obj in _stdlib_functions():
        summary = _summary(obj)
        prompts = code_tasks(summary, name, qual) if summary else None
        if prompts is None:
            continue
        # The first template is the bare task: two functions with the same one count once.
        task = prompts[0]
        if task in seen or qual in seen:
            continue
        seen.update((task, qual))
        result.append(Unit(qual, held_out("code", qual), _shuffled(prompts)))
    return result


# -- chat ------------------------------------------------------------------------------------

_CHAT = {
    "concept": (
        ("photosynthesis", "black holes", "inflation in economics", "machine learning",
         "the water cycle", "plate tectonics", "compound interest", "how vaccines work",
         "the immune system", "the greenhouse effect", "blockchain", "quantum computing",
         "the theory of evolution", "supply and demand", "DNA replication", "gravity",
         "electric circuits", "public-key encryption", "renewable energy", "antibiotic resistance",
         "the stock market", "cloud computing", "neural networks", "the placebo effect",
         "ocean tides", "volcanoes", "earthquakes", "recycling", "how the heart pumps blood",
         "why we sleep", "how memory works", "GPS navigation", "rainbows", "the seasons",
         "opportunity cost", "entropy"),
        ("Explain {t} in simple terms.", "What is {t}, and why does it matter?",
         "How would you explain {t} to a ten-year-old?",
         "What are some common misconceptions about {t}?",
         "Give a real-world example that illustrates {t}.", "Summarize the key ideas behind {t}.",
         "What open questions remain about {t}?",
         "Write a short paragraph about {t} for a school newsletter."),
    ),
    "skill": (
        ("learning a new language", "public speaking", "cooking at home",
         "training for a first marathon", "gardening on a balcony", "making a monthly budget",
         "time management", "learning to play the guitar", "photography with a phone",
         "meditation", "writing a resume", "preparing for a job interview", "playing chess",
         "drawing portraits", "swimming", "baking bread", "studying for exams", "working remotely",
         "professional networking", "keeping a journal", "yoga", "learning to code",
         "negotiating a salary", "saving for retirement", "hiking", "knitting",
         "basic car maintenance", "making friends in a new city", "speed reading",
         "touch typing"),
        ("How can a beginner get started with {t}?",
         "What are the most common mistakes people make with {t}?",
         "Give me five practical tips for {t}.", "Create a simple one-week plan for {t}.",
         "What are the benefits of {t}?", "What resources would you recommend for {t}?",
         "How do I stay motivated with {t}?",
         "Write a short encouraging message for someone struggling with {t}."),
    ),
    "history": (
        ("the French Revolution", "the invention of the printing press",
         "the Industrial Revolution", "the fall of the Western Roman Empire",
         "the Apollo 11 moon landing", "the Renaissance", "the Silk Road",
         "the building of the pyramids of Giza", "the American Civil War",
         "the discovery of penicillin", "the Cold War", "the Meiji Restoration",
         "the invention of the telephone", "the Black Death", "the fall of the Berlin Wall",
         "the Wright brothers' first flight", "the voyages of Zheng He", "the Magna Carta",
         "the Protestant Reformation", "the Scientific Revolution", "the Mongol Empire",
         "the independence of India", "the construction of the Panama Canal",
         "the Ottoman Empire", "ancient Athenian democracy"),
        ("What caused {t}?", "What were the main consequences of {t}?",
         "Describe {t} in a few paragraphs.", "Who were the key people involved in {t}?",
         "Why is {t} considered important today?", "Write a short timeline of {t}.",
         "What lessons can we learn from {t}?", "Explain {t} as a museum guide would."),
    ),
    "place": (
        ("Paris", "Kyoto", "the Amazon rainforest", "Iceland", "New York City", "the Sahara",
         "Istanbul", "the Great Barrier Reef", "Patagonia", "Mexico City", "Cape Town",
         "the Swiss Alps", "Marrakech", "Sydney", "Vancouver", "Rome", "Bangkok", "Buenos Aires",
         "the Scottish Highlands", "Seoul", "Lisbon", "Hawaii", "the Grand Canyon", "Cairo",
         "Prague", "Lake Baikal", "the Galápagos Islands"),
        ("What is {t} known for?", "Plan a three-day trip to {t}.",
         "What should a first-time visitor to {t} know?",
         "Describe the climate and geography of {t}.", "What food should I try in {t}?",
         "Write a short postcard from {t}.", "Give a brief history of {t}.",
         "What environmental challenges does {t} face?"),
    ),
    "compare": (
        ("Python and JavaScript", "cats and dogs as pets", "renting and buying a home",
         "trains and planes for travel in Europe", "e-books and printed books",
         "running and cycling for fitness", "tea and coffee", "solar and wind power",
         "working from home and working in an office", "public and private schools",
         "electric and petrol cars", "SQL and NoSQL databases", "Linux and Windows",
         "classical and jazz music", "city life and country life", "Mac and PC laptops",
         "saving and investing", "Spanish and French for English speakers",
         "paper maps and navigation apps", "podcasts and audiobooks"),
        ("What are the main differences between {t}?", "Compare {t}: the pros and cons of each.",
         "Help me decide between {t}.", "Write a short debate about {t}.",
         "What do {t} have in common?", "Make a comparison table of {t}.",
         "Which questions should I ask myself when choosing between {t}?",
         "Explain the trade-offs between {t} to a friend."),
    ),
    "creative": (
        ("autumn", "friendship", "the ocean", "a rainy afternoon", "a lost key",
         "the first day of school", "a city at night", "an old lighthouse",
         "a robot learning to paint", "a cat who wants to fly", "a forgotten letter",
         "the last train home", "a garden in winter", "a dragon who is afraid of fire",
         "a message in a bottle", "a snowy mountain village", "a time traveler's mistake",
         "the smell of fresh bread", "a library after closing time", "the first human on Mars"),
        ("Write a short poem about {t}.", "Write a haiku about {t}.",
         "Write a very short story about {t}.", "Write a limerick about {t}.",
         "Describe {t} using all five senses.",
         "Write the opening paragraph of a novel about {t}.",
         "Write a short dialogue between two friends about {t}.",
         "Give me three creative writing prompts inspired by {t}."),
    ),
}
_STYLES = ("", " Keep it under 100 words.", " Use bullet points.", " Answer in three sentences.",
           " Be concise.")


def _chat_units() -> List[Unit]:
    result = []
    for kind, (topics, templates) in _CHAT.items():
        for topic in topics:
            prompts = [t.format(t=topic) + s for t in templates for s in _STYLES
                       if not (kind == "creative" and s == " Use bullet points.")]
            key = f"{kind}/{topic}"
            result.append(Unit(key, held_out("chat", key), _shuffled(prompts)))
    return result


# -- drawing and writing ---------------------------------------------------------------------

_UNITS = {"math": _math_units, "code": _code_units, "chat": _chat_units}


def units(category: str) -> List[Unit]:
    """The units of ``category`` in their fixed order, training and held-out ones."""
    return _UNITS[category]()


def _draw(pool: Sequence[Unit], n: int, seed: int, category: str, split: str) -> List[str]:
    """``n`` distinct prompts, round-robin over ``pool`` in a seeded order; a unit whose stream
    ends (or that keeps repeating itself) drops out."""
    order = list(pool)
    random.Random(f"{seed}/{category}/{split}/order").shuffle(order)
    streams = [u.stream(random.Random(f"{seed}/{category}/{split}/{u.key}")) for u in order]
    prompts: List[str] = []
    seen = set()
    while len(prompts) < n and streams:
        alive = []
        for stream in streams:
            if len(prompts) == n:
                alive.append(stream)
                break
            for _ in range(100):  # a generated template may repeat a prompt; retry a little
                prompt = next(stream, None)
                if prompt is None or prompt not in seen:
                    break
            if prompt is None or prompt in seen:
                continue
            seen.add(prompt)
            prompts.append(prompt)
            alive.append(stream)
        streams = alive
    if len(prompts) < n:
        raise ValueError(f"{category}: only {len(prompts)} distinct {split} prompts exist, "
                         f"{n} asked for")
    return prompts


def build(category: str, train: int, held_out_count: int, seed: int = 0
          ) -> Tuple[List[dict], List[dict]]:
    """The training and held-out rows of one category.

    Parameters
    ----------
    category : str
        One of :data:`CATEGORIES`.
    train, held_out_count : int
        Prompts in each set.
    seed : int
        Seeds the order of the units and each unit's stream; the split does not depend on it.

    Returns
    -------
    (list of dict, list of dict)
        Rows ``{"id", "category", "turns"}``, ids ``<category>-train-NNNNN`` and
        ``<category>-eval-NNNN``.

    Raises
    ------
    ValueError
        When a set asks for more distinct prompts than its units hold.
    RuntimeError
        When a held-out prompt is also a training prompt (the split rules out; checked anyway).
    """
    pool = units(category)
    train_prompts = _draw([u for u in pool if not u.held_out], train, seed, category, "train")
    eval_prompts = _draw([u for u in pool if u.held_out], held_out_count, seed, category, "eval")
    shared = set(train_prompts) & set(eval_prompts)
    if shared:
        raise RuntimeError(f"{category}: held-out prompts also in training: {sorted(shared)[:3]}")
    rows = ([{"id": f"{category}-train-{i:05d}", "category": category, "turns": [p]}
             for i, p in enumerate(train_prompts)],
            [{"id": f"{category}-eval-{i:04d}", "category": category, "turns": [p]}
             for i, p in enumerate(eval_prompts)])
    return rows


def _write_jsonl(path: str, rows: Sequence[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def write(out: str, *, train: int = 2000, held_out_count: int = 40, seed: int = 0,
          categories: Sequence[str] = CATEGORIES) -> Dict[str, str]:
    """Writes the prompt sets into ``out``.

    Parameters
    ----------
    out : str
        Directory, created if needed.
    train, held_out_count : int
        Prompts per category in the training file and in each held-out file.
    seed : int
        The same seed and sizes write byte-identical files.
    categories : sequence of str
        A subset of :data:`CATEGORIES`.

    Returns
    -------
    dict
        File role (``"train"``, ``"eval_<category>"``, ``"manifest"``) to path.
    """
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        raise ValueError(f"unknown categories {unknown}; choose from {list(CATEGORIES)}")
    os.makedirs(out, exist_ok=True)
    paths: Dict[str, str] = {}
    per_category: List[List[dict]] = []
    manifest = {"seed": seed, "train_per_category": train, "eval_per_category": held_out_count,
                "python": "{}.{}".format(*sys.version_info[:2]), "categories": {}}
    for category in categories:
        train_part, eval_part = build(category, train, held_out_count, seed)
        per_category.append(train_part)
        paths[f"eval_{category}"] = os.path.join(out, f"eval_{category}.jsonl")
        _write_jsonl(paths[f"eval_{category}"], eval_part)
        pool = units(category)
        manifest["categories"][category] = {
            "train_units": sum(not u.held_out for u in pool),
            "held_out_units": [u.key for u in pool if u.held_out],
            "eval_file": os.path.basename(paths[f"eval_{category}"])}
    # Categories interleaved, so that the first N training prompts are balanced.
    train_rows = [row for group in itertools.zip_longest(*per_category) for row in group
                  if row is not None]
    paths["train"] = os.path.join(out, "train.jsonl")
    _write_jsonl(paths["train"], train_rows)
    paths["manifest"] = os.path.join(out, "manifest.json")
    with open(paths["manifest"], "w", encoding="utf-8", newline="\n") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return paths


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dspark_ops.prompts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train-per-category", type=int, default=2000)
    parser.add_argument("--eval-per-category", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--categories", nargs="+", choices=CATEGORIES, default=list(CATEGORIES))
    args = parser.parse_args(argv)
    if args.train_per_category < 0 or args.eval_per_category < 0:
        raise SystemExit("sizes must be >= 0")
    try:
        paths = write(args.out, train=args.train_per_category,
                      held_out_count=args.eval_per_category, seed=args.seed,
                      categories=args.categories)
    except ValueError as error:
        raise SystemExit(str(error)) from error
    for role, path in paths.items():
        print(f"{role:12s} {path}")


if __name__ == "__main__":
    main()
