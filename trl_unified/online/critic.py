r"""A learned critic for online trainers (PPO): the value model, per-token rewards, GAE, whitening.

The value model (`AutoModelForSequenceClassification`, one label: a value per position from its `score` head) is the
policy's submodule `value_model` (why, and what is saved where: docs/architecture.md, "A critic").

Per-token rewards and advantages (Ziegler et al., 2019, arXiv:1909.08593; Schulman et al., 2016, GAE,
arXiv:1506.02438), over completion positions t of one row, with M_t = 1 up to the last completion token T:

    KL_t = log π(y_t) - log π_ref(y_t)                       (k1)   or   (r - 1) - log r,  r = π_ref / π   (k3)
    r_t  = -kl_coef · KL_t · M_t  +  score · 1[t = T + 1 if T + 1 < C else T]
    δ_t  = r_t + γ V_{t+1} - V_t,        A_t = δ_t + γ λ A_{t+1},        returns R_t = A_t + V_t

with V_t the value of the state before token t (0 beyond T + 1) and the score placed one position after the last
token (TRL's convention: the value of the state after EOS is learned too). Advantages are whitened over the
process's batch (mean 0, variance 1 over M); rewards optionally too (`whiten_rewards`, mean kept). The critic learns
from PPO's clipped value loss over the positions it is trained on (`value_mask`):

    L_V = 1/2 mean max((V_t - R_t)², (clip(V_t, V_old_t - ε_v, V_old_t + ε_v) - R_t)²)
"""

import contextlib
import os

import torch
from torch import nn

from ..core.logprobs import position_ids_from_mask  # noqa: F401 (re-exported: PPO's users import it here)
from ..models.loading import base_model, get_tokenizer, load_model_plain
from ..models.token_ids import check_ids_in_table, check_table_covers_tokenizer, embedding_rows, mask_padding


VALUE_WEIGHTS = "value_model.pt"


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (over `axis`, or all entries)."""
    return (values * mask).sum(axis) / mask.sum(axis)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` where `mask` is 1; Bessel-corrected by default."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError(
                "Whitening needs at least 2 unmasked values; the batch has fewer. Increase "
                "per_device_train_batch_size or gradient_accumulation_steps (or turn whiten_rewards off)."
            )
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """`(x - mean) / sqrt(var + 1e-8)` over the masked entries; with `shift_mean=False` the mean is added back."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Generalised advantage estimation (GAE, arXiv:1506.02438) over `(B, C)` per-token rewards and values, the
    value after the last position being 0: `A_t = δ_t + γ λ A_{t+1}`, `δ_t = r_t + γ V_{t+1} - V_t`."""
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.size(1))):
        next_value = values[:, t + 1] if t + 1 < rewards.size(1) else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    return advantages


def kl_per_token(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from the sampled tokens (Schulman, "Approximating KL Divergence"):
    k1 = log π - log π_ref; k3 = (r - 1) - log r with r = π_ref / π."""
    log_ratio = ref_logps - logps
    return -log_ratio if estimator == "k1" else log_ratio.exp() - 1 - log_ratio


def score_positions(completion_mask: torch.Tensor) -> torch.Tensor:
    """`(B,)` where each row's score is added: one position after its last completion token, or the last token
    itself when the completion fills the width (TRL's PPO)."""
    return completion_mask.sum(1).clamp(max=completion_mask.size(1) - 1).clamp(min=0)


def per_token_rewards(scores, kl, kl_coef: float, completion_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's r_t: `(token_rewards, non_score)`, both `(B, C)`, with non_score = -kl_coef · KL_t
    (`kl` already masked) and each row's score `(B,)` added at its `score_positions`."""
    non_score = -kl_coef * kl
    token_rewards = non_score.clone()
    token_rewards[torch.arange(len(scores), device=scores.device), score_positions(completion_mask)] += scores
    return token_rewards, non_score


def clipped_value_loss(values, old_values, returns, cliprange_value: float, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss (Schulman et al., 2017; TRL's PPO), over the masked positions:
    1/2 mean max((V - R)², (clip(V, V_old - ε_v, V_old + ε_v) - R)²); and the fraction of positions where the
    clipped term is the larger (`val/clipfrac_avg`)."""
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_loss, clipped_loss), mask)
    return loss, masked_mean((clipped_loss > unclipped_loss).float(), mask)


def value_mask(completion_mask: torch.Tensor) -> torch.Tensor:
    """The positions whose values are trained: the completion and the position after it (where the score lands)."""
    shifted = torch.nn.functional.pad(completion_mask[:, :-1], (1, 0))
    return ((completion_mask + shifted) > 0).to(completion_mask.dtype)


def last_hidden_states(model: nn.Module, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """`(B, T, H)`: the last hidden states of a sequence classifier's backbone (`base_model_prefix`), without cache."""
    backbone = getattr(model, model.base_model_prefix)
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state


class ValueHead:
    """The critic's plumbing around a value model (a sequence classifier: a backbone and a `score` head): its value
    per position, computed inside the policy's forward when requested. It holds no parameters: the value model itself
    is the policy's submodule `value_model` (`attach_value_model`), the object the user passed, with its own names."""

    def __init__(self, model: nn.Module):
        prefix = getattr(model, "base_model_prefix", None)
        if prefix is None or not hasattr(model, prefix) or not hasattr(model, "score"):
            raise ValueError(
                f"value_model is a {type(model).__name__}: it needs a backbone (`base_model_prefix`) and a `score` "
                "head, as AutoModelForSequenceClassification.from_pretrained(path, num_labels=1) has."
            )
        self.model, self.rows, self._pending, self.values = model, embedding_rows(model), None, None

    def forward_alongside(self, policy: nn.Module) -> None:
        """Install the hook that runs the critic inside the policy's forward when requested (`request_values`): under
        DDP a trained module must run inside the wrapper's forward, or its gradients are reduced out of step."""

        def hook(module, args, kwargs, output):
            if self._pending is not None and kwargs.get("input_ids") is not None:
                width, self._pending = self._pending, None
                ids, mask, positions = kwargs["input_ids"], kwargs["attention_mask"], kwargs.get("position_ids")
                self.values = self(ids, mask, position_ids_from_mask(mask) if positions is None else positions, width)

        policy.register_forward_hook(hook, with_kwargs=True)

    def request_values(self, logits_to_keep: int) -> None:
        """The next policy forward also computes the values of its last `logits_to_keep` positions (with grad)."""
        self._pending, self.values = logits_to_keep, None

    def take_values(self) -> torch.Tensor:
        values, self.values = self.values, None
        if values is None:
            raise RuntimeError("The policy forward did not compute the requested values (no forward ran).")
        return values

    def __call__(self, input_ids, attention_mask, position_ids, logits_to_keep: int) -> torch.Tensor:
        """Values `(B, C)` of the states before each of the last `logits_to_keep` tokens (hidden padding beyond the
        value model's embedding table read as 0, `models/token_ids.py`)."""
        ids = mask_padding(input_ids, attention_mask, self.rows)
        hidden = last_hidden_states(self.model, ids, attention_mask, position_ids)
        states = hidden[:, -(logits_to_keep + 1) : -1]  # (B, C, H): the state before each completion token
        return self.model.score(states).squeeze(-1).float()


def attach_value_model(policy: nn.Module, value_model: nn.Module) -> ValueHead:
    """Make `value_model` a trained submodule (`value_model`) of the policy (inside a PEFT wrapper, beside the
    adapted model), with every parameter trainable, and give the policy TRL 1.12's wrapper attributes:
    `policy.value_model` is `value_model`, `policy.policy` the policy itself. Returns the `ValueHead`."""
    head = ValueHead(value_model)
    value_model.requires_grad_(True)
    base = base_model(policy)
    base.add_module("value_model", value_model)
    # TRL 1.12's `trainer.model.policy`: a plain attribute (not a submodule: the module tree must stay acyclic)
    object.__setattr__(policy, "policy", policy)
    head.forward_alongside(base)
    return head


@contextlib.contextmanager
def without_value_model(model: nn.Module):
    """The policy alone, for saving (the critic is not part of the published model)."""
    base = base_model(model)
    head = base._modules.pop("value_model", None)
    try:
        yield model
    finally:
        if head is not None:
            base._modules["value_model"] = head


def load_value_model(head: ValueHead, folder: str) -> bool:
    path = os.path.join(folder, VALUE_WEIGHTS)
    if not os.path.exists(path):
        return False
    state = torch.load(path, map_location="cpu", weights_only=True)
    if set(state) != set(head.model.state_dict()) and all(k.startswith("model.") for k in state):
        # a checkpoint written before the value model was attached directly: the ValueHead wrapper's names
        state = {k[len("model.") :]: v for k, v in state.items()}
    head.model.load_state_dict(state)
    return True


class EveryNStepsScheduler:
    """Step the wrapped scheduler once every `every` calls: e.g. once per rollout when a rollout spans `every`
    optimiser steps (TRL's PPO moves the learning rate once per rollout, `transformers.Trainer` steps the scheduler
    after every optimiser step)."""

    def __init__(self, scheduler, every: int):
        self.scheduler, self.every, self.calls = scheduler, every, 0

    def step(self, *args, **kwargs):
        self.calls += 1
        if self.calls % self.every == 0:
            self.scheduler.step(*args, **kwargs)

    def state_dict(self):
        return {"scheduler": self.scheduler.state_dict(), "calls": self.calls}

    def load_state_dict(self, state):
        self.scheduler.load_state_dict(state["scheduler"])
        self.calls = state["calls"]

    def __getattr__(self, name):  # optimizer, base_lrs, ... of the wrapped scheduler
        return getattr(self.scheduler, name)


class CriticMixin:
    """An online trainer with a learned critic (PPO): mix in before `OnlineTrainer`, call `attach_critic` in `setup`;
    its config has `save_value_model` (whether `save_model` also writes the critic)."""

    value_head: ValueHead | None = None  # the attached value model

    def attach_critic(self, value_model) -> None:
        """Attach a value model (a classifier on the policy tokenizer's ids, or its id): `attach_value_model`."""
        if isinstance(value_model, str):
            value_model = load_model_plain(value_model, what="value model", num_labels=1)
        check_table_covers_tokenizer(value_model, get_tokenizer(self.processing_class), "value model")
        self.value_model = value_model.to(self.args.device)
        self.value_head = attach_value_model(self.model, self.value_model)
        # DDP's unused-parameter search (the Trainer's default without gradient checkpointing) starts from the
        # forward's outputs, which lack the values: the critic would be marked unused, then ready again.
        if self.args.ddp_find_unused_parameters:
            raise ValueError(
                "ddp_find_unused_parameters=True is not supported with a value model (every parameter gets a "
                "gradient at every step, and the search would mark the critic unused). Leave it None or False."
            )
        self.args.ddp_find_unused_parameters = False
        if getattr(self.accelerator, "ddp_handler", None) is not None:  # built by Trainer.__init__ from the args
            self.accelerator.ddp_handler.find_unused_parameters = False

    @torch.no_grad()
    def token_values(self, batch, chunk: int | None = None) -> torch.Tensor:
        """The critic's values `(B, C)` of the states before each completion token (`chunk` rows per forward),
        without grad, for the rollout; with grad, the loss requests them from the policy's own forward
        (`value_head.request_values`), so that DDP sees the critic inside the wrapper's forward."""
        input_ids, attention_mask, _ = batch.model_inputs()
        check_ids_in_table(input_ids, attention_mask, self.value_head.rows, "A rollout row", "the value model's")
        positions = position_ids_from_mask(attention_mask)
        width, chunk = batch.completion_ids.size(1), chunk or input_ids.size(0)
        rows = [slice(i, i + chunk) for i in range(0, input_ids.size(0), chunk)]
        with self.accelerator.autocast():
            parts = [self.value_head(input_ids[r], attention_mask[r], positions[r], width) for r in rows]
        return torch.cat(parts)

    def critic_advantages(self, batch, token_rewards, gamma: float, lam: float, chunk: int | None = None) -> None:
        """GAE over the critic's values (module docstring): `batch.values` `(B, C)` (0 outside `value_mask`),
        `batch.returns` = A + V, and `batch.advantages`, A whitened over the loss tokens (0 elsewhere)."""
        batch.values = self.token_values(batch, chunk=chunk) * value_mask(batch.completion_mask).float()
        advantages = gae_advantages(token_rewards, batch.values, gamma, lam)
        batch.returns = advantages + batch.values
        mask = batch.loss_mask.float()
        batch.advantages = masked_whiten(advantages, mask) * mask

    def optimizer_steps_per_rollout(self) -> int:
        """How many optimiser steps share one learning rate (1: the Trainer's schedule)."""
        return 1

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        every = self.optimizer_steps_per_rollout()
        if every == 1 or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        super().create_scheduler(max(1, num_training_steps // every), optimizer)
        self.lr_scheduler = EveryNStepsScheduler(self.lr_scheduler, every)
        return self.lr_scheduler

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The policy (the critic is not part of the published model; with `args.save_value_model` it is saved too,
        in `<output_dir>/value_model`)."""
        with without_value_model(self.accelerator.unwrap_model(self.model)):
            super().save_model(output_dir, _internal_call)
        if self.args.save_value_model and not _internal_call and self.is_world_process_zero():
            self.value_model.save_pretrained(os.path.join(output_dir or self.args.output_dir, "value_model"))

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.value_head is not None and self.is_world_process_zero():
            folder = os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}")
            torch.save(self.value_head.model.state_dict(), os.path.join(folder, VALUE_WEIGHTS))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        with without_value_model(self.accelerator.unwrap_model(self.model)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self.value_head is not None:
            load_value_model(self.value_head, resume_from_checkpoint)


def rlhf_objective_metrics(kl, non_score, scores, old_logps, mask) -> dict[str, torch.Tensor]:
    """TRL's PPO rollout metrics, this process's means (`(B, C)` per-token tensors, `scores` `(B,)`): the KL and the
    non-score reward summed per sequence, the sampled tokens' negative log-prob summed per sequence
    (`objective/entropy`), the score, and the RLHF reward (non-score reward plus score)."""
    non_score_per_sequence = non_score.sum(1).mean()
    return {
        "objective/kl": kl.sum(1).mean(),
        "objective/entropy": (-old_logps * mask).sum(1).mean(),
        "objective/non_score_reward": non_score_per_sequence,
        "objective/rlhf_reward": non_score_per_sequence + scores.mean(),
        "objective/scores": scores.mean(),
    }
