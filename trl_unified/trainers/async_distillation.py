r"""Asynchronous on-policy distillation from teachers on vLLM servers: a drop-in for
`trl.experimental.async_distillation` 1.16 (GKD: Agarwal et al., 2024, arXiv:2306.13649) on the distillation core.

The distillation trainer with the online core's asynchronous rollouts (docs/async.md: a producer thread samples
from the student's vLLM server ahead of training, at most `max_staleness` optimiser steps behind) and teachers on
vLLM servers (`teacher_server_urls`, scored on what they report: `online/teachers.py`). D_beta on the support
(`core/divergence.py`, "sparse supports"), both sides at `teacher_temperature`:

    beta = 0: the teacher's top-k (`teacher_top_k`) and the sampled token,  0 < beta < 1: its top-1 and the sampled
    token,  beta = 1: the sampled token; each with the tail bucket (`add_tail_bucket`) or renormalised.

Several teachers (TRL's multi-teacher, MOPD): each row names its teacher in a `teacher_id` column and is scored by that
one alone. The loss is normalised as the distillation trainer's (the step's completion tokens, all processes).
"""

import json
from dataclasses import dataclass

import torch

from ..core.config import document_fields, option
from ..online.teachers import Teacher, check_server_vocabulary, teacher_client
from .distillation import DistillationBatch, DistillationConfig, DistillationTrainer


@document_fields
@dataclass
class AsyncDistillationConfig(DistillationConfig):
    """Configuration of `AsyncDistillationTrainer`: every field of TRL 1.16's, same names and defaults (the teachers
    are servers: the local-teacher fields and `loss_top_k` / `loss_add_tail`, named otherwise here, do not apply)."""

    _inapplicable_fields = (
        *DistillationConfig._inapplicable_fields,
        *("teacher_model_name_or_path", "teacher_model_revision", "teacher_model_init_kwargs"),
        *("teacher_model_server_url", "teacher_weights", "loss_top_k", "loss_add_tail"),
    )
    _inapplicable_reason = "asynchronous distillation (its teachers are teacher_server_urls)"
    _unimplemented_fields = {
        **DistillationConfig._unimplemented_fields,
        "token_budget": "Micro-batches hold per_device_train_batch_size completions (TRL's fixed-count batching).",
        "log_completions_steps": "Completions are logged at each logging step (log_completions, logging_steps).",
    }

    logging_steps: float = option(1, "Log every X optimiser steps.")
    ignore_data_skip: bool = option(True, "TRL's default. A resume continues from the first prompt not trained on.")
    remove_unused_columns: bool | None = option(True, "TRL's default; every column is kept (`teacher_id` routes).")
    max_completion_length: int | None = option(2048, "Maximum length of the generated completion.")
    dtype: str = option("float32", "dtype the student is loaded in; a `dtype` in model_init_kwargs wins.")
    beta: float = option(0.0, "Generalized JSD interpolation: 0 forward KL (TRL's async default), 1 reverse KL.")
    use_vllm: bool = option(True, "Generate with a vLLM server (the only engine that runs beside training).")
    vllm_mode: str = option("server", "A separately started vLLM server (docs/async.md).")
    vllm_server_base_url: str | None = option("http://localhost:8000", "Base URL of the student's vLLM server.")
    async_rollouts: bool = option(True, "Sample ahead of training (always on here).")
    max_staleness: int = option(4, "Most optimiser steps between the weights that sampled and training.")
    teacher_server_urls: dict | str | None = option(
        None, "Teacher id -> vLLM server URL (a URL alone: one teacher); None: {'default': 'http://localhost:8001'}."
    )
    teacher_temperature: float = option(1.0, "Temperature of both sides of the loss (`temperature` only samples).")
    teacher_top_k: int = option(8, "Teacher log-probs requested per position (vLLM's prompt_logprobs).")
    add_tail_bucket: bool = option(True, "Add the tail bucket (the mass outside the support) on both sides.")
    token_budget: int | None = option(None, "TRL's tokens per packed micro-batch (not implemented: fixed-count).")
    log_completions_steps: int = option(100, "TRL's completion-logging interval (see _unimplemented_fields).")

    def __post_init__(self):
        if isinstance(self.teacher_server_urls, str):  # JSON, or one URL (TRL iterates a plain URL's characters)
            urls = self.teacher_server_urls.strip()
            self.teacher_server_urls = json.loads(urls) if urls.startswith("{") else {"default": urls}
        if self.teacher_server_urls is None:
            self.teacher_server_urls = {"default": "http://localhost:8001"}
        if not self.teacher_server_urls:
            raise ValueError("teacher_server_urls must have at least one entry.")
        if not (self.use_vllm and self.async_rollouts and self.vllm_mode == "server"):
            raise ValueError(
                "AsyncDistillationTrainer samples from a vLLM server ahead of training: use_vllm and async_rollouts "
                "must stay True with vllm_mode='server' (DistillationTrainer trains without a server)."
            )
        if self.teacher_top_k < 1 or self.teacher_temperature <= 0:
            raise ValueError(f"teacher_top_k={self.teacher_top_k} must be >= 1, teacher_temperature > 0.")
        super().__post_init__()
        self.ignore_data_skip = False  # the Trainer skips the batches already trained on (TRL: its own position)

    def _check_server_support(self) -> None:
        """Any top-k: the mixed and reverse supports are the top-1 and the sampled token whatever k is."""


@dataclass
class AsyncDistillationBatch(DistillationBatch):
    """A `DistillationBatch` with each row's teacher `teacher_index` `(B,)` (its `teacher_id`'s place)."""

    teacher_index: torch.Tensor | None = None


class AsyncDistillationTrainer(DistillationTrainer):
    """Asynchronous distillation (see the module docstring). TRL 1.16's constructor, then by keyword the online
    core's arguments (`eval_dataset`, `quantization_config`, `tools`, ...)."""

    _name = "AsyncDistillation"
    _tag_names = ["trl", "async-distillation", "trl_unified"]
    config_class = AsyncDistillationConfig
    batch_class = AsyncDistillationBatch
    logs_divergence = True
    support_includes_sampled = True  # TRL's: the reported candidates are the top-k plus the sampled token

    def __init__(
        self,
        model,
        args=None,
        train_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        rollout_worker=None,
        weight_transfer=None,
        **online_kwargs,
    ):
        if rollout_worker is not None or weight_transfer is not None:
            raise NotImplementedError(
                "rollout_worker / weight_transfer replace parts of TRL's worker process; here sampling is the online "
                "core's producer thread and weights reach the server as vllm_weight_transfer says."
            )
        super().__init__(
            model,
            None,
            args,
            train_dataset,
            online_kwargs.pop("eval_dataset", None),
            processing_class,
            callbacks,
            optimizers,
            peft_config=peft_config,
            **online_kwargs,
        )

    loss_top_k = property(lambda self: self.args.teacher_top_k)
    loss_add_tail = property(lambda self: self.args.add_tail_bucket)
    divergence_temperature = property(lambda self: self.args.teacher_temperature)
    model_version = property(lambda self: self.vllm_engine.version or 0)  # TRL's attribute

    def build_teachers(self, student_vocabulary: int) -> list[Teacher]:
        teachers = []
        for name, url in self.args.teacher_server_urls.items():
            check_server_vocabulary(url, student_vocabulary)
            client = teacher_client(url, self.args.vllm_server_timeout, self._where)
            teachers.append(Teacher(name, 1.0, client=client, url=url))
        self._teacher_ids = [t.name for t in teachers]  # TRL's attribute
        return teachers

    def _load_policy(self, model, args, quantization_config):
        if isinstance(model, str):  # TRL's `dtype` field, unless model_init_kwargs names one
            args.model_init_kwargs = {"dtype": args.dtype, **(args.model_init_kwargs or {})}
        return super()._load_policy(model, args, quantization_config)

    def _remove_unused_columns(self, dataset, description=None):
        return dataset  # `teacher_id` routes each row, as in TRL's trainer

    def score_rollout(self, batch: AsyncDistillationBatch, samples, mode: str) -> None:
        super().score_rollout(batch, samples, mode)
        if len(self.teachers) > 1:  # each row's teacher (TRL's error on a row naming none of them)
            names = self._teacher_ids
            for row in samples.rows:
                if row.get("teacher_id") not in names:
                    raise ValueError(
                        f"Example has `teacher_id={row.get('teacher_id')!r}`, which is not among the teachers passed "
                        f"to `teacher_server_urls`. Expected one of: {names}."
                    )
            index = [names.index(row["teacher_id"]) for row in samples.rows]
            batch.teacher_index = torch.tensor(index, device=batch.prompt_ids.device)
