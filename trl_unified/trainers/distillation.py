r"""On-policy distillation (GKD: Agarwal et al., 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", arXiv:2306.13649): a drop-in for `trl.DistillationTrainer` 1.16 on the shared online core.

The student generates a completion for each prompt (the online core: lean decoding, vLLM, tools), a frozen teacher
scores every completion token with its full next-token distribution, and the loss pulls the student's distribution
to the teacher's with the generalized Jensen-Shannon divergence D_beta of `core/divergence.py` (both logits divided
by `temperature`; beta = 0: forward KL(teacher || student), beta = 1: reverse KL(student || teacher), the default).
With M the model's completion tokens (tool-result tokens excluded) of the whole generation batch, all processes,

    loss = sum_{i,t in M_micro-batch} D_beta(i, t) / (|M| / processes * GA / steps_per_generation)

which sums to the mean over M across one optimiser step (TRL's normalisation; no further division by GA). How D is
computed (final hidden states, in chunks of positions) and what is logged: docs/distillation.md.
"""

import json
from dataclasses import dataclass

import torch

from ..core.config import document_fields, option
from ..data.sft import ChatMLCollator
from ..models.loading import default_output_dir
from ..online.completions import CompletionMix
from ..online.config import OnlineConfig
from ..online.distillation import DistillationCore
from ..online.rollout import RolloutBatch


@document_fields
@dataclass
class DistillationConfig(OnlineConfig):
    """Configuration of `DistillationTrainer`: every field of `trl.DistillationConfig` 1.16, same names and
    defaults (the sampling, vLLM, tool and logging fields are the online core's)."""

    _min_num_generations = 1
    _inapplicable_fields = (
        "num_iterations",
        "epsilon",
        "epsilon_high",
        "reward_weights",
        "strict_rewards",
        "num_generations_eval",
    )
    _inapplicable_reason = "distillation (no reward, ratio or clipping)"
    _unimplemented_fields = {
        **OnlineConfig._unimplemented_fields,
        "padding_free": "The student and teacher passes run on padded rows.",
    }

    num_generations: int | None = option(1, "Completions sampled per prompt.")
    padding_free: bool | None = option(False, "Padded rows only (see _unimplemented_fields).")
    beta: float = option(1.0, "Generalized JSD interpolation: 0 forward KL, 1 reverse KL, 0.5 symmetric JSD.")
    teacher_model_name_or_path: str | None = option(None, "Teacher id or path, used when teacher_model is None.")
    teacher_model_revision: str | None = option(None, "Hub revision of the teacher.")
    teacher_model_init_kwargs: dict | str | None = option(None, "from_pretrained kwargs of a teacher given by id.")
    teacher_model_server_url: str | None = option(
        None,
        "trl_unified addition to DistillationTrainer (ServerDistillation's field): a teacher served by vLLM at this "
        "URL (a list, or a JSON list, for several), scored on the top-k it reports (docs/distillation.md, Teachers).",
    )
    teacher_weights: list[float] | None = option(
        None, "trl_unified only. One weight per teacher (models first, then servers); None: equal, summing to 1."
    )
    loss_top_k: int = option(1, "Server teachers: top-k log-probs requested (beta > 0 needs 1: top-1 + sampled).")
    loss_add_tail: bool = option(True, "Server teachers: add the tail bucket (the mass outside the support).")

    def __post_init__(self):
        if isinstance(self.teacher_model_init_kwargs, str):
            self.teacher_model_init_kwargs = json.loads(self.teacher_model_init_kwargs)
        if isinstance(self.teacher_model_server_url, str) and self.teacher_model_server_url.startswith("["):
            self.teacher_model_server_url = json.loads(self.teacher_model_server_url)
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")
        if self.teacher_model_server_url:
            self._check_server_support()
        super().__post_init__()

    def _check_server_support(self) -> None:
        """What a teacher server can score (TRL's ServerDistillation rules): its top-k at beta = 0, its top-1 and the
        sampled token otherwise."""
        if self.beta == 0 and self.loss_top_k < 1:
            raise ValueError(
                f"loss_top_k must be positive with beta=0 (got loss_top_k={self.loss_top_k}). The pure forward server "
                "path only has access to the teacher's top-k logprobs, so it cannot compute the exact "
                "full-vocabulary loss when loss_top_k=0."
            )
        if not self.loss_add_tail and (self.beta == 1 or (self.beta == 0 and self.loss_top_k == 1)):
            raise ValueError(
                f"loss_add_tail=False with beta={self.beta} and loss_top_k={self.loss_top_k}: the support is one "
                "token, which renormalised has probability 1 on both sides, so the loss would be identically 0 "
                "(nothing learned). Keep loss_add_tail=True, or use beta=0 with loss_top_k > 1."
            )
        if self.beta > 0 and self.loss_top_k != 1:
            raise ValueError(
                f"loss_top_k must be 1 with beta>0 (got loss_top_k={self.loss_top_k}). Mixed forward/reverse "
                "distillation with an external teacher is only implemented for top-1 support."
            )

    def uses_reference_model(self) -> bool:
        return False  # `beta` here is the divergence's interpolation, not a KL coefficient; the teacher is separate

    def _no_reference_reason(self) -> str:
        return "distillation has no reference model (the teacher is `teacher_model`)"


class DistillationBatch(RolloutBatch):
    """A `RolloutBatch` that also answers TRL 1.10's keys: `input_ids` / `attention_mask` (prompt + completion),
    `labels` (-100 outside the completion tokens the loss covers), `prompts` / `prompt_attention_mask`."""

    _views = ("input_ids", "attention_mask", "labels", "prompts", "prompt_attention_mask")

    def __contains__(self, name: str) -> bool:
        return name in self._views or super().__contains__(name)

    def keys(self) -> list[str]:
        return [*super().keys(), *self._views]

    def __getitem__(self, name: str):
        if name in ("input_ids", "attention_mask"):
            return self.model_inputs()[0 if name == "input_ids" else 1]
        if name == "labels":
            completion = self.completion_ids.masked_fill(self.loss_mask == 0, -100)
            return torch.cat([torch.full_like(self.prompt_ids, -100), completion], dim=1)
        if name in ("prompts", "prompt_attention_mask"):
            return self.prompt_ids if name == "prompts" else self.prompt_mask
        return super().__getitem__(name)


class DistillationTrainer(DistillationCore):
    """On-policy distillation (see the module docstring). Same constructor as `trl.DistillationTrainer` 1.16;
    `teacher_model` may also be a list of models / ids (with `teacher_weights`), and teachers may be served
    (`teacher_model_server_url`)."""

    _name = "Distillation"
    _tag_names = ["trl", "distillation", "trl_unified"]
    config_class = DistillationConfig
    batch_class = DistillationBatch
    loss_is_scaled_for_ga = True
    logs_divergence = False  # True: the per-token mean of D is logged as `jsd` (TRL's asynchronous trainer)

    def __init__(
        self,
        model,
        teacher_model=None,
        args: DistillationConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
    ):
        self._teacher_source = teacher_model  # loaded and prepared in setup(), before training
        super().__init__(
            model,
            None,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
        )

    def compute_policy_loss(self, model, inputs, num_items_in_batch=None):
        if isinstance(inputs, dict) and "labels" in inputs and "completion_ids" not in inputs:
            return self.labelled_loss(model, inputs, num_items_in_batch)
        get = inputs.get
        prompt_ids, prompt_mask = get("prompt_ids"), get("prompt_mask")
        completion_ids, completion_mask = get("completion_ids"), get("completion_mask")
        mask = completion_mask if get("tool_mask") is None else completion_mask * get("tool_mask")
        if model.training and not isinstance(inputs, dict):  # the generation batch's count, one optimiser step's share
            tokens = max(inputs.num_loss_tokens, 1.0) / self.accelerator.num_processes
            num_items_in_batch = tokens * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        elif model.training and get("num_items_in_batch") is not None:
            num_items_in_batch = get("num_items_in_batch").clamp(min=1.0) / self.accelerator.num_processes
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        completion = completion_ids.masked_fill(completion_mask == 0, -100)  # a server teacher's alignment
        labels = torch.cat([torch.full_like(prompt_ids, -100), completion], dim=1)
        width = completion_ids.size(1)
        routing = get("teacher_index")  # a teacher per row (TRL's multi-teacher routing), where rows name one
        divergence, entropy = self.token_divergence(
            model, input_ids, attention_mask, width, mask, labels, prompt_mask, routing
        )
        loss = self._reduce_divergence_loss(divergence, completion_mask=mask, num_items_in_batch=num_items_in_batch)
        self.log_metric("entropy", self.masked_global_mean(entropy, mask))
        if self.logs_divergence:
            self.log_metric("jsd", self.masked_global_mean(divergence.detach(), mask))
        return loss


class MessagesDistillationTrainer(DistillationTrainer):
    """The base of TRL's experimental GKD and IW-OPD: distillation on `messages` rows (the last turn the completion)
    tokenised by TRL's ChatML collator (`data/sft.py`), their SFTTrainer-style constructor (a `data_collator`;
    `compute_metrics` and `preprocess_logits_for_metrics` refused, with the reason), and the
    on/off-policy mix of `lmbda` (`online/completions.py`), evaluation scoring the dataset's completions."""

    prompt_columns = ("messages",)
    collator_prompt_budget: int | None = None  # the collator's prompt-token limit (None: max_length's)

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args=None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        preprocess_logits_for_metrics=None,
        peft_config=None,
    ):
        unsupported = {
            "compute_metrics": (compute_metrics, "the evaluation reports the loss on the dataset's completions"),
            "preprocess_logits_for_metrics": (preprocess_logits_for_metrics, "the evaluation keeps no logits"),
        }
        for name, (value, reason) in unsupported.items():
            if value is not None:
                raise NotImplementedError(f"{name} is not supported by {self._name}: {reason}.")
        args = args or self.config_class(output_dir=default_output_dir(model, self._name))
        args.remove_unused_columns = False  # the collator reads the rows' own columns (as TRL's trainers)
        self._data_collator = data_collator
        data = (train_dataset, eval_dataset, processing_class, callbacks, optimizers)
        super().__init__(model, teacher_model, args, *data, peft_config=peft_config)

    def make_data_collator(self):
        a = self.args
        return self._data_collator or ChatMLCollator(
            self.processing_class, a.max_length, a.chat_template_kwargs, self.collator_prompt_budget
        )

    def completion_mix(self) -> CompletionMix:
        return CompletionMix(self.args.lmbda, eval_source="dataset")
