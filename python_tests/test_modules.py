"""The draft-layer wiring in dspark_ops.models.backbone: ops against a dense computation of the same layer."""

from __future__ import annotations

import doctest

import torch

import dspark_ops.models.backbone as modules
from dspark_ops import reference
from dspark_ops.models.backbone import DraftBackbone, DraftConfig


def test_docstring_example_runs():
    result = doctest.testmod(modules, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def _config():
    return DraftConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       intermediate_size=256, num_hidden_layers=2, target_layer_ids=(0, 2))


def test_backbone_matches_the_reference_ops(monkeypatch):
    # The same module run through the kernels and through the references (explicit masks): the
    # wiring (projection, per-layer K/V, RoPE positions, slots) is what is compared.
    torch.manual_seed(0)
    config = _config()
    draft = DraftBackbone(config).eval()
    batch, block, length = 3, 4, 40
    features = torch.randn(batch, 12, 2 * config.hidden_size)
    num_new = torch.tensor([12, 5, 0], dtype=torch.int32)
    hidden = torch.randn(batch, block, config.hidden_size)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)

    def run():
        k_caches, v_caches = draft.new_caches(batch, length)
        seqlens = torch.zeros(batch, dtype=torch.int32)
        with torch.no_grad():
            draft.append_context(features, None, num_new, k_caches, v_caches, seqlens,
                                 cache_slot=slots)
            out = draft(hidden, None, k_caches, v_caches, seqlens, cache_slot=slots)
        return out, seqlens, k_caches

    got, seqlens, k_caches = run()
    assert seqlens.tolist() == [12, 5, 0]

    def reference_attention(*args, return_lse=False, **kwargs):
        out, lse = reference.block_draft_attention(*args, **kwargs)
        return (out, lse) if return_lse else out

    monkeypatch.setattr(modules, "block_draft_attention", reference_attention)
    monkeypatch.setattr(modules, "append_context_kv", reference.append_context_kv)
    want, want_seqlens, want_caches = run()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(seqlens, want_seqlens)
    for a, b in zip(k_caches, want_caches):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_block_keys_never_reach_the_cache():
    torch.manual_seed(1)
    config = _config()
    draft = DraftBackbone(config).eval()
    k_caches, v_caches = draft.new_caches(2, 16)
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    before = [c.clone() for c in k_caches + v_caches]
    with torch.no_grad():
        draft(torch.randn(2, 5, config.hidden_size), None, k_caches, v_caches, seqlens)
    assert all(torch.equal(a, b) for a, b in zip(k_caches + v_caches, before))
    assert seqlens.tolist() == [3, 7]
