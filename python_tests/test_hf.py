"""dspark_ops.hf and the generate / eval commands on tiny random transformers models (no
downloads): greedy output identical to the model's own generate(do_sample=False), sampled output
distributed as the model's own sampling (chi-square), DeepSpec's feature convention, checkpoints
that transformers reads, and both commands end to end."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from dspark_ops import DSparkConfig, DSparkDraft, SpeculativeDecoder  # noqa: E402
from dspark_ops import decoder as decoder_module  # noqa: E402
from dspark_ops.decoder import default_step_rate, generate_target_only  # noqa: E402
from dspark_ops.hf import HFTarget  # noqa: E402
from stats import chi_square, chi_square_passes  # noqa: E402

VOCAB = 64
LAYERS = 4
FEATURES = (-1, 1, LAYERS - 1)  # the embedding output, a middle layer and the (raw) last layer
PROMPTS = [[3, 17, 5], [40, 2, 9, 11, 30, 7, 21], [12], [8, 50, 33, 4]]


def tiny_model(kind: str, *, vocab: int = VOCAB, layers: int = LAYERS, dtype=torch.float64,
               seed: int = 0, rope_theta: float = 10_000.0):
    """A random-initialised Qwen3 or Llama causal LM, weights spread enough (std 0.3) that its
    next-token distributions are far from uniform."""
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=None, eos_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    if kind == "qwen3":
        config = transformers.Qwen3Config(**common)
    else:
        config = transformers.LlamaConfig(**common)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()


@torch.no_grad()
def table_draft(target: HFTarget, sequences=(), *, head: str = "vanilla", block_size: int = 7,
                seed: int = 1) -> DSparkDraft:
    """A draft whose Markov (or RNN) head is a bigram table of ``sequences`` (e.g. the target's
    own greedy outputs): where a token has one successor there the draft is right, where it has
    several it is sometimes wrong, so both the accept and the reject paths run. The backbone is
    random and shares the target's embedding and LM head; ``head="dflash"``: no heads at all."""
    vocab = target.config.vocab_size
    rank = 0 if head == "dflash" else vocab
    config = DSparkConfig(
        vocab_size=vocab, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
        head_dim=64, intermediate_size=96, num_hidden_layers=1, target_layer_ids=FEATURES,
        target_hidden_size=64, block_size=block_size, mask_token_id=vocab - 1, markov_rank=rank,
        markov_head_type="rnn" if head == "rnn" else "vanilla",
        enable_confidence_head=head != "dflash", rope_theta=1e6)
    gen = torch.Generator().manual_seed(seed)
    draft = DSparkDraft(config)
    for p in draft.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model = target.model
    draft.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    draft.lm_head.weight.copy_(model.get_output_embeddings().weight)
    if head == "dflash":
        return draft
    counts = torch.zeros(vocab, vocab)
    for seq in sequences:
        for prev, nxt in zip(seq, seq[1:]):
            counts[prev, nxt] += 1
    share = counts / counts.sum(-1, keepdim=True).clamp_min(1)
    table = 8.0 * share + 0.3 * torch.randn(vocab, vocab, generator=gen)  # [prev, next] logits
    draft.norm.weight.zero_()  # h = 0: the base logits vanish and the head carries the draft
    draft.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
    if head == "rnn":  # o = 3 W1[x], so tanh(o) = tanh(3) one-hot(x)
        joint = draft.markov_head.joint_proj
        joint.weight[2 * vocab:] = 0.0
        joint.weight[2 * vocab:, vocab: 2 * vocab] = 3.0 * torch.eye(vocab)
        joint.bias[2 * vocab:] = 0.0
        table = table / torch.tanh(torch.tensor(3.0))
    draft.markov_head.markov_w2.weight.copy_(table.T)
    proj = draft.confidence_head.proj  # a confidence logit growing with the table's certainty
    proj.weight.zero_()
    proj.weight[0, 64:] = 6.0 * share.max(-1).values - 3.0
    proj.bias.zero_()
    return draft


@pytest.fixture(scope="module")
def qwen3():
    return HFTarget(tiny_model("qwen3"), FEATURES)


@pytest.fixture(scope="module")
def llama():
    return HFTarget(tiny_model("llama", seed=3), FEATURES)


@pytest.fixture(scope="module")
def hf_greedy(qwen3, llama):
    """The transformers model's own greedy output, one prompt at a time (no padding)."""
    results = {}
    for name, target in (("qwen3", qwen3), ("llama", llama)):
        rows = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = target.model.generate(ids, attention_mask=torch.ones_like(ids),
                                        do_sample=False, max_new_tokens=20, min_new_tokens=20)
            rows.append(out[0, len(prompt):].tolist())
        results[name] = rows
    return results


# --------------------------------------------------------------------------------------------
# Greedy: token for token the model's own generate


@pytest.mark.parametrize("scheduler", ["confidence", "budget", "fixed"])
@pytest.mark.parametrize("block", [1, 4, 7])
def test_greedy_equals_transformers_generate(qwen3, hf_greedy, scheduler, block):
    draft = table_draft(qwen3, [p + t for p, t in zip(PROMPTS, hf_greedy["qwen3"])])
    out = SpeculativeDecoder(qwen3, draft, block_size=block, scheduler=scheduler).generate(
        PROMPTS, 20)
    assert out.tokens == hf_greedy["qwen3"]
    accepted = sum(a for r in out.rounds for a in r.accepted)
    verified = sum(n for r in out.rounds for n in r.num_verify)
    assert 0 < accepted < verified  # both the accept and the reject paths ran


@pytest.mark.parametrize("model, head, block", [
    ("llama", "vanilla", 4), ("llama", "rnn", 7), ("qwen3", "rnn", 4), ("llama", "dflash", 4),
    ("qwen3", "dflash", 7)])
def test_greedy_equals_transformers_generate_other_heads_and_models(
        request, hf_greedy, model, head, block):
    target = request.getfixturevalue(model)
    draft = table_draft(target, [p + t for p, t in zip(PROMPTS, hf_greedy[model])], head=head)
    scheduler = "fixed" if head == "dflash" else "confidence"
    out = SpeculativeDecoder(target, draft, block_size=block, scheduler=scheduler).generate(
        PROMPTS, 20)
    assert out.tokens == hf_greedy[model]
    if head != "dflash":  # (a random DFlash backbone drafts nothing useful)
        assert len(out.rounds) < 15  # fewer target forwards than tokens: drafts were accepted
