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
import types
from dataclasses import dataclass

import torch

from ..core.config import document_fields, option
from ..core.divergence import generalized_jsd_loss, reduce_divergence, token_divergence
from ..core.lm_head import HiddenStateHead
from ..core.logprobs import position_ids_from_mask
from ..core.reference import prepare_frozen_model
from ..generation import generate_batched
from ..generation.fallbacks import report_fallback
from ..generation.packed_weights import packed_linear_weights
from ..generation.sharing import PrefixSharingUnsupported, cache_kwarg, common_prefix, common_prefix_cache
from ..models.loading import get_tokenizer, load_model
from ..models.token_ids import embedding_rows, mask_padding
from ..online.completions import CompletionMix, SampledCompletions
from ..online.config import OnlineConfig
from ..online.rollout import RolloutBatch, RolloutPlan, Samples
from ..online.trainer import OnlineTrainer


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

    def __post_init__(self):
        if isinstance(self.teacher_model_init_kwargs, str):
            self.teacher_model_init_kwargs = json.loads(self.teacher_model_init_kwargs)
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")
        super().__post_init__()

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


class DistillationTrainer(OnlineTrainer):
    """On-policy distillation (see the module docstring). Same constructor as `trl.DistillationTrainer` 1.16."""

    _name = "Distillation"
    _tag_names = ["trl", "distillation", "trl_unified"]
    config_class = DistillationConfig
    batch_class = DistillationBatch
    loss_is_scaled_for_ga = True
    # TRL 1.10's static loss API (GKDTrainer's too): the loss below goes through `_reduce_divergence_loss`
    generalized_jsd_loss = staticmethod(generalized_jsd_loss)
    _reduce_divergence_loss = staticmethod(reduce_divergence)

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

    def setup(self) -> None:
        super().setup()
        args, teacher = self.args, self._teacher_source
        teacher = teacher if teacher is not None else args.teacher_model_name_or_path
        if teacher is None:
            raise ValueError(
                "DistillationTrainer needs a teacher: pass teacher_model= (a model or an id / path) or set "
                "args.teacher_model_name_or_path."
            )
        if isinstance(teacher, str):
            kwargs = dict(args.teacher_model_init_kwargs or {})
            if args.teacher_model_revision is not None:
                kwargs.setdefault("revision", args.teacher_model_revision)
            loading = types.SimpleNamespace(
                model_init_kwargs=kwargs,
                distributed_state=args.distributed_state,
                trust_remote_code=args.trust_remote_code,
            )
            teacher = load_model(teacher, loading, what="teacher model")
        elif args.teacher_model_init_kwargs is not None:
            raise ValueError(
                "You passed teacher_model_init_kwargs to the config, but your teacher_model is already instantiated."
            )
        student = self.accelerator.unwrap_model(self.model).config.get_text_config().vocab_size
        vocabulary = teacher.config.get_text_config().vocab_size
        if student != vocabulary:
            raise ValueError(
                f"The student model has vocab_size {student} but the teacher model has vocab_size {vocabulary}. "
                "Distillation compares the teacher's full next-token distribution, which requires a shared "
                "vocabulary. Use a teacher with the same vocab_size."
            )
        self.teacher_model = prepare_frozen_model(teacher.requires_grad_(False), self.accelerator)
        del self._teacher_source
        self.mix = self.completion_mix()

    # ------------------------------------------------------------------ the rollout: no reward, no ratio
    def completion_mix(self) -> CompletionMix:
        """Where each round's completions come from: always the student's samples (on-policy distillation); GKD mixes
        in the dataset's or the teacher's."""
        return CompletionMix()

    @property
    def divergence_temperature(self) -> float:
        """The temperature both models' logits are divided by in D: the sampling temperature (TRL's
        DistillationTrainer); GKD's loss reads the models themselves (1.0)."""
        return self.args.temperature

    def sample_completions(self, rows, prompts, images, environments) -> SampledCompletions:
        source = self.mix.draw(self.mode)
        if source == "policy":
            return super().sample_completions(rows, prompts, images, environments)
        if source == "dataset":
            return self.given_completions(prompts, [row["completion_ids"] for row in rows], conversational=False)
        return self.teacher_samples(prompts)

    def teacher_samples(self, prompts) -> SampledCompletions:
        """The teacher's own completions of `prompts` (sequence-level KD), with the student's sampling settings."""
        out = generate_batched(
            self.teacher_model,
            self.processing_class,
            prompts,
            generation_config=self.make_generation_config(),
            accelerator=self.accelerator,
            chat_template_kwargs=self.args.chat_template_kwargs,
            eos_token_ids=self.eos_token_ids,
            lean_decoding=self.args.lean_decoding,
            pad_to_multiple_of=self.args.pad_to_multiple_of,
        )
        prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(out.prompt_ids, out.prompt_mask, strict=True)]
        return self.given_completions(prompt_ids, out.completion_ids_list, conversational=False)

    def rollout_plan(self) -> RolloutPlan:
        return RolloutPlan(old_logps_train=False, old_logps_eval=False)  # no ratio in the loss: π_old is never read

    def build_rewards(self) -> None:
        return None  # the teacher's distributions are the signal

    def score_rollout(self, batch: RolloutBatch, samples: Samples, mode: str) -> None:
        """No rewards and no advantages: the round is only logged."""
        batch.rewards = torch.zeros(len(batch), device=batch.prompt_ids.device)
        prompts = samples.prompts
        if prompts and isinstance(prompts[0], list) and prompts[0] and isinstance(prompts[0][0], int):
            prompts = get_tokenizer(self.processing_class).batch_decode(prompts, skip_special_tokens=True)
        self.completion_log.add_round(
            prompts=prompts,
            completions=samples.completions,
            images=samples.images,
            rewards=None,
            rewards_per_func=None,
            reward_names=[],
            advantages=None,
            log_images=self.args.log_multimodal,
        )

    # ------------------------------------------------------------------ the loss
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
        divergence, entropy = self.token_divergence(model, input_ids, attention_mask, completion_ids.size(1), mask)
        loss = self._reduce_divergence_loss(divergence, completion_mask=mask, num_items_in_batch=num_items_in_batch)
        self.log_metric("entropy", self.masked_global_mean(entropy, mask))
        return loss

    def labelled_loss(self, model, inputs, num_items_in_batch=None):
        """The loss of a batch in TRL's keys (GKD's collator, TRL 1.10's distillation batches): `input_ids`,
        `attention_mask`, `labels` (-100 off the completion); D at every position whose next token is labelled,
        summed and divided by `num_items_in_batch` when given, else averaged over those positions."""
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        mask = (inputs["labels"][:, 1:] != -100).long()
        divergence, _ = self.token_divergence(model, input_ids, attention_mask, input_ids.size(1) - 1, mask)
        return self._reduce_divergence_loss(divergence, completion_mask=mask, num_items_in_batch=num_items_in_batch)

    def token_divergence(self, model, input_ids, attention_mask, width: int, mask=None):
        """`(D, student entropy)` `(B, C)` of the last `width` tokens, at `mask`'s positions if given (0 elsewhere):
        from both models' final hidden states in chunks (a common prompt prefix encoded once where `shared_prefix`
        allows), else from their logits (ZeRO-3 / FSDP shards, a compiled model); docs/distillation.md."""
        self.teacher_model.eval()
        student = teacher = student_hidden = teacher_hidden = None
        if self.args.chunked_lm_head:
            student, teacher = HiddenStateHead.of(model), HiddenStateHead.of(self.teacher_model)
        if student is not None and teacher is not None:
            shared = all(self.uses_shared_prefix(m, "distillation forward") for m in (model, self.teacher_model))
            layout = common_prefix(input_ids, attention_mask, input_ids.size(1) - width) if shared else None
            # The frozen teacher first, its float32 CPU linear weights packed once for the pass (freed before the
            # student's activations exist): each product would otherwise repack its weight (generation/packed_weights)
            with torch.no_grad(), packed_linear_weights(teacher.decoder, input_ids.numel()):
                teacher_hidden = self._hidden(teacher, input_ids, attention_mask, width, layout)
            student_hidden = self._hidden(student, input_ids, attention_mask, width, layout)
        if student_hidden is None or teacher_hidden is None:
            return self._divergence_from_logits(model, input_ids, attention_mask, width)
        real = None if mask is None or bool(mask.all()) else mask.bool()
        if real is not None:  # only the positions the loss reads go to the vocabulary
            student_hidden, teacher_hidden = student_hidden[real][None], teacher_hidden[real][None]
        linear = (student.linear(), teacher.linear())  # both plain linear heads: the gradient in the forward
        divergence, entropy = token_divergence(
            student_hidden, teacher_hidden, student.head, teacher.head, self.args.beta, self.divergence_temperature,
            student.transform, teacher.transform, linear=None if None in linear else linear,
        )  # fmt: skip
        if real is None:
            return divergence, entropy
        return tuple(v.new_zeros(real.shape).masked_scatter(real, v[0]) for v in (divergence, entropy))

    def _hidden(self, head: HiddenStateHead, input_ids, attention_mask, width, layout=None):
        """The final hidden states `(B, width, H)` that predict the last `width` tokens, or None where they do not
        reproduce the model's logits. With a `common_prefix` layout `(k, order)`, the rows' first `k` tokens are
        encoded once and the rest of each row runs on that cache (positions counted over real tokens)."""
        input_ids = mask_padding(input_ids, attention_mask, embedding_rows(head.model))
        kwargs = {"use_cache": False, **head.keep_one()}
        if layout is not None:
            k, order = layout
            input_ids, attention_mask = input_ids.gather(1, order), attention_mask.gather(1, order)
            positions = position_ids_from_mask(attention_mask)
            try:
                cache = common_prefix_cache(head.model, input_ids, attention_mask, positions, k)
                kwargs.update({"use_cache": True, "position_ids": positions[:, k:], cache_kwarg(head.model): cache})
                input_ids = input_ids[:, k:]
            except PrefixSharingUnsupported as e:
                report_fallback("distillation forward", str(e))
        with self.accelerator.autocast(), head.capture():
            out = head.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if not head.matches(out.logits):
            return None
        return head.hidden[:, -(width + 1) : -1]  # position i predicts completion token i

    def _divergence_from_logits(self, model, input_ids, attention_mask, width):
        def logits(m):
            ids = mask_padding(input_ids, attention_mask, embedding_rows(self.accelerator.unwrap_model(m)))
            return m(input_ids=ids, attention_mask=attention_mask, logits_to_keep=width + 1).logits[:, :-1]

        student_logits = logits(model)
        with torch.no_grad():
            teacher_logits = logits(self.teacher_model)
        temperature = self.divergence_temperature
        terms = self.generalized_jsd_loss(
            student_logits, teacher_logits, beta=self.args.beta, temperature=temperature, reduction="none"
        )
        with torch.no_grad():
            log_probs = torch.log_softmax(student_logits.float() / temperature, dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        return terms.sum(-1), entropy
