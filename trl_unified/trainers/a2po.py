r"""A*-PO (Optimal Advantage Regression), Brantley et al., 2025, "Accelerating RL for LLM Reasoning with Optimal
Advantage Regression" (arXiv:2505.20686): a drop-in for TRL 1.16's `trl.experimental.a2po.A2POTrainer` on the online
core. Two stages:

1. **Value estimation, once, before training** (`before_training`): for every train and eval prompt x, n =
   `num_value_samples` completions of the reference policy π_ref (the starting policy), their rewards r_1..r_n, and

       V*(x) = β₁ log((1/n) Σ_j exp(r_j / β₁))          (β₁ = `beta1`; a soft maximum of the rewards)

   sampled on the trainer's generation engine (lean decoding, or vLLM), with a progress bar, and saved with every
   checkpoint (a resumed run reads it back instead of sampling again). With `filter_all_incorrect`, prompts whose n
   rewards are all 0 are dropped from the training set.
2. **On-policy regression**: one completion y per prompt from π_θ, its reward r (the weighted sum of the reward
   functions, assumed binary), the advantage A = r - V*(x), and the squared regression of the implicit reward onto
   it, with sequence log-probs summed over the completion tokens:

       L = (1/B) Σ_i (β₂ log(π_θ(y_i|x_i) / π_ref(y_i|x_i)) - A_i)²          (β₂ = `beta2`)

   (the Trainer divides L by the gradient-accumulation steps). Logged as TRL: reward, v_star, implicit_reward,
   advantage (means).
"""

import math
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from trl import maybe_apply_chat_template

from ..core.config import document_fields, option
from ..online.config import OnlineConfig
from ..online.rollout import RolloutBatch, RolloutPlan
from ..online.trainer import OnlineTrainer


@document_fields
@dataclass
class A2POConfig(OnlineConfig):
    """Configuration of `A2POTrainer`: every field of `trl.experimental.a2po.A2POConfig` 1.16, same names and
    defaults; the sampling, vLLM and logging fields are the online core's."""

    _min_num_generations = 1
    _inapplicable_fields = ("beta", "num_iterations", "epsilon", "epsilon_high")
    _inapplicable_reason = "A*-PO (no ratio or clipping; its KL temperatures are beta1 and beta2)"

    learning_rate: float = option(5e-5, "Initial AdamW learning rate (TRL's A2POConfig keeps transformers' default).")
    max_prompt_length: int | None = option(512, "Prompt tokens kept, the last ones (None: all).")
    max_completion_length: int | None = option(256, "Maximum length of each generated completion.")
    top_k: int | None = option(None, "Keep only the top_k most likely tokens when sampling. None disables it.")
    num_generations: int | None = option(1, "Completions per prompt in training (A*-PO: one).")
    num_value_samples: int = option(8, "Completions of the reference policy per prompt that estimate V*.")
    beta1: float = option(0.5, "β₁: the temperature of V*'s soft maximum over the reference samples' rewards.")
    filter_all_incorrect: bool = option(True, "Drop training prompts whose reference samples all score 0.")
    beta2: float = option(0.001, "β₂: the scale of the implicit reward regressed onto the advantage.")

    def __post_init__(self):
        super().__post_init__()
        if self.num_value_samples < 1 or self.beta1 <= 0:
            raise ValueError(
                f"num_value_samples={self.num_value_samples} must be >= 1 and beta1={self.beta1} > 0 (V* is a "
                "soft maximum over the reference samples' rewards at temperature beta1)."
            )

    def uses_reference_model(self) -> bool:
        return True  # π_ref samples V*'s estimate and anchors the implicit reward


@dataclass
class A2POBatch(RolloutBatch):
    """A `RolloutBatch` with each row's V* estimate `v_star` `(B,)`."""

    v_star: torch.Tensor | None = None


class A2POTrainer(OnlineTrainer):
    """A*-PO (see the module docstring). TRL 1.16's constructor, then by keyword the online core's arguments."""

    _name = "A2PO"
    config_class = A2POConfig
    batch_class = A2POBatch
    loss_is_scaled_for_ga = False  # a per-micro-batch mean: the Trainer divides it by the accumulation
    logprob_temperature = 1.0  # the policy's log-probs themselves (TRL's), not its sampling distribution's
    keeps_incomplete_rounds = True  # one completion per prompt: a last, smaller batch is trained on, as TRL's

    def __init__(
        self,
        model,
        reward_funcs,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        **online_kwargs,
    ):
        self._optimal_values = None  # TRL's attribute: V* by prompt text, once estimated
        self._all_incorrect = set()  # the prompts whose reference samples all scored 0
        super().__init__(
            model,
            reward_funcs,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **online_kwargs,
        )

    def rollout_plan(self) -> RolloutPlan:
        return RolloutPlan(old_logps_train=False, old_logps_eval=False)  # no ratio: π_old is never read

    def generation_options(self):
        return {**super().generation_options(), "max_prompt_length": self.args.max_prompt_length}

    # ------------------------------------------------------------------ stage 1: V*, once
    def before_training(self, checkpoint: str | None) -> None:
        saved = (self.checkpoint_state_of(checkpoint) or {}).get("trainer", {})
        if self._optimal_values is None and "optimal_values" in saved:
            self._optimal_values, self._all_incorrect = saved["optimal_values"], saved["all_incorrect"]
        if self._optimal_values is None:
            self._estimate_optimal_values()
        if self.args.filter_all_incorrect:
            dropped = self._all_incorrect
            self.train_dataset = self.train_dataset.filter(lambda row: self._prompt_key(row) not in dropped)

    def checkpoint_state(self) -> dict:
        return {"optimal_values": self._optimal_values, "all_incorrect": self._all_incorrect}

    def _prompt_key(self, row) -> str:
        """V*'s key of a row: its prompt as text (TRL's: the chat template applied)."""
        return maybe_apply_chat_template({"prompt": row["prompt"]}, self.processing_class)["prompt"]

    def _estimate_optimal_values(self) -> None:
        """V* for every train and eval prompt from `num_value_samples` samples of π_ref each (module docstring),
        sampled by the policy before its first update (it is π_ref then)."""
        if self.state.global_step != 0:
            raise ValueError(
                "A*-PO estimates V* from the reference policy before the first update, but training is at step "
                f"{self.state.global_step} without it (a checkpoint saved without V*). Resume from a checkpoint "
                "this version saved, or start the run again."
            )
        eval_sets = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        datasets = [d for d in (self.train_dataset, *eval_sets) if d is not None]
        n, values, all_incorrect = self.args.num_value_samples, {}, set()
        for dataset in datasets:
            loader = DataLoader(dataset, batch_size=self.args.per_device_train_batch_size, collate_fn=list)
            for rows in tqdm(
                self.accelerator.prepare(loader),
                desc="A*-PO: estimating V*",
                disable=not self.accelerator.is_main_process,
            ):
                rewards = self._reference_rewards([row for row in rows for _ in range(n)]).view(len(rows), n)
                v_star = self.args.beta1 * (torch.logsumexp(rewards / self.args.beta1, dim=1) - math.log(n))
                for row, value, scores in zip(rows, v_star.tolist(), rewards, strict=True):
                    values[self._prompt_key(row)] = value
                    if scores.sum() == 0:
                        all_incorrect.add(self._prompt_key(row))
        self._optimal_values = dict(gather_object(list(values.items())))
        self._all_incorrect = set(gather_object(list(all_incorrect)))

    def _reference_rewards(self, rows) -> torch.Tensor:
        """This process's rewards `(len(rows),)`, one sample of π_ref per row (an unscored sample reads 0)."""
        samples = self.sample(rows)
        scores = self._score(samples.rows, samples.prompts, samples.completions, samples.generation)
        start = self.accelerator.process_index * len(rows)
        return self.rewards.combine(scores)[start : start + len(rows)].nan_to_num(0.0)

    # ------------------------------------------------------------------ stage 2: on-policy regression
    def evaluate(self, *args, **kwargs):
        if self._optimal_values is None:  # evaluation before any training: V* first (TRL's order)
            self._estimate_optimal_values()
        return super().evaluate(*args, **kwargs)

    def score_rollout(self, batch: A2POBatch, samples, mode: str) -> None:
        keys = [self._prompt_key({"prompt": prompt}) for prompt in samples.prompts]
        batch.v_star = torch.tensor([self._optimal_values[key] for key in keys], device=batch.prompt_ids.device)
        super().score_rollout(batch, samples, mode)

    def assign_advantages(self, rewards, rewards_per_func, batch: A2POBatch, mode: str) -> None:
        """A = r - V*(x), this process's rows (an unscored row's reward reads 0)."""
        batch.advantages = batch.rewards.nan_to_num(0.0) - batch.v_star

    def compute_policy_loss(self, model, inputs: A2POBatch, num_items_in_batch=None):
        mask = inputs.loss_mask
        logps = (self.policy_logprobs(model, inputs).logps * mask).sum(1)  # (B,)
        implicit_reward = self.args.beta2 * (logps - (inputs.ref_logps * mask).sum(1))
        loss = ((implicit_reward - inputs.advantages) ** 2).mean()
        gather = self.accelerator.gather_for_metrics
        for name, value in (
            ("v_star", inputs.v_star),
            ("implicit_reward", implicit_reward.detach()),
            ("advantage", inputs.advantages),
        ):
            self.log_metric(name, gather(value).mean().item())
        return loss
