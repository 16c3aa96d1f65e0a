"""The models built from this library's ops: the DSpark draft and a tiny causal target.

- :mod:`.draft`: :class:`DSparkDraft` (backbone, shared embedding and LM head, Markov / RNN and
  confidence heads; a DFlash draft without heads) and :func:`sample_base_logits`;
- :mod:`.config`: :class:`DSparkConfig`, DeepSpec's draft ``config.json`` read and written;
- :mod:`.checkpoint`: ``.safetensors`` and state-dict files;
- :mod:`.target`: :class:`TinyTarget`, a Qwen3-style causal LM with a K/V cache, and
  :func:`forward_ragged`.

The draft backbone's layers (attention over a context K/V cache, MLP, norms) are in
:mod:`dspark_ops.modules`.
"""

from .checkpoint import load_state_dict_file, save_safetensors
from .config import MARKOV_HEAD_TYPES, DSparkConfig  # noqa: F401 (public, not in __all__)
from .draft import ConfidenceHead, DSparkDraft, MarkovHead, sample_base_logits
from .target import (  # noqa: F401 (TargetAttention, TargetLayer: public, not in __all__)
    TargetAttention, TargetConfig, TargetLayer, TinyTarget, forward_ragged,
)

__all__ = [
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkDraft",
    "MarkovHead",
    "TargetConfig",
    "TinyTarget",
    "forward_ragged",
    "load_state_dict_file",
    "sample_base_logits",
    "save_safetensors",
]
