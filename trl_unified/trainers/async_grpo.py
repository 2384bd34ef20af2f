r"""Asynchronous GRPO: generation overlapping training, a drop-in for TRL 1.16's
`trl.experimental.async_grpo.AsyncGRPOTrainer` on the online core's asynchronous rollouts (`online/async_rollouts.py`,
docs/async.md): a vLLM server samples up to `max_staleness` optimiser steps ahead while the trainer trains, weights
synced every `weight_sync_steps`. DeepSeekMath's GRPO (Shao et al., 2024, arXiv:2402.03300) with TRL's async loss.

Advantages, per prompt group of G completions (r: the rewards summed over functions; NaN = no function scored it):

    A_i = (r_i - mean_j r_j) / (std_j r_j + 1e-8)        over the group's scored completions, population std (ddof 0)

and 0 for an unscored completion. With π_old the sampling engine's log-probs of the sampled tokens (the policy that
sampled them, up to `max_staleness` steps behind), w_t = π_θ(y_t) / π_old(y_t) per token and eps_high defaulting to
eps, the loss of a micro-batch of M tokens on each of P processes (N = sum over processes) is

    L = sum_{i,t in M} -min(w_t A_i, clip(w_t, 1 - eps, 1 + eps_high) A_i) / max(N / P, 1) / GA

(gradients averaged over processes then give the token mean over the micro-batch of every process; TRL 1.16's). No KL
term. Beyond TRL, `vllm_importance_sampling_correction=True` recomputes π_old under the weights that consume the batch
(AReaL's decoupled PPO, arXiv:2505.24298) and multiplies the loss by vLLM's importance-sampling ratio
π_old / π_sampling (`online/importance_sampling.py`), which then covers both the engine mismatch and the staleness.
"""

from dataclasses import dataclass

import torch

from ..core.config import document_fields, option
from ..hub.papers import PAPERS
from ..online.config import OnlineConfig
from ..online.importance_sampling import ImportanceSamplingConfig, ImportanceSamplingMixin
from ..online.rollout import RolloutBatch, RolloutPlan
from ..online.trainer import OnlineTrainer


@document_fields
@dataclass
class AsyncGRPOConfig(ImportanceSamplingConfig, OnlineConfig):
    """Configuration of `AsyncGRPOTrainer`: every field of TRL 1.16's `AsyncGRPOConfig` with its name and default; the
    online core's other fields are trl_unified's (asynchronous rollouts on, a vLLM server)."""

    _unimplemented_fields = {
        **OnlineConfig._unimplemented_fields,
        "token_budget": "Micro-batches hold per_device_train_batch_size completions (TRL's fixed-count batching).",
        "fork_threshold_tokens": "The tool loop continues on the sampled token ids and never re-tokenises a turn, "
        "so no drift arises to fork on.",
    }

    learning_rate: float = option(1e-6, "Initial AdamW learning rate.")
    lr_scheduler_type: str = option("constant", "Learning-rate schedule (TRL's async default: constant).")
    logging_steps: float = option(1, "Log every X optimiser steps.")
    ignore_data_skip: bool = option(
        True, "TRL's default. A resume continues from the first prompt not yet trained on, whatever its value."
    )
    remove_unused_columns: bool | None = option(
        True, "TRL's default. Every dataset column still reaches the reward functions, as in TRL's trainer."
    )
    max_completion_length: int | None = option(2048, "Maximum length of the generated completion.")
    dtype: str = option("float32", "dtype the policy is loaded in; a `dtype` in model_init_kwargs wins.")
    fork_threshold_tokens: int = option(1024, "TRL's multi-turn re-tokenisation threshold (not needed here).")
    token_budget: int | None = option(None, "TRL's tokens per packed row (not implemented: fixed-count batches).")
    use_vllm: bool = option(True, "Generate with a vLLM server (the only engine that runs beside training).")
    vllm_mode: str = option("server", "A separately started vLLM server (docs/async.md).")
    vllm_server_base_url: str | None = option("http://localhost:8000", "Base URL of the vLLM server.")
    async_rollouts: bool = option(True, "Sample ahead of training (always on for AsyncGRPOTrainer).")
    max_staleness: int = option(4, "Most optimiser steps between the weights that sampled and training.")
    vllm_importance_sampling_correction: bool = option(
        False,
        "trl_unified only. Recompute π_old when a batch is consumed and correct the loss by π_old / π_sampling "
        "(engine mismatch and staleness; TRL's async loss uses π_sampling as π_old).",
    )

    def __post_init__(self):
        if not (self.use_vllm and self.async_rollouts):
            raise ValueError(
                "AsyncGRPOTrainer samples from a vLLM server ahead of training: use_vllm and async_rollouts must "
                "stay True (max_staleness=0 trains synchronously; GRPOTrainer trains without a server)."
            )
        super().__post_init__()
        self.check_importance_sampling()
        self.ignore_data_skip = False  # the Trainer skips the batches already trained on (TRL: its own position)


class AsyncGRPOTrainer(ImportanceSamplingMixin, OnlineTrainer):
    """Asynchronous GRPO (see the module docstring). TRL 1.16's constructor, plus the online core's arguments."""

    _name = "AsyncGRPO"
    _tag_names = ["trl", "async-grpo", "trl_unified"]
    _paper = PAPERS["grpo"]
    config_class = AsyncGRPOConfig
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AsyncGRPOConfig | None = None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        tools=None,
        environment_factory=None,
        rollout_worker=None,
        weight_transfer=None,
        **online_kwargs,
    ):
        """TRL 1.16's arguments, then by keyword the online core's (`eval_dataset`, `reward_processing_classes`,
        `quantization_config`, `rollout_func`, `ref_model`)."""
        if rollout_worker is not None or weight_transfer is not None:
            raise NotImplementedError(
                "rollout_worker / weight_transfer replace parts of TRL's worker process; here sampling is the online "
                "core's producer thread (customise it with rollout_func=) and weights reach the server as "
                "vllm_weight_transfer says ('checkpoint' or 'nccl')."
            )
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
            **online_kwargs,
        )

    epsilon_low = property(lambda self: self.args.epsilon)  # TRL's attributes
    model_version = property(lambda self: self.vllm_engine.version or 0)

    epsilon_high = property(lambda s: s.args.epsilon if s.args.epsilon_high is None else s.args.epsilon_high)

    def _load_policy(self, model, args, quantization_config):
        if isinstance(model, str):  # TRL's `dtype` field, unless model_init_kwargs names one
            args.model_init_kwargs = {"dtype": args.dtype, **(args.model_init_kwargs or {})}
        return super()._load_policy(model, args, quantization_config)

    def _remove_unused_columns(self, dataset, description=None):
        return dataset  # every column reaches the reward functions, as in TRL's trainer

    def rollout_plan(self) -> RolloutPlan:
        """TRL's: π_old is the engine's sampling log-probs; with the correction, recomputed in both modes."""
        if self.corrects_sampling:
            return super().rollout_plan()
        return RolloutPlan(old_logps_train=False, old_logps_eval=False)

    def compute_advantages(self, rewards, rewards_per_func, batch: RolloutBatch, mode: str) -> torch.Tensor:
        grouped = rewards.view(-1, self.group_size(mode))  # (P, G)
        mean = torch.nanmean(grouped, dim=1, keepdim=True)
        std = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True).sqrt()  # population std, as TRL
        return torch.nan_to_num((grouped - mean) / (std + 1e-8), nan=0.0).view(-1)

    def compute_policy_loss(self, model, inputs: RolloutBatch, num_items_in_batch=None):
        mask = inputs.loss_mask.bool()
        out = self.policy_logprobs(model, inputs)
        old = inputs.old_logps if inputs.old_logps is not None else inputs.sampling_logps
        current = out.logps.detach()
        old = current if old is None else torch.where(torch.isnan(old), current, old)  # none from the engine: w = 1
        log_ratio = torch.where(mask, out.logps - old, 0.0)  # (B, C)
        ratio, advantages = torch.exp(log_ratio), inputs.advantages.unsqueeze(1)
        low, high = self.args.clip_range()
        per_token = -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages)
        if inputs.importance_sampling_ratio is not None:
            per_token = per_token * inputs.importance_sampling_ratio
        tokens = self.accelerator.reduce(mask.sum().float(), reduction="sum")  # N: the micro-batch, all processes
        accumulation = self.current_gradient_accumulation_steps if self.model.training else 1
        loss = (per_token * mask).sum() / (tokens / self.accelerator.num_processes).clamp(min=1.0) / accumulation
        loss = self.add_aux_loss(loss, out.aux_loss, scale=1.0 / accumulation)
        for name, value in (("ratio", ratio), ("kl", (ratio - 1) - log_ratio), ("entropy", out.entropy)):
            self.log_metric(name, self.masked_global_mean(value.detach(), mask))
        self.log_clip_ratios(ratio.detach(), advantages, mask, low, high)
        return loss
