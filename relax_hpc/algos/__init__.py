"""Advantages and policy losses as pure tensor functions (GRPO, Dr.GRPO, GSPO, SAPO, OPD, KL, TIS).

Nothing here does I/O or imports other relax_hpc packages; backends call
``token_logprobs_and_entropy`` (or, with tensor parallelism,
``vocab_parallel_logprobs_and_entropy``, whose only side effects are its
collectives) and ``policy_loss``, the Advantages role calls
``group_advantages`` / ``opd_advantages``. See docs/algorithms.md.
"""

from relax_hpc.algos.advantages import (
    broadcast_advantages,
    group_advantages,
    normalizes_std,
    opd_advantages,
)
from relax_hpc.algos.aggregation import LOSS_AGG_MODES, aggregate
from relax_hpc.algos.kl import KL_ESTIMATORS, kl_penalty
from relax_hpc.algos.logprobs import token_logprobs_and_entropy
from relax_hpc.algos.loss_types import LossInputs, LossSettings, PolicyLossFn, PolicyTerms
from relax_hpc.algos.losses import (
    POLICY_LOSSES,
    available_losses,
    get_policy_loss,
    loss_config_problems,
    policy_loss,
    tis_weight,
)
from relax_hpc.algos.vocab_parallel import vocab_parallel_logprobs_and_entropy

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "LossInputs",
    "LossSettings",
    "PolicyLossFn",
    "PolicyTerms",
    "aggregate",
    "available_losses",
    "broadcast_advantages",
    "get_policy_loss",
    "group_advantages",
    "kl_penalty",
    "loss_config_problems",
    "normalizes_std",
    "opd_advantages",
    "policy_loss",
    "tis_weight",
    "token_logprobs_and_entropy",
    "vocab_parallel_logprobs_and_entropy",
]
