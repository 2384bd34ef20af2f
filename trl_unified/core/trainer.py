"""`PolicyTrainerBase`: the plumbing every policy trainer shares, written once on top of `transformers.Trainer`."""

import inspect
import logging
import math
import os
import warnings
from collections import defaultdict
from typing import Any

import torch
from accelerate.utils import gather_object, is_peft_model, set_seed
from datasets import Dataset, IterableDataset
from transformers import Trainer

from ..data.batch import TensorBatch
from ..data.datasets import check_dataset_types, check_images_fit, configure_iterable_loading, has_iterable
from ..evaluation.generative import GenerativeEvalMixin
from ..generation import build_generation_config, generate_batched, get_eos_token_ids
from ..generation.sharing import may_share_prefix, unsupported_reason
from ..hub.model_card import write_model_card
from ..hub.papers import PAPERS
from ..models.loading import (
    apply_peft,
    base_model,
    check_liger_kernel,
    default_output_dir,
    disable_dropout,
    get_tokenizer,
    load_model,
    load_processing_class,
    moe_aux_loss_setup,
)
from ..models.token_ids import embedding_rows, in_table, saved_without_unusable_pad
from .config import PolicyConfig
from .engines import warn_if_engine_differs
from .logprobs import TokenLogprobs, compute_token_logprobs, position_ids_from_mask
from .reference import ReferenceModel
from .shutdown import install_distributed_shutdown, release_ddp_wrapper


logger = logging.getLogger(__name__)

# compute_token_logprobs' options, read off its signature: every other keyword is a model input (position ids too)
_LOGPROB_OPTIONS = set(inspect.signature(compute_token_logprobs).parameters) - {
    "model", "input_ids", "attention_mask", "logits_to_keep", "position_ids", "forward_kwargs"
}  # fmt: skip


class PolicyTrainerBase(GenerativeEvalMixin, Trainer):
    """Base of every trl_unified trainer: model loading, reference model, generation, log-probs, evaluation with
    generative accuracy, metric logging, model cards. A subclass declares `_name` and `config_class` and implements
    `compute_policy_loss(model, inputs, num_items_in_batch)` → loss or `(loss, outputs)`; the hooks run after
    `transformers.Trainer.__init__`, in this order: `prepare_dataset(dataset, name)`, `needs_reference()` /
    `reference_is_policy()`, `make_data_collator()`, `setup()` (docs/architecture.md, "One hook style, one order")."""

    _name = "Policy"
    _tag_names: list[str] = ["trl_unified"]
    _paper: dict[str, str] | None = None
    config_class = PolicyConfig
    # Switches of every log-prob forward, read by `token_logprobs` (the loss scale: Trainer's `loss_is_scaled_for_ga`).
    repeats_prompts = False
    positions_from_mask = False

    def __init_subclass__(cls, **kwargs):
        """A subclass names itself once (`_name = "RLOO"`): its Hub tags and its paper (`PAPERS["rloo"]`, if there
        is one) follow, unless it sets `_tag_names` / `_paper` itself."""
        super().__init_subclass__(**kwargs)
        key = cls._name.lower()
        cls._tag_names = cls.__dict__.get("_tag_names", ["trl", key, "trl_unified"])
        cls._paper = cls.__dict__.get("_paper", PAPERS.get(key))

    def __init__(
        self,
        model,
        args: PolicyConfig | None = None,
        data_collator=None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset=None,
        processing_class=None,
        ref_model=None,
        callbacks=None,
        optimizers=(None, None),
        compute_metrics=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
        generative_metrics=None,
    ):
        args = args or self.config_class(output_dir=default_output_dir(model, self._name))
        set_seed(args.seed)  # a PEFT adapter's initialisation must be reproducible
        model = self._load_policy(model, args, quantization_config)
        processing_class = load_processing_class(processing_class, model, args)
        self._sync_pad_token(model, processing_class)
        model, adapter_is_pretrained = apply_peft(model, peft_config, args)
        self.adapter_is_pretrained = adapter_is_pretrained  # the policy arrived with a trained PEFT adapter
        check_liger_kernel(model, args)
        if is_peft_model(model) and args.gradient_checkpointing:  # frozen embeddings must pass gradients on
            model.enable_input_require_grads()
        if args.disable_dropout:
            disable_dropout(model)
        check_dataset_types(train_dataset, eval_dataset)
        configure_iterable_loading(args, train_dataset, eval_dataset)
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._metric_reductions: dict[str, str] = {}  # metric name -> "max" / "min" / "sum" (default: the mean)
        self._pending_eval_metrics = {}
        self.generative_metrics = list(generative_metrics or [])
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        warn_if_engine_differs(self.accelerator, self.args)
        self.eos_token_ids = get_eos_token_ids(self.model, processing_class)
        self.train_dataset = self.prepare_dataset(train_dataset, "train")
        self.eval_dataset = self._prepare_eval_datasets(eval_dataset)
        self.reference_model = ReferenceModel.build(
            self.model,
            ref_model,
            self.args,
            self.needs_reference(),
            adapter_is_pretrained,
            quantization_config,
            policy_is_reference=self.reference_is_policy(),
        )
        self.reference_model.prepare(self.accelerator)
        if data_collator is None:
            self.data_collator = self.make_data_collator() or self.data_collator
        self.aux_loss_enabled, self.router_aux_loss_coef = moe_aux_loss_setup(self.model, self.args)
        set_seed(self.args.seed)  # one seed everywhere: accelerate derives the shared shuffling from it
        self.setup()
        self._check_shared_prefix_support()
        self.sync_reference_every_steps()
        install_distributed_shutdown()  # see core/shutdown.py: no SIGABRT at exit
        if hasattr(self.model, "add_model_tags"):
            self.model.add_model_tags(self._tag_names)

    @staticmethod
    def _sync_pad_token(model, processing_class) -> None:
        """The tokenizer's pad id into the model's config and generation config (as TRL), unless it lies beyond the
        embedding table: a pad added without resizing (TRL's PPO recipe) is masked in every forward and kept out of
        the configs, so that the saved model loads."""
        tokenizer, base = get_tokenizer(processing_class), base_model(model)
        if tokenizer.pad_token_id is not None and not in_table(tokenizer.pad_token_id, embedding_rows(base)):
            return
        base.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.pad_token_id = tokenizer.pad_token_id

    def _prepare_eval_datasets(self, eval_dataset):
        if isinstance(eval_dataset, dict):
            return {name: self.prepare_dataset(dataset, name) for name, dataset in eval_dataset.items()}
        return self.prepare_dataset(eval_dataset, "eval")

    # ------------------------------------------------------------------ hooks for subclasses (see the class docstring)
    def prepare_dataset(self, dataset, name: str):
        """Validate / tokenise a dataset before training (called once per dataset; `name` is "train", "eval" or the
        key of an eval dict). The base checks that image columns meet a vision-language model."""
        check_images_fit(dataset, self.processing_class, self.model)
        return dataset

    def needs_reference(self) -> bool:
        """Whether the algorithm uses a reference model (by default: `args.uses_reference_model()`)."""
        return self.args.uses_reference_model()

    def reference_is_policy(self) -> bool:
        """Whether the untrained policy itself may serve as reference when no ref_model is given (see
        `ReferenceModel`: only when every reference output is computed before training)."""
        return False

    def make_data_collator(self):
        """The collator used when the user passes none (None: `transformers.Trainer`'s default)."""
        return None

    def setup(self) -> None:
        """One-time set-up after the datasets, the reference and the collator are in place."""

    def compute_policy_loss(self, model, inputs, num_items_in_batch=None):
        """The algorithm's loss for one micro-batch. Return the loss, or `(loss, model_outputs)`."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_policy_loss.")

    def generation_options(self) -> dict[str, Any]:
        """Extra `generate_batched` arguments from the config (e.g. `gather_deepspeed3_params`)."""
        return {}

    def eval_prompt(self, row: dict[str, Any]):
        """The prompt generated from during generative evaluation."""
        return row["prompt"]

    def reference_answer(self, row: dict[str, Any]):
        """The reference answer of an eval row (a value, or a list of accepted values), or None when it has none."""
        return row.get(self.args.eval_answer_field)

    @property
    def reference(self):
        """Deprecated name of `reference_model` (removed in trl_unified 0.3)."""
        warnings.warn("trainer.reference is deprecated: use trainer.reference_model.", DeprecationWarning, 2)
        return self.reference_model

    @property
    def ref_model(self):
        """The separate reference model, as TRL's attribute (None when there is none: no reference, a PEFT policy
        with its adapter disabled, or the policy itself before training)."""
        return self.reference_model.model if self.reference_model.kind == "copy" else None

    def sync_reference_every_steps(self) -> None:
        """With `args.sync_ref_model`, add TRL's `SyncRefModelCallback` (TR-DPO: every `ref_model_sync_steps`,
        π_ref ← α π_θ + (1 - α) π_ref). Only a separate reference model can be synced."""
        if not self.args.sync_ref_model:
            return
        if self.reference_model.kind != "copy":
            raise NotImplementedError(
                "You passed `sync_ref_model=True` while using a PEFT model, which is currently not supported: "
                "the reference is the policy with its adapter disabled, there is no separate model to sync."
            )
        from trl import SyncRefModelCallback

        self.add_callback(SyncRefModelCallback(ref_model=self.reference_model.model, accelerator=self.accelerator))

    def add_aux_loss(self, loss: torch.Tensor, aux_loss: torch.Tensor | None, scale: float = 1.0) -> torch.Tensor:
        """`loss + router_aux_loss_coef * aux_loss * scale` when the MoE load-balancing loss is enabled (and logged as
        `aux_loss`); `loss` unchanged otherwise."""
        if not self.aux_loss_enabled or aux_loss is None:
            return loss
        self.log_metric("aux_loss", self.accelerator.gather(aux_loss.detach()).mean().item())
        return loss + self.router_aux_loss_coef * aux_loss * scale

    # ------------------------------------------------------------------ model loading
    def _load_policy(self, model, args, quantization_config):
        if isinstance(model, str):
            return load_model(model, args, quantization_config)
        if args.model_init_kwargs is not None or quantization_config is not None:
            logger.warning(
                "model is already instantiated, so args.model_init_kwargs and quantization_config are not used. "
                "Pass the model id instead to apply them."
            )
        return model

    # ------------------------------------------------------------------ generation and log-probs
    @property
    def generation_config(self):
        """TRL's attribute: the `GenerationConfig` training samples with (`make_generation_config()`)."""
        return self.make_generation_config()

    def make_generation_config(self, do_sample: bool = True, max_new_tokens: int | None = None):
        """`GenerationConfig` from the trainer's config (sampling for training, greedy for evaluation by default)."""
        model = self.accelerator.unwrap_model(self.model)
        return build_generation_config(
            self.args, self.processing_class, self.eos_token_ids, do_sample, max_new_tokens, model.config
        )

    def generate(
        self,
        prompts,
        images=None,
        do_sample: bool = True,
        max_new_tokens: int | None = None,
        batch_size=None,
        videos=None,
        return_logprobs: bool = False,
    ):
        """`generate_batched` with the policy, this trainer's accelerator and generation settings."""
        return generate_batched(
            self.model_wrapped if self.model_wrapped is not None else self.model,
            self.processing_class,
            prompts,
            generation_config=self.make_generation_config(do_sample, max_new_tokens),
            batch_size=batch_size,
            accelerator=self.accelerator,
            images=images,
            videos=videos,
            chat_template_kwargs=self.args.chat_template_kwargs,
            eos_token_ids=self.eos_token_ids,
            lean_decoding=self.args.lean_decoding,
            return_logprobs=return_logprobs,
            **self.generation_options(),
        )

    @property
    def logprob_temperature(self) -> float:
        """The temperature log-probs are taken at: the sampling temperature (TRL's RLOO, GRPO, PPO), or 1.0 for a
        trainer whose loss reads the policy itself (online DPO)."""
        return self.args.temperature

    def token_logprobs(self, model, input_ids, attention_mask, logits_to_keep, **kwargs) -> TokenLogprobs:
        """Per-token log-probs of the last `logits_to_keep` tokens under `model`, at the sampling temperature, under
        autocast; `compute_token_logprobs`'s options pass through. Class attributes: `repeats_prompts` (rows repeat
        their prompt: each prompt encoded once where `uses_shared_prefix` allows it) and `positions_from_mask`
        (position ids that skip left padding: TRL's PPO). `args.padding_free`: docs/padding_free.md."""
        kwargs.setdefault("from_hidden_states", self.args.chunked_lm_head)
        kwargs.setdefault("padding_free", self.args.padding_free)
        if self.positions_from_mask and not kwargs["padding_free"]:  # packed rows count positions so already
            kwargs.setdefault("position_ids", position_ids_from_mask(attention_mask))
        if self.repeats_prompts and "shared_prefix" not in kwargs and not kwargs["padding_free"]:
            extra = {k: v for k, v in kwargs.items() if k not in _LOGPROB_OPTIONS}  # e.g. position ids may rule it out
            router_logits = kwargs.get("output_router_logits", False)
            kwargs["shared_prefix"] = self.uses_shared_prefix(model, "log-prob forward", extra, router_logits)
        with self.accelerator.autocast():
            return compute_token_logprobs(
                model, input_ids, attention_mask, logits_to_keep, temperature=self.logprob_temperature, **kwargs
            )

    def uses_shared_prefix(self, model, where: str, extra=None, router_logits=False, **conditions) -> bool:
        """Whether `where` (e.g. "log-prob forward") encodes repeated prompts once (`args.shared_prefix`): the one
        decision of `generation/sharing.py` (`may_share_prefix`: the model, extra inputs such as images, the MoE loss,
        beam search, continuous batching), a fallback reported once with its reason."""
        return self.args.shared_prefix is not False and may_share_prefix(
            where, model, extra, router_logits=router_logits, **conditions
        )

    def _check_shared_prefix_support(self) -> None:
        if self.args.shared_prefix is True:
            with torch.no_grad():
                reason = unsupported_reason(self.model)
            if reason is None and self.args.gradient_checkpointing:
                reason = "gradient checkpointing drops the KV cache in a forward with grad"
            if reason is not None:
                raise ValueError(f"shared_prefix=True, but {reason}. Use shared_prefix=None (auto) or False.")

    def reference_logprobs(self, input_ids, attention_mask, logits_to_keep, **kwargs) -> torch.Tensor:
        """Per-token log-probs under the reference model (no grad, eval mode)."""
        with torch.no_grad(), self.reference_model.use(self.accelerator, self.model) as ref_model:
            return self.token_logprobs(ref_model, input_ids, attention_mask, logits_to_keep, **kwargs).logps

    # ------------------------------------------------------------------ loss and evaluation loop
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = self.compute_policy_loss(model, inputs, num_items_in_batch)
        loss, outputs = result if isinstance(result, tuple) else (result, None)
        if return_outputs and outputs is None:
            raise ValueError(f"{type(self).__name__}.compute_loss cannot return model outputs.")
        return (loss, outputs) if return_outputs else loss

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            release_ddp_wrapper(self)

    def _prepare_inputs(self, inputs):
        return inputs.to(self.args.device) if isinstance(inputs, TensorBatch) else super()._prepare_inputs(inputs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            result = self.compute_policy_loss(model, inputs, None)
        loss, outputs = result if isinstance(result, tuple) else (result, None)
        if prediction_loss_only or self.compute_metrics is None:  # logits are kept only for compute_metrics
            return loss.detach(), None, None
        return loss.detach(), *self.prediction_outputs(model, inputs, outputs)

    def prediction_outputs(self, model, inputs, outputs):
        """`(logits, labels)` for `compute_metrics`: by default the loss forward's logits and the batch's labels."""
        return (outputs.logits.detach(), inputs.get("labels")) if outputs is not None else (None, None)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Eval loss and metrics as `Trainer.evaluate`, plus generative accuracy (see `evaluate_generations`)."""
        if has_iterable(eval_dataset):  # passed here, after the accelerator was built: read as rows, per process
            self.accelerator.dataloader_config.dispatch_batches = False
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        dataset = self.eval_dataset[dataset] if isinstance(dataset, str) else dataset
        if not isinstance(dataset, dict):  # a dict recurses into evaluate() once per dataset
            self._pending_eval_metrics = self.evaluate_generations(dataset, metric_key_prefix)
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._pending_eval_metrics = {}

    def evaluation_loop(self, *args, **kwargs):
        output = super().evaluation_loop(*args, **kwargs)
        output.metrics.update(self._pending_eval_metrics)
        return output

    # ------------------------------------------------------------------ logging
    @property
    def mode(self) -> str:
        """`"train"` or `"eval"`: the policy's mode, which decides where metrics go and what a rollout computes."""
        return "train" if self.model.training else "eval"

    def log_metric(self, name: str, value: float, reduce: str = "mean") -> None:
        """Record a metric for the current mode; `log()` reduces it over the logging window and processes: its mean,
        or with `reduce` its `"max"`, `"min"` or `"sum"` (e.g. a count: TRL's `*_total` metrics)."""
        self._metrics[self.mode][name].append(float(value))
        if reduce != "mean":
            self._metric_reductions[name] = reduce

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = self.mode
        local = {k: [v for v in vals if not math.isnan(v)] for k, vals in self._metrics[mode].items()}
        merged: dict[str, list[float]] = defaultdict(list)
        for process_metrics in gather_object([local]) if self.accelerator.num_processes > 1 else [local]:
            for key, values in process_metrics.items():
                merged[key].extend(values)
        prefix = "eval_" if mode == "eval" else ""
        for key, values in sorted(merged.items()):  # num_tokens, a running total, reports the latest
            reduce = {"max": max, "min": min, "sum": sum}.get(self._metric_reductions.get(key))
            value = (reduce(values) if reduce else sum(values) / len(values)) if values else None
            logs[f"{prefix}{key}"] = float(self.state.num_input_tokens_seen) if key == "num_tokens" else value
        self._metrics[mode].clear()
        super().log(logs, start_time)

    # ------------------------------------------------------------------ saving
    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None, **kwargs):
        """Write README.md (trainer, base model, datasets, tags, the algorithm's paper) into `output_dir`."""
        if self.is_world_process_zero():
            write_model_card(self, model_name=model_name, dataset_name=dataset_name, tags=tags)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """`Trainer.save_model`, plus the model card (README.md) beside the weights."""
        with saved_without_unusable_pad(self.accelerator.unwrap_model(self.model)):  # the saved model must load
            super().save_model(output_dir, _internal_call)
        if self.is_world_process_zero():
            write_model_card(self, output_dir=output_dir or self.args.output_dir)

    def _save_checkpoint(self, model, trial):
        self.create_model_card(model_name=self.args.hub_model_id or os.path.basename(self.args.output_dir))
        super()._save_checkpoint(model, trial)
