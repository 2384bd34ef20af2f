"""trl_unified: policy trainers on one shared PolicyTrainerBase(transformers.Trainer)."""

__version__ = "0.1.0"

from .base.answers import answers_match, extract_answer
from .base.config import PolicyConfig
from .base.data import RepeatSampler
from .base.generation import GenerationOutput, build_generation_config, generate_batched, unwrap_for_generation
from .base.judge import GRMReward
from .base.logprobs import compute_token_logprobs, entropy_from_logits, selective_log_softmax
from .base.online import OnlineTrainer
from .base.online_config import OnlineConfig
from .base.papers import PAPERS
from .base.preference import PreferenceConfig, PreferenceTrainer
from .base.preference_data import PairedBatch, PairedCollator, SequenceBatch, UnpairedBatch, UnpairedCollator
from .base.reference import ReferenceModel
from .base.rewards import RewardFunctions
from .base.rollout import RolloutBatch
from .base.sft_data import SFTBatch, SFTCollator
from .base.trainer import PolicyTrainerBase
from .trainers.dpo import DPOConfig, DPOTrainer
from .trainers.grm import GRMConfig, GRMTrainer
from .trainers.grpo import GRPOConfig, GRPOTrainer
from .trainers.kto import KTOConfig, KTOTrainer
from .trainers.ppo import PPOConfig, PPOTrainer
from .trainers.rloo import RLOOConfig, RLOOTrainer, rloo_advantages


__all__ = [
    "AnswerAccuracy",
    "DPOConfig",
    "DPOTrainer",
    "GRMConfig",
    "GRMReward",
    "GRMTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "GenerationOutput",
    "KTOConfig",
    "KTOTrainer",
    "OnlineConfig",
    "OnlineTrainer",
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
    "PolicyTrainerBase",
    "RLOOConfig",
    "RLOOTrainer",
    "ReferenceModel",
    "RepeatSampler",
    "RewardFunctions",
    "RolloutBatch",
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
        from .base import answers

        return answers.AnswerAccuracy
    raise AttributeError(f"module 'trl_unified' has no attribute {name!r}")
