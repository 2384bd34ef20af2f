r"""Online DPO (Guo et al., 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv:2402.04792): DPO on
the policy's own samples, a drop-in for TRL 1.16's `trl.experimental.online_dpo.OnlineDPOTrainer` made of the online
core's rollout (two completions per prompt) and the preference core's pair losses (`preference/losses.py`).

For each prompt x the policy samples y_1, y_2; the reward functions score them (r_i, weighted sum over functions,
minus `missing_eos_penalty` for a completion that ends without EOS) and the pair is ranked: y_w = y_1 if
r_1 >= r_2 else y_2. With sequence log-probs log π(y|x) = Σ_t log π(y_t | x, y_<t) over the completion tokens (logits
at temperature 1: the policy itself, not its sampling distribution) and h = log π_θ(y|x) - log π_ref(y|x):

    sigmoid (DPO):  ℓ = -log σ(β (h_w - h_l))            ipo (arXiv:2310.12036):  ℓ = (h_w - h_l - 1/(2β))²

and the loss of a micro-batch of B pairs is L = 1/B Σ ℓ (the Trainer divides it by the gradient accumulation). β may
change per epoch (`beta` as a list: its e-th entry in epoch e, the last one after). TRL's metrics: docs/online_dpo.md.
"""

import warnings
from dataclasses import dataclass

import torch
from accelerate.utils import gather

from ..core.config import document_fields, option
from ..online.config import OnlineConfig
from ..online.rollout import RolloutBatch, RolloutPlan
from ..online.trainer import OnlineTrainer
from ..preference.losses import pair_losses


@document_fields
@dataclass
class OnlineDPOConfig(OnlineConfig):
    """Configuration of `OnlineDPOTrainer`: every field of TRL 1.16's `OnlineDPOConfig`, same names and defaults;
    `per_device_train_batch_size` counts prompts, two completions each, as in TRL."""

    _batch_unit = 2
    learning_rate: float = option(5e-7, "Initial AdamW learning rate.")
    reward_model_path: str | None = option(None, "Not read (as in TRL): reward models go in reward_funcs.")
    max_new_tokens: int = option(64, "Maximum length of each completion.")
    max_length: int = option(512, "Prompt + completion tokens in the loss passes; longer prompts lose their start.")
    temperature: float = option(0.9, "Sampling temperature (the loss reads log-probs at temperature 1).")
    missing_eos_penalty: float | None = option(None, "Subtracted from the reward of a completion without EOS.")
    beta: list[float] = option(default_factory=lambda: [0.1], help="β, or one per epoch (the last one after that).")
    loss_type: str = option("sigmoid", "'sigmoid' (DPO) or 'ipo'.")
    disable_dropout: bool = option(True, "Set every dropout probability of the policy and reference to 0.")
    vllm_gpu_memory_utilization: float | None = option(0.55, "Colocate: share of device memory the engine takes.")
    num_generations: int | None = option(2, "Completions per prompt: online DPO ranks a pair.")

    def __post_init__(self):
        if isinstance(self.beta, (list, tuple)) and len(self.beta) == 1:
            self.beta = self.beta[0]  # TRL's rule
        self.max_completion_length = self.max_new_tokens
        super().__post_init__()
        if self.num_generations != 2:
            raise ValueError(f"num_generations={self.num_generations}: online DPO samples a pair (2) per prompt.")
        if self.loss_type not in ("sigmoid", "ipo"):
            raise ValueError(f"loss_type={self.loss_type!r} is not one of ['sigmoid', 'ipo'].")
        if self.max_new_tokens >= self.max_length:  # TRL's warning: the prompt then leaves no room in the loss passes
            warnings.warn(f"max_new_tokens ({self.max_new_tokens}) >= max_length ({self.max_length}).", stacklevel=3)

    def _check_beta(self):
        if min(self.beta if isinstance(self.beta, (list, tuple)) else [self.beta]) <= 0:
            raise ValueError(f"beta={self.beta} must be > 0.")

    def uses_reference_model(self) -> bool:
        return True


@dataclass
class OnlineDPOBatch(RolloutBatch):
    """A `RolloutBatch` whose rows are ranked in pairs: `scores` `(B,)`, each completion's score (its reward, minus
    the missing-EOS penalty), read by the loss; `advantages` stay None."""

    scores: torch.Tensor | None = None


class OnlineDPOTrainer(OnlineTrainer):
    """Online DPO (see the module docstring). TRL 1.16's constructor, plus the online core's arguments."""

    _name = "Online DPO"
    _tag_names = ["trl", "online-dpo", "trl_unified"]
    config_class = OnlineDPOConfig
    batch_class = OnlineDPOBatch
    shuffles_groups = True  # the loss ranks each pair within its micro-batch
    logprob_temperature = 1.0

    def __init__(
        self,
        model,
        ref_model=None,
        reward_funcs=None,
        args: OnlineDPOConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        peft_config=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        **online_kwargs,
    ):
        """TRL 1.16's arguments, then by keyword the online core's (`quantization_config`, `tools`, ...)."""
        if ref_model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object. Pass a copy, or None.")
        unsupported = {
            "data_collator": data_collator,
            "compute_metrics": compute_metrics,
            "preprocess_logits_for_metrics": preprocess_logits_for_metrics,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise NotImplementedError(f"{name}: online DPO batches are rollouts, built by the online core.")
        if reward_funcs is None:
            raise ValueError("`reward_funcs` must be provided: functions or reward models that rank each pair.")
        super().__init__(
            model,
            reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
            ref_model=ref_model,
            **online_kwargs,
        )

    def setup(self) -> None:
        super().setup()
        self.vllm_mode = self.args.vllm_mode if self.args.use_vllm else None  # TRL's online DPO: None with vLLM off

    @property
    def beta(self) -> float:
        beta = self.args.beta
        return beta[min(int(self.state.epoch or 0), len(beta) - 1)] if isinstance(beta, list) else beta

    def rollout_plan(self) -> RolloutPlan:
        return RolloutPlan(old_logps_train=False, old_logps_eval=False)  # no ratio: π_old is never read

    def truncate_rollout(self, batch: RolloutBatch) -> None:
        """TRL's: the prompts lose their first tokens so that prompt + completion fit `max_length` (not image rows,
        whose image tokens must stay)."""
        excess = batch.prompt_ids.size(1) + batch.completion_ids.size(1) - self.args.max_length
        if excess > 0 and not batch.visual_inputs:
            batch.prompt_ids = batch.prompt_ids[:, excess:]
            batch.prompt_mask = batch.prompt_mask[:, excess:]

    def assign_advantages(self, rewards, rewards_per_func, batch: "OnlineDPOBatch", mode: str) -> None:
        """No advantages: `batch.scores` hold each completion's score, its reward (all-None: 0, as TRL's nansum)
        minus the missing-EOS penalty; the loss ranks each pair by them."""
        penalty = self.args.missing_eos_penalty or 0.0
        batch.scores = batch.rewards.nan_to_num(0.0) - penalty * batch.is_truncated.float()

    def compute_policy_loss(self, model, inputs: OnlineDPOBatch, num_items_in_batch=None):
        mask = inputs.loss_mask
        per_token = self.policy_logprobs(model, inputs).logps
        logps, ref = (per_token * mask).sum(1).view(-1, 2), (inputs.ref_logps * mask).sum(1).view(-1, 2)  # (B, 2)
        scores = inputs.scores.view(-1, 2)
        second = (scores[:, 0] < scores[:, 1]).long()[:, None]  # the second wins; ties: the first (TRL)
        order = torch.cat([second, 1 - second], dim=1)  # (B, 2): chosen, rejected
        (logps_w, logps_l), (ref_w, ref_l) = logps.gather(1, order).unbind(1), ref.gather(1, order).unbind(1)
        h_w, h_l, ones = logps_w - ref_w, logps_l - ref_l, torch.ones_like(logps_w)
        terms = dict(h_w=h_w, h_l=h_l, s_w=h_w, s_l=h_l, delta=h_w - h_l, len_w=ones, len_l=ones)
        loss = pair_losses(terms, self.args.loss_type, self.beta, 0.0, 0.05).mean()
        beta, mean = self.beta, lambda x: gather(x.detach().float()).mean().item()
        kl = (logps.detach() - ref).view(-1)  # Σ_t over each completion's tokens
        self.log_metric("objective/scores", mean(scores))
        self.log_metric("objective/scores_margin", mean(scores.max(1).values - scores.min(1).values))
        self.log_metric("val/contain_eos_token", mean(~inputs.is_truncated))
        self.log_metric("objective/kl", mean(kl))
        self.log_metric("objective/non_score_reward", mean(-beta * kl))
        self.log_metric("objective/rlhf_reward", mean(scores.view(-1) - beta * kl))
        self.log_metric("objective/entropy", mean(-logps.view(-1)))
        r_w, r_l = gather(beta * h_w.detach()), gather(beta * h_l.detach())
        for name, value in (("chosen", r_w), ("rejected", r_l), ("margins", r_w - r_l), ("accuracies", r_w > r_l)):
            self.log_metric(f"rewards/{name}", value.float().mean().item())
        self.log_metric("logps/chosen", mean(logps_w))
        self.log_metric("logps/rejected", mean(logps_l))
        self.log_metric("beta", beta)
        return loss
