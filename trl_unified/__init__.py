"""trl_unified: policy trainers on one shared PolicyTrainerBase(transformers.Trainer)."""

__version__ = "0.1.0"

from .core.config import PolicyConfig
from .core.logprobs import compute_token_logprobs, entropy_from_logits, selective_log_softmax
from .core.reference import ReferenceModel
from .core.trainer import PolicyTrainerBase
from .data.sft import SFTBatch, SFTCollator
from .evaluation.answers import answers_match, extract_answer
from .evaluation.judge import GRMReward
from .generation import (
    GenerationOptions,
    GenerationOutput,
    build_generation_config,
    generate_batched,
    unwrap_for_generation,
)
from .hub.papers import PAPERS
from .online.config import OnlineConfig
from .online.rewards import RewardFunctions
from .online.rollout import RolloutBatch
from .online.sampler import RepeatSampler
from .online.trainer import OnlineTrainer
from .preference.data import PairedBatch, PairedCollator, SequenceBatch, UnpairedBatch, UnpairedCollator
from .preference.trainer import PreferenceConfig, PreferenceTrainer, ReferencePreferenceConfig
from .trainers.a2po import A2POConfig, A2POTrainer
from .trainers.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer
from .trainers.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from .trainers.cpo import CPOConfig, CPOTrainer
from .trainers.distillation import DistillationConfig, DistillationTrainer
from .trainers.dpo import DPOConfig, DPOTrainer
from .trainers.gkd import GKDConfig, GKDTrainer
from .trainers.gmpo import GMPOConfig, GMPOTrainer
from .trainers.grm import GRMConfig, GRMTrainer
from .trainers.grpo import GRPOConfig, GRPOTrainer
from .trainers.iw_opd import IWOPDConfig, IWOPDTrainer
from .trainers.kto import KTOConfig, KTOTrainer
from .trainers.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from .trainers.orpo import ORPOConfig, ORPOTrainer
from .trainers.ppo import PPOConfig, PPOTrainer
from .trainers.rloo import RLOOConfig, RLOOTrainer, rloo_advantages
from .trainers.sdft import SDFTConfig, SDFTTrainer
from .trainers.sdpo import SDPOConfig, SDPOTrainer
from .trainers.server_distillation import ServerDistillationConfig, ServerDistillationTrainer
from .trainers.tpo import TPOConfig, TPOTrainer


__all__ = [
    "A2POConfig",
    "A2POTrainer",
    "AsyncDistillationConfig",
    "AsyncDistillationTrainer",
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AnswerAccuracy",
    "CPOConfig",
    "CPOTrainer",
    "DPOConfig",
    "DPOTrainer",
    "DistillationConfig",
    "DistillationTrainer",
    "GKDConfig",
    "GKDTrainer",
    "GMPOConfig",
    "GMPOTrainer",
    "GRMConfig",
    "GRMReward",
    "GRMTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "GenerationOptions",
    "GenerationOutput",
    "IWOPDConfig",
    "IWOPDTrainer",
    "KTOConfig",
    "OnlineDPOConfig",
    "OnlineDPOTrainer",
    "KTOTrainer",
    "OnlineConfig",
    "OnlineTrainer",
    "ORPOConfig",
    "ORPOTrainer",
    "PAPERS",
    "PPOConfig",
    "PPOTrainer",
    "PolicyConfig",
    "PairedBatch",
    "PairedCollator",
    "SFTBatch",
    "SFTCollator",
    "SequenceBatch",
    "UnpairedBatch",
    "UnpairedCollator",
    "PreferenceConfig",
    "PreferenceTrainer",
    "ReferencePreferenceConfig",
    "PolicyTrainerBase",
    "RLOOConfig",
    "SDFTConfig",
    "SDFTTrainer",
    "SDPOConfig",
    "SDPOTrainer",
    "ServerDistillationConfig",
    "ServerDistillationTrainer",
    "RLOOTrainer",
    "ReferenceModel",
    "RepeatSampler",
    "RewardFunctions",
    "RolloutBatch",
    "TPOConfig",
    "TPOTrainer",
    "answers_match",
    "build_generation_config",
    "compute_token_logprobs",
    "entropy_from_logits",
    "extract_answer",
    "generate_batched",
    "rloo_advantages",
    "selective_log_softmax",
    "unwrap_for_generation",
]


def __getattr__(name):
    if name == "AnswerAccuracy":  # built on first use: `evaluate` is slow to import
        from .evaluation import answers

        return answers.AnswerAccuracy
    raise AttributeError(f"module 'trl_unified' has no attribute {name!r}")
