"""Reward functions and reward models: loading, calling with TRL's convention, weighting, NaN handling."""

import asyncio
import inspect
import math
import threading
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from trl import apply_chat_template, is_conversational

from ..models.loading import from_pretrained_checked, model_id_of
from ..models.token_ids import check_ids_in_table, check_table_covers_tokenizer, embedding_rows, padding_fill_id


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs, over `dim` (all entries if None); NaN below 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    count = (~torch.isnan(x)).sum(dim=dim)
    variance = torch.nanmean((x - mean) ** 2, dim=dim) * count / (count - 1)
    return torch.where(count > 1, variance, torch.full_like(variance, float("nan"))).sqrt()


def group_relative_advantages(rewards: torch.Tensor, size: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's advantages (Shao et al., 2024, arXiv:2402.03300) over groups of `size` contiguous rows,
    A_i = (r_i - mean_group r) / (s + 1e-4), with s the group's std (`scale="group"`), the whole batch's ("batch")
    or no division ("none"); NaN rewards (unscorable rows) are left out of the means and stds. Returns `(A, s)`,
    s per row (with "none", the group's: what the zero-std metric reads)."""
    mean = torch.nanmean(rewards.view(-1, size), dim=1).repeat_interleave(size)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(rewards.view(-1, size), dim=1).repeat_interleave(size) if size > 1 else torch.zeros_like(rewards)
    advantages = (rewards - mean) / (std + 1e-4) if scale != "none" else rewards - mean
    return advantages, std


def as_list(value) -> list:
    """A list or tuple as a list, None as `[]`, anything else as `[value]` (one reward function or class)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if value is None:
        return []
    return [value]


def _name_of(func) -> str:
    if isinstance(func, nn.Module):
        return model_id_of(func).rstrip("/").split("/")[-1]
    return getattr(func, "__name__", type(func).__name__)


def is_async_callable(func) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))  # noqa: B004


class EventLoopThread:
    """A daemon thread running one asyncio loop, so async reward functions run concurrently from sync code."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="trl_unified-rewards").start()

    def gather(self, coroutines: list) -> list:
        async def gather_all():  # results in order, an exception in place of a failed coroutine's
            return await asyncio.gather(*coroutines, return_exceptions=True)

        return asyncio.run_coroutine_threadsafe(gather_all(), self.loop).result()


class RewardFunctions:
    """The reward functions of a trainer, called with TRL's convention (docs/rloo.md, "Reward functions"): callables
    (`async def` ones run concurrently; `None` = not applicable, NaN internally), or sequence-classification models
    (or ids) whose single logit, on `prompt + completion` in their own tokenizer, is the reward."""

    def __init__(self, reward_funcs, reward_processing_classes, reward_weights, args, extra_funcs=()):
        funcs = as_list(reward_funcs)
        if not funcs and not extra_funcs:
            raise ValueError(
                "No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose environment "
                "defines a `get_reward` method."
            )
        funcs = [self._load(f, args) if isinstance(f, str) else f for f in funcs]
        for i, f in enumerate(funcs):
            if not (callable(f) or isinstance(f, nn.Module)):
                raise TypeError(
                    f"reward_funcs[{i}] is a {type(f).__name__}: expected a callable, a model or a model id."
                )
        self.funcs, self.names = funcs, [_name_of(f) for f in funcs]
        self.processing_classes = self._processing_classes(reward_processing_classes, args)
        if reward_weights is not None and len(reward_weights) != len(funcs):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} values but there are {len(funcs)} reward functions "
                f"({self.names}). Give one weight per reward function."
            )
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
        self.funcs += [func for _, func in extra_funcs]  # e.g. environment-owned rewards: weight 1,
        self.names += [name for name, _ in extra_funcs]  # named after their source
        self.processing_classes += [None] * len(extra_funcs)
        self.weights = torch.tensor(weights + [1.0] * len(extra_funcs), dtype=torch.float32)
        self._loop = EventLoopThread() if any(is_async_callable(f) for f in self.funcs) else None

    @staticmethod
    def _load(model_id: str, args) -> PreTrainedModel:
        kwargs = dict(args.model_init_kwargs or {})
        kwargs.pop("quantization_config", None)
        if args.distributed_state.distributed_type in ("MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP"):
            kwargs["device_map"] = None
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        return from_pretrained_checked(
            AutoModelForSequenceClassification, model_id, "reward model", num_labels=1, **kwargs
        )

    def _processing_classes(self, classes, args):
        classes = [None] * len(self.funcs) if classes is None else as_list(classes)  # one class: one function
        if len(classes) != len(self.funcs):
            raise ValueError(
                f"The number of reward processing classes ({len(classes)}) must match the number of reward functions "
                f"({len(self.funcs)}: {self.names}). Pass a list with one entry per reward function (None where the "
                "model's own tokenizer should be loaded)."
            )
        for i, (func, cls) in enumerate(zip(self.funcs, classes, strict=True)):
            if not isinstance(func, PreTrainedModel):
                continue
            if cls is None:
                cls = from_pretrained_checked(
                    AutoTokenizer, model_id_of(func), "tokenizer", trust_remote_code=args.trust_remote_code
                )
            if not isinstance(cls, PreTrainedTokenizerBase):
                raise TypeError(f"reward_processing_classes[{i}] must be a tokenizer, got {type(cls).__name__}.")
            if cls.pad_token is None:
                cls.pad_token = cls.eos_token
            func.config.pad_token_id = cls.pad_token_id
            vocab = func.get_input_embeddings().num_embeddings
            if len(cls) > vocab:
                raise ValueError(
                    f"The tokenizer for reward model {self.names[i]!r} has {len(cls)} tokens but the model's "
                    f"embedding has {vocab} rows: they do not belong together. Pass the reward model's own tokenizer "
                    "in reward_processing_classes."
                )
            classes[i] = cls
        return classes

    def models(self) -> list[tuple[int, PreTrainedModel]]:
        return [(i, f) for i, f in enumerate(self.funcs) if isinstance(f, nn.Module)]

    def _score_with_model(self, model, tokenizer, prompts, completions, device, chat_template_kwargs):
        if is_conversational({"prompt": prompts[0]}):
            texts = [
                apply_chat_template({"messages": p + c}, tokenizer, **chat_template_kwargs)["text"]
                for p, c in zip(prompts, completions, strict=True)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        inputs = tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        with torch.inference_mode():
            return model(**{k: v.to(device) for k, v in inputs.items()}).logits[:, 0].float().cpu().tolist()

    def _check(self, name: str, values, expected: int) -> list[float]:
        if values is not None and not hasattr(values, "__len__") and hasattr(values, "__iter__"):
            values = list(values)  # a generator or other iterable, as TRL accepts
        if values is None or not hasattr(values, "__len__") or isinstance(values, (str, bytes)):
            raise TypeError(
                f"Reward function {name!r} returned {type(values).__name__}; it must return a list of floats."
            )
        if len(values) != expected:
            raise ValueError(
                f"Reward function {name!r} returned {len(values)} rewards for {expected} completions. Return exactly "
                "one reward (or None) per completion."
            )
        out = []
        for row, v in enumerate(values):
            v = float("nan") if v is None else float(v)
            if math.isinf(v):
                # a bug in the function, not a score: one step would make its group's advantages, then the weights, NaN
                raise ValueError(
                    f"Reward function {name!r} returned {v} for completion {row}. Rewards must be finite floats, or "
                    "None (NaN) for 'not applicable'. Clip the value in the function (e.g. to a large finite bound)."
                )
            out.append(v)
        return out

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        extra_columns: dict[str, list[Any]],
        device,
        chat_template_kwargs: dict | None = None,
        prompt_token_ids: list[list[int]] | None = None,
        **hooks,
    ) -> torch.Tensor:
        """Score every completion with every function. Returns `(N, num_funcs)` float32 rewards; NaN = not applicable.

        Callables get TRL's keyword arguments: the dataset's other columns (`extra_columns`, unchanged) and the
        `hooks` (`trainer_state`, `log_metric`, `log_extra`, ...), plus `prompt_ids` (`prompt_token_ids`, each row's
        prompt tokens) unless the dataset has a column of that name: a user's column is never shadowed. Scorers of
        token ids (`TokenIdsRewardModel`) always read `prompt_token_ids`.
        """
        n = len(prompts)
        kwargs = {**extra_columns, **hooks}
        if prompt_token_ids is not None and "prompt_ids" not in kwargs:
            kwargs["prompt_ids"] = prompt_token_ids
        out = torch.full((n, len(self.funcs)), float("nan"), dtype=torch.float32)
        pending = []
        for i, (func, name) in enumerate(zip(self.funcs, self.names, strict=True)):
            try:
                if isinstance(func, nn.Module):
                    values = self._score_with_model(
                        func, self.processing_classes[i], prompts, completions, device, chat_template_kwargs or {}
                    )
                elif isinstance(func, TokenIdsRewardModel):
                    values = func(prompts, completions, completion_ids, prompt_token_ids)
                else:
                    values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
            except Exception as e:
                raise RuntimeError(f"Reward function {name!r} raised {e.__class__.__name__}: {e}") from e
            if is_async_callable(func):  # a coroutine: the async functions run concurrently below
                pending.append((i, name, values))
            else:
                out[:, i] = torch.tensor(self._check(name, values, n))
        if pending:
            for (i, name, _), values in zip(pending, self._loop.gather([c for *_, c in pending]), strict=True):
                if isinstance(values, BaseException):
                    raise RuntimeError(
                        f"Reward function {name!r} raised {values.__class__.__name__}: {values}"
                    ) from values
                out[:, i] = torch.tensor(self._check(name, values, n))
        return out.to(device)

    def combine(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """Weighted sum over functions, ignoring NaN (not applicable) entries; a row where every function returned
        None stays NaN ("unscorable"). `(N, F)` -> `(N,)`."""
        weighted = (rewards_per_func * self.weights.to(rewards_per_func.device)).nansum(dim=1)
        return weighted.masked_fill(torch.isnan(rewards_per_func).all(dim=1), math.nan)


class TokenIdsRewardModel:
    """A sequence-classification reward model that reads the policy's own token ids (TRL's PPO `reward_model`): the
    score is its `score` head on the backbone's last hidden state at each row's last completion token (the last
    prompt token for an empty completion), with left padding skipped in the positions. No text round trip: the
    model sees exactly the sampled ids, EOS included. `pad_token_id`: the policy tokenizer's (fills the batch, masked;
    read as 0 where the reward model's table, which must hold the policy's ids, does not hold it; docs/ppo.md)."""

    def __init__(self, model, pad_token_id: int):
        self.model, self.rows = model, embedding_rows(model)
        self.pad_token_id = padding_fill_id(pad_token_id, self.rows)
        self.__name__ = _name_of(model)

    @classmethod
    def build(cls, model, policy, processing_class, accelerator) -> "TokenIdsRewardModel":
        """From a model or its id/path, frozen and placed like the reference; its embedding table must hold the ids
        of the policy's tokenizer (`processing_class`)."""
        from ..core.reference import prepare_frozen_model

        if isinstance(model, str):
            model = from_pretrained_checked(AutoModelForSequenceClassification, model, "reward model", num_labels=1)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        check_table_covers_tokenizer(model, tokenizer, "reward model")
        return cls(prepare_frozen_model(model.requires_grad_(False), accelerator), tokenizer.pad_token_id)

    @torch.no_grad()
    def __call__(self, prompts, completions, completion_ids, prompt_ids, **kwargs) -> list[float]:
        from ..data.datasets import pad
        from .critic import last_hidden_states, position_ids_from_mask

        device = next(self.model.parameters()).device
        rows = [torch.tensor(p + c, dtype=torch.long) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        input_ids = pad(rows, self.pad_token_id, "right").to(device)
        attention_mask = pad([torch.ones_like(r) for r in rows], 0, "right").to(device)
        check_ids_in_table(input_ids, attention_mask, self.rows, "A scored row", "the reward model's")
        model = self.model.module if hasattr(self.model, "module") else self.model
        hidden = last_hidden_states(model, input_ids, attention_mask, position_ids_from_mask(attention_mask))
        last = (attention_mask.sum(1) - 1).clamp(min=0)  # (B,): last completion token (last prompt token if empty)
        return model.score(hidden[torch.arange(hidden.size(0), device=device), last]).squeeze(-1).float().tolist()
