r"""A learned critic for online trainers (PPO): the value model, per-token rewards, GAE, whitening.

The value model is a separate `AutoModelForSequenceClassification` with one label (TRL's convention): its backbone
reads the policy's token ids and its `score` head gives a value per position. It is attached to the policy as the
submodule `value_model`, so that one module is trained: DDP / DeepSpeed / FSDP wrap it once, the optimiser and
gradient clipping see its parameters, and PEFT adapters of the policy do not reach it. It is not part of the saved
policy (`without_value_model`); checkpoints store it beside the policy (`VALUE_WEIGHTS`) for an exact resume.

Per-token rewards and advantages (Ziegler et al., 2019, arXiv:1909.08593; Schulman et al., 2016, GAE,
arXiv:1506.02438), over completion positions t of one row, with M_t = 1 up to the last completion token T:

    KL_t = log π(y_t) - log π_ref(y_t)                       (k1)   or   (r - 1) - log r,  r = π_ref / π   (k3)
    r_t  = -kl_coef · KL_t · M_t  +  score · 1[t = T + 1 if T + 1 < C else T]
    δ_t  = r_t + γ V_{t+1} - V_t,        A_t = δ_t + γ λ A_{t+1},        returns R_t = A_t + V_t

with V_t the value of the state before token t (0 beyond T + 1) and the score placed one position after the last
token (TRL's convention: the value of the state after EOS is learned too). Advantages are whitened over the
process's batch (mean 0, variance 1 over M); rewards optionally too (`whiten_rewards`, mean kept).
"""

import contextlib
import os

import torch
from torch import nn


VALUE_WEIGHTS = "value_model.pt"


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at each row's first real token (as `generate` numbers them)."""
    return (attention_mask.long().cumsum(1) - attention_mask.long()).clamp(min=0)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (over `axis`, or all entries)."""
    if axis is not None:
        return (values * mask).sum(axis) / mask.sum(axis)
    return (values * mask).sum() / mask.sum()


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
    last = completion_mask.sum(1) - 1  # (B,); -1 for an empty completion
    after = last + 1
    return torch.where(after < completion_mask.size(1), after, last).clamp(min=0)


def value_mask(completion_mask: torch.Tensor) -> torch.Tensor:
    """The positions whose values are trained: the completion and the position after it (where the score lands)."""
    shifted = torch.nn.functional.pad(completion_mask[:, :-1], (1, 0))
    return ((completion_mask + shifted) > 0).to(completion_mask.dtype)


def rlhf_objective_metrics(kl, non_score, scores, logps, mask) -> dict[str, torch.Tensor]:
    """TRL's PPO rollout metrics, this process's values: KL and non-score reward summed per sequence, the sampled
    tokens' negative log-prob summed per sequence (`objective/entropy`), the score, and their sum (RLHF reward)."""
    return {
        "objective/kl": kl.sum(1).mean(),
        "objective/entropy": (-logps * mask).sum(1).mean(),
        "objective/non_score_reward": non_score.sum(1).mean(),
        "objective/rlhf_reward": non_score.sum(1).mean() + scores.mean(),
        "objective/scores": scores.mean(),
    }


class ValueHead(nn.Module):
    """A sequence-classification model used as a critic: its backbone and `score` head, per position."""

    def __init__(self, model: nn.Module):
        super().__init__()
        prefix = getattr(model, "base_model_prefix", None)
        if prefix is None or not hasattr(model, prefix) or not hasattr(model, "score"):
            raise ValueError(
                f"value_model is a {type(model).__name__}: it needs a backbone (`base_model_prefix`) and a `score` "
                "head, as AutoModelForSequenceClassification.from_pretrained(path, num_labels=1) has."
            )
        self.model = model

    def forward_alongside(self, policy: nn.Module) -> None:
        """Install the hook that runs the critic inside the policy's forward when requested (`request_values`): under
        DDP a trained module must run inside the wrapper's forward, or its gradients are reduced out of step."""
        self._pending = None
        self.values = None

        def hook(module, args, kwargs, output):
            if self._pending is not None and kwargs.get("input_ids") is not None:
                width, self._pending = self._pending, None
                ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
                positions = kwargs.get("position_ids")
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

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep: int) -> torch.Tensor:
        """Values `(B, C)` of the states before each of the last `logits_to_keep` tokens."""
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        states = hidden[:, -(logits_to_keep + 1) : -1]  # (B, C, H): the state before each completion token
        return self.model.score(states).squeeze(-1).float()


def attach_value_model(policy: nn.Module, value_model: nn.Module) -> ValueHead:
    """Make `value_model` a trained submodule (`value_model`) of the policy (inside a PEFT wrapper, beside the
    adapted model), with every parameter trainable. Returns the `ValueHead`."""
    head = ValueHead(value_model)
    head.requires_grad_(True)
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    base.add_module("value_model", head)
    head.forward_alongside(base)
    return head


def check_value_vocabulary(policy, value_model) -> None:
    """The critic reads the policy's token ids: their embedding tables must have the same size."""
    sizes = [m.get_input_embeddings().weight.shape[0] for m in (policy, value_model)]
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"The value model's vocabulary ({sizes[1]} tokens) differs from the policy's ({sizes[0]}): it reads the "
            "policy's token ids. Use a value model built on the policy's tokenizer (e.g. "
            "AutoModelForSequenceClassification.from_pretrained(<policy path>, num_labels=1))."
        )


@contextlib.contextmanager
def without_value_model(model: nn.Module):
    """The policy alone, for saving (the critic is not part of the published model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base._modules.pop("value_model", None)
    try:
        yield model
    finally:
        if head is not None:
            base._modules["value_model"] = head


def save_value_model(head: ValueHead, folder: str) -> None:
    torch.save(head.state_dict(), os.path.join(folder, VALUE_WEIGHTS))


def load_value_model(head: ValueHead, folder: str) -> bool:
    path = os.path.join(folder, VALUE_WEIGHTS)
    if not os.path.exists(path):
        return False
    head.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return True
