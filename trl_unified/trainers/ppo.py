r"""PPO with a learned value model (Schulman et al., 2017, arXiv:1707.06347) for RLHF (Ziegler et al., 2019,
arXiv:1909.08593): a drop-in for TRL 1.12's `trl.experimental.ppo.PPOTrainer` (gone from TRL since 1.13).

A rollout samples one completion per prompt and builds per-token rewards `-kl_coef · KL_t` (k1/k3) plus the score
after the last token (minus `missing_eos_penalty` without EOS), GAE advantages `A_t` (γ = `gamma`, λ = `lam`) from
the critic's values `V_t`, whitened, and returns `R_t = A_t + V_t` (formulas: `online/critic.py`). Then
`num_ppo_epochs` passes of `num_mini_batches` shuffled mini-batches, one optimiser step each, minimise (ρ_t =
π_θ / π_old per token, M = completion tokens, M1 = M and the score position, means over a micro-batch's tokens):

    L = mean_M max(-A_t ρ_t, -A_t clip(ρ_t, 1 ± cliprange))
        + vf_coef · 1/2 mean_M1 max((V_t - R_t)², (clip(V_t, V_old ± cliprange_value) - R_t)²)
"""

import time
from dataclasses import dataclass
from typing import Literal

import torch

from ..core.config import document_fields, option
from ..generation.transformers_generate import batch_generation
from ..models.loading import get_tokenizer
from ..online.completion_log import sample_generations
from ..online.config import OnlineConfig
from ..online.critic import (
    CriticMixin,
    clipped_value_loss,
    kl_per_token,
    masked_mean,
    masked_var,
    masked_whiten,
    per_token_rewards,
    rlhf_objective_metrics,
    value_mask,
)
from ..online.rewards import TokenIdsRewardModel, as_list
from ..online.rollout import RolloutBatch, RolloutPlan
from ..online.trainer import OnlineTrainer


# TRL 1.12's PPO module (`trl.experimental.ppo.ppo_trainer`) exports these too: its users import them from here
__all__ = ["PPOConfig", "PPOTrainer", "batch_generation", "masked_mean", "masked_var", "masked_whiten"]


@document_fields
@dataclass
class PPOConfig(OnlineConfig):
    """Configuration of `PPOTrainer`: every field of TRL 1.12's `PPOConfig` with its name and default (the derived
    batch sizes are computed here), plus the online core's fields (reward functions, conversational prompts)."""

    _unimplemented_fields = {
        **OnlineConfig._unimplemented_fields,
        "beta": "PPO's KL coefficient is `kl_coef`.",
        "padding_free": "The value head reads the policy's padded hidden states in the same forward.",
    }
    _min_num_generations = 1

    learning_rate: float = option(3e-6, "The initial learning rate for AdamW.")
    padding_free: bool | None = option(False, "Padded rows only (see _unimplemented_fields).")
    num_generations: int | None = option(1, "Completions sampled per prompt (trl_unified addition; TRL samples 1).")
    temperature: float = option(0.7, "Sampling temperature.")
    max_completion_length: int | None = option(None, "Alias of response_length, TRL's PPO name, which wins.")
    dataset_num_proc: int | None = option(None, "Number of processes to use for processing the dataset.")
    num_mini_batches: int = option(1, "Number of minibatches to split a batch into.")
    total_episodes: int | None = option(None, "Total episodes (rollouts). None: num_train_epochs * len(dataset).")
    local_rollout_forward_batch_size: int = option(64, "Per rank no grad forward pass in the rollout phase.")
    num_sample_generations: int = option(10, "Number of `generate_completions` calls throughout training.")
    response_length: int = option(53, "Length of the response.")
    stop_token: Literal["eos"] | None = option(None, "Stop generating at the EOS token ('eos'); exclusive with id.")
    stop_token_id: int | None = option(None, "Stop token id; None (and no stop_token): never stop early.")
    missing_eos_penalty: float | None = option(None, "Subtracted from the score of a completion without EOS.")
    sft_model_path: str = option("EleutherAI/pythia-160m", "Path to the SFT model (read by scripts).")
    reward_model_path: str = option("EleutherAI/pythia-160m", "Path to the reward model (read by scripts).")
    num_total_batches: int | None = option(None, "Number of rollouts to train (derived).")
    micro_batch_size: int | None = option(None, "per_device_train_batch_size * world_size. (derived)")
    local_batch_size: int | None = option(None, "per_device_train_batch_size * grad. accumulation. (derived)")
    batch_size: int | None = option(None, "local_batch_size * world_size. (derived)")
    local_mini_batch_size: int | None = option(None, "Mini batch size per process. (derived)")
    mini_batch_size: int | None = option(None, "Mini batch size across processes. (derived)")
    model_adapter_name: str | None = option(None, "Name of the trained LoRA adapter (not implemented: one adapter).")
    ref_adapter_name: str | None = option(None, "Name of the reference LoRA adapter (not implemented).")
    num_ppo_epochs: int = option(4, "Number of epochs to train.")
    whiten_rewards: bool = option(False, "Whether to whiten the rewards.")
    kl_coef: float = option(0.05, "KL coefficient.")
    kl_estimator: Literal["k1", "k3"] = option("k1", "KL estimator: 'k1' (unbiased) or 'k3' (lower variance).")
    cliprange: float = option(0.2, "Clip range.")
    vf_coef: float = option(0.1, "Value function coefficient.")
    cliprange_value: float = option(0.2, "Clip range for the value function.")
    gamma: float = option(1.0, "Discount factor.")
    lam: float = option(0.95, "Lambda value for GAE.")
    save_value_model: bool = option(False, "trl_unified only. Save the value model too (<output_dir>/value_model).")

    def __post_init__(self):
        if self.max_completion_length not in (None, self.response_length):
            raise ValueError(
                f"max_completion_length={self.max_completion_length} and response_length={self.response_length} "
                "disagree; PPO's length is response_length (TRL's name): set that one."
            )
        self.max_completion_length = self.response_length
        if self.stop_token and self.stop_token_id:
            raise ValueError("You cannot set both `stop_token` and `stop_token_id`.")
        if self.stop_token not in (None, "eos"):
            raise ValueError(f"Unknown `stop_token` {self.stop_token}. Allowed values are: `'eos'` and `None`.")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError("kl_estimator must be either 'k1' (straightforward, unbiased) or 'k3' (lower variance).")
        if self.model_adapter_name or self.ref_adapter_name:
            raise ValueError("model_adapter_name / ref_adapter_name: one LoRA adapter only; leave them None.")
        super().__post_init__()
        # TRL's batch arithmetic (docs/ppo.md): a rollout of `local_batch_size` rows per process, `num_ppo_epochs`
        # passes over it in `num_mini_batches` mini-batches, one optimiser step each (accumulation per mini-batch).
        accumulation, per_device = self.gradient_accumulation_steps, self.per_device_train_batch_size
        if self.num_mini_batches < 1 or accumulation % self.num_mini_batches:
            raise ValueError(
                f"num_mini_batches={self.num_mini_batches} must divide gradient_accumulation_steps={accumulation}: a "
                "mini-batch is one optimiser step over whole micro-batches of per_device_train_batch_size rows. For "
                "smaller mini-batches lower per_device_train_batch_size and raise gradient_accumulation_steps."
            )
        self.local_batch_size, self.micro_batch_size = per_device * accumulation, per_device * self.world_size
        self.batch_size = self.local_batch_size * self.world_size
        self.local_mini_batch_size = self.local_batch_size // self.num_mini_batches
        self.mini_batch_size = self.batch_size // self.num_mini_batches
        if self.whiten_rewards and self.local_mini_batch_size < 8:
            raise ValueError(f"whiten_rewards needs >= 8 rows per mini-batch; got {self.local_mini_batch_size}.")
        self.num_iterations = self.num_ppo_epochs
        self.gradient_accumulation_steps = accumulation // self.num_mini_batches
        if self.total_episodes is not None and self.max_steps <= 0:
            self.set_total_episodes(self.total_episodes)

    def uses_reference_model(self) -> bool:
        return True  # the KL penalty and objective/kl are always computed, as TRL does

    def set_total_episodes(self, episodes: int) -> None:
        """TRL's length of a run: `episodes` prompts, in rollouts of `batch_size`, each `num_ppo_epochs` passes of
        `num_mini_batches` optimiser steps."""
        self.total_episodes, self.num_total_batches = episodes, -(-episodes // self.batch_size)
        self.max_steps = self.num_total_batches * self.num_ppo_epochs * self.num_mini_batches


class PPOTrainer(CriticMixin, OnlineTrainer):
    """PPO with a value model (see the module docstring). TRL 1.12's constructor, plus the online core's arguments."""

    _name = "PPO"
    config_class = PPOConfig
    loss_is_scaled_for_ga = False  # per-micro-batch token means: the Trainer divides by the micro-batches
    old_logps_from_sampling = True  # TRL's PPO reads them from generation's logits: no extra policy forward
    reshuffle_each_iteration = True  # each PPO epoch draws new mini-batches
    positions_from_mask = True  # position ids skip left padding in every forward, as in generation (TRL's PPO)

    def __init__(
        self,
        args: PPOConfig | None,
        processing_class,
        model,
        ref_model=None,
        reward_model=None,
        train_dataset=None,
        value_model=None,
        data_collator=None,
        eval_dataset=None,
        optimizers=(None, None),
        callbacks=None,
        peft_config=None,
        **online_kwargs,
    ):
        """TRL 1.12's arguments, then, by keyword, the online core's: `reward_funcs`, `reward_processing_classes`,
        `quantization_config`, `tools`, `rollout_func`, `environment_factory`."""
        no_reward = reward_model is None and not online_kwargs.get("reward_funcs")
        for problem, message in (
            (data_collator is not None, "data_collator is not used by PPOTrainer: the rollout pads the prompts."),
            (ref_model is not None and ref_model is model, "`model` and `ref_model` cannot be the same object."),
            (value_model is None, "value_model is required: a sequence classifier with num_labels=1 (the critic)."),
            (
                no_reward and "environment_factory" not in online_kwargs,
                "No reward source provided. Pass `reward_model` (TRL's PPO), `reward_funcs`, or an environment.",
            ),
        ):
            if problem:
                raise ValueError(message)
        self._value_source, self._reward_model = value_model, reward_model
        super().__init__(
            model,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            ref_model=ref_model,
            **online_kwargs,
        )

    def prepare_dataset(self, dataset, name):
        names = getattr(dataset, "column_names", None) or []
        if "input_ids" in names and "prompt" not in names:  # TRL's PPO data: tokenised prompts
            dataset = dataset.rename_column("input_ids", "prompt")
        return super().prepare_dataset(dataset, name)

    def setup(self) -> None:
        if self._reward_model is not None:  # TRL's reward model: a scorer of the policy's token ids
            funcs, classes = self._reward_sources
            scorer = TokenIdsRewardModel.build(self._reward_model, self.model, self.processing_class, self.accelerator)
            if classes is not None:
                classes = [*classes, None]  # the scorer reads token ids: no processing class of its own
            self._reward_sources = ([*as_list(funcs), scorer], classes)
        super().setup()
        self.attach_critic(self._value_source)
        args, stop = self.args, self.args.stop_token_id
        self.eos_token_ids = [get_tokenizer(self.processing_class).eos_token_id] if args.stop_token else []
        self.eos_token_ids += [stop] if stop is not None else []  # neither: every completion is response_length long
        if args.total_episodes is None and args.max_steps <= 0:  # TRL: episodes = epochs over the data
            args.set_total_episodes(int(args.num_train_epochs * len(self.train_dataset)))
        samples, rollouts = args.num_sample_generations, args.num_total_batches or args.max_steps
        self._sample_every = max(1, rollouts // samples) if samples > 0 else 0  # rollouts between sample tables
        self._start_time = time.time()

    def rollout_plan(self) -> RolloutPlan:
        # π_old anchors the ratio and the KL penalty, in both modes
        return RolloutPlan(old_logps_train=True, old_logps_eval=True)

    def optimizer_steps_per_rollout(self) -> int:
        return self.args.num_ppo_epochs * self.args.num_mini_batches  # the learning rate moves once per rollout

    # ------------------------------------------------------------------ per-token rewards and GAE
    def assign_advantages(self, rewards, rewards_per_func, batch: RolloutBatch, mode: str):
        args, mask = self.args, batch.loss_mask.float()
        eos = get_tokenizer(self.processing_class).eos_token_id
        eos_tokens = (batch.completion_ids == eos) & batch.completion_mask.bool()  # TRL penalises a missing EOS
        scores = batch.rewards.nan_to_num(0.0) - (args.missing_eos_penalty or 0.0) * (~eos_tokens.any(1)).float()
        kl = kl_per_token(batch.old_logps, batch.ref_logps, args.kl_estimator) * mask  # (B, C)
        token_rewards, non_score = per_token_rewards(scores, kl, args.kl_coef, batch.completion_mask)
        if args.whiten_rewards:
            v_mask = value_mask(batch.completion_mask).float()
            token_rewards = masked_whiten(token_rewards, v_mask, shift_mean=False) * v_mask
        chunk = args.local_rollout_forward_batch_size
        self.critic_advantages(batch, token_rewards, args.gamma, args.lam, chunk)  # values, returns, advantages
        for name, value in rlhf_objective_metrics(kl, non_score, scores, batch.old_logps, mask).items():
            self.log_metric(name, self.accelerator.gather_for_metrics(value).mean().item())
        self.log_metric("val/num_eos_tokens", eos_tokens.sum())
        if mode == "train":
            update = self._step // (args.steps_per_generation * args.num_iterations)  # this rollout, from 0
            self.log_metric("episode", (update + 1) * args.batch_size)
            self.log_metric("eps", int((update + 1) * args.batch_size / max(time.time() - self._start_time, 1e-9)))
            if self._sample_every and update % self._sample_every == 0:
                self.generate_completions(sampling=True)

    # ------------------------------------------------------------------ loss
    def compute_policy_loss(self, model, inputs: RolloutBatch, num_items_in_batch=None):
        args, mask = self.args, inputs.loss_mask.float()
        v_mask = value_mask(inputs.completion_mask).float()
        input_ids, attention_mask, extra = inputs.model_inputs()
        self.value_head.request_values(mask.size(1))  # the critic runs inside the policy's (DDP) forward
        out = self.token_logprobs(
            model, input_ids, attention_mask, mask.size(1), compute_entropy=True, score_padding=True, **extra
        )  # TRL averages entropy over padding
        log_ratio = (out.logps - inputs.old_logps) * mask  # 0 on padding, as TRL's constant fill gives
        ratio = torch.exp(log_ratio)
        pg_losses = -inputs.advantages * ratio
        pg_losses2 = -inputs.advantages * ratio.clamp(1 - args.cliprange, 1 + args.cliprange)
        pg_loss = masked_mean(torch.max(pg_losses, pg_losses2), mask)
        values = self.value_head.take_values() * v_mask
        vf_loss, vf_clipfrac = clipped_value_loss(values, inputs.values, inputs.returns, args.cliprange_value, v_mask)
        with torch.no_grad():
            self.log_metric("policy/approxkl_avg", (0.5 * (log_ratio**2).mean()).item())
            self.log_metric("policy/clipfrac_avg", masked_mean((pg_losses2 > pg_losses).float(), mask).item())
            self.log_metric("loss/policy_avg", pg_loss.item())
            self.log_metric("loss/value_avg", vf_loss.item())
            self.log_metric("val/clipfrac_avg", vf_clipfrac.item())
            self.log_metric("policy/entropy_avg", out.entropy.mean().item())
            self.log_metric("val/ratio", ratio.mean().item())
        return pg_loss + args.vf_coef * vf_loss

    generate_completions = sample_generations  # TRL 1.12's method (online/completion_log.py)

    def log(self, logs, start_time=None):
        ratios = self._metrics[self.mode].get("val/ratio", [])
        if ratios:  # TRL's PPO: the variance of the logged ratios over the logging window
            logs["val/ratio_var"] = float(torch.tensor(ratios).var()) if len(ratios) > 1 else 0.0
        if "learning_rate" in logs:
            logs["lr"] = logs["learning_rate"]  # TRL's PPO name
        super().log(logs, start_time)
