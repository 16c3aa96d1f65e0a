"""dspark_ops: fused CUDA/CPU kernels for DSpark-style speculative decoding.

Every op is a PyTorch custom op (``torch.ops.dspark_ops.*``) with a CPU and a CUDA kernel, a fake
implementation for ``torch.compile`` and a pure-PyTorch reference in :mod:`dspark_ops.reference`
(imported on first use: ``import dspark_ops.reference`` or ``dspark_ops.reference``).
"""

import importlib

from ._library import load_library

load_library()

from ._library import OPS  # noqa: E402  (the loaded library's ops, in csrc/schemas.h's order)

from .ops.attention import append_context_kv, block_draft_attention  # noqa: E402
from .ops.draft import (  # noqa: E402
    DraftOutput,
    draft_confidence,
    markov_draft,
    rnn_draft,
)
from .ops.loss import LossOutput, dspark_loss  # noqa: E402
from .ops.random import philox_uniform  # noqa: E402
from .ops.schedule import (  # noqa: E402
    VerifyBatch,
    allocate_verify,
    pack_verify_inputs,
    plan_verify_budget,
    schedule_verify,
)
from .ops.verify import VerifyOutput, verify  # noqa: E402
from .calibration import expected_calibration_error, fit_sequential_temperatures  # noqa: E402
from .profiling import profile_step_rate  # noqa: E402
from . import sampling  # noqa: E402
from .models import DSparkConfig, DSparkDraft, Eagle3Draft, load_draft  # noqa: E402,I001
from .decoder import GenerateOutput, RoundStats, SpeculativeDecoder, generate_target_only  # noqa: E402,I001
from .costs import CostTable, load_or_profile_costs, profile_costs  # noqa: E402
from .proposers import PromptLookupProposer  # noqa: E402

__all__ = [
    "OPS",
    "CostTable",
    "DSparkConfig",
    "DSparkDraft",
    "DraftOutput",
    "Eagle3Draft",
    "GenerateOutput",
    "LossOutput",
    "RoundStats",
    "SpeculativeDecoder",
    "VerifyBatch",
    "VerifyOutput",
    "allocate_verify",
    "append_context_kv",
    "block_draft_attention",
    "draft_confidence",
    "dspark_loss",
    "expected_calibration_error",
    "fit_sequential_temperatures",
    "generate_target_only",
    "load_draft",
    "markov_draft",
    "pack_verify_inputs",
    "philox_uniform",
    "plan_verify_budget",
    "load_or_profile_costs",
    "profile_costs",
    "profile_step_rate",
    "PromptLookupProposer",
    "reference",
    "rnn_draft",
    "sampling",
    "schedule_verify",
    "verify",
]
from ._version import __version__  # noqa: E402


def __getattr__(name):
    # The references are for tests, benchmarks and whoever asks: importing dspark_ops stays light.
    if name == "reference":
        return importlib.import_module(".reference", __name__)
    raise AttributeError(f"module 'dspark_ops' has no attribute {name!r}")
