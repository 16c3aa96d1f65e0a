"""The models built from this library's ops: the draft families and a tiny causal target.

- :mod:`.registry`: the draft families (Qwen3 and Gemma4 DSpark/DFlash, Eagle3), the one place
  that tells them apart, and :func:`load_draft`, which loads a checkpoint of any family;
- :mod:`.backbone`: the draft backbone's layers (attention over a context K/V cache, MLP, norms);
- :mod:`.draft`: :class:`DSparkDraft` (backbone, shared embedding and LM head, Markov / RNN and
  confidence heads; a DFlash draft without heads) and :func:`sample_base_logits`;
- :mod:`.config`: :class:`DSparkConfig`, DeepSpec's draft ``config.json`` read and written;
- :mod:`.gemma4`: :class:`Gemma4DSparkDraft` and :class:`Gemma4DSparkConfig`, DeepSpec's Gemma4
  DSpark and DFlash drafts;
- :mod:`.eagle3`: :class:`Eagle3Draft` and :class:`Eagle3Config`, DeepSpec's Eagle3 drafts (Qwen3
  and Gemma4);
- :mod:`.checkpoint`: ``.safetensors`` and state-dict files;
- :mod:`.target`: :class:`TinyTarget`, a Qwen3-style causal LM with a K/V cache, and
  :func:`forward_ragged`.

Nothing here imports outside :mod:`dspark_ops.models` and :mod:`dspark_ops.ops`.
"""

from .checkpoint import load_state_dict_file, save_safetensors
from .config import MARKOV_HEAD_TYPES, DSparkConfig  # noqa: F401 (public, not in __all__)
from .draft import ConfidenceHead, DSparkDraft, MarkovHead, sample_base_logits
from .eagle3 import Eagle3Config, Eagle3Draft
from .gemma4 import Gemma4DSparkConfig, Gemma4DSparkDraft
from .registry import load_draft
from .target import (  # noqa: F401 (TargetAttention, TargetLayer: public, not in __all__)
    TargetAttention, TargetConfig, TargetLayer, TinyTarget, forward_ragged,
)

__all__ = [
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkDraft",
    "Eagle3Config",
    "Eagle3Draft",
    "Gemma4DSparkConfig",
    "Gemma4DSparkDraft",
    "MarkovHead",
    "TargetConfig",
    "TinyTarget",
    "forward_ragged",
    "load_draft",
    "load_state_dict_file",
    "sample_base_logits",
    "save_safetensors",
]
