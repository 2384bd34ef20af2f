r"""Generative reward models (GRM): a judge trained to write its reasoning and an answer, text or vision-language.

Training is next-token prediction on the judgment only (Zhang et al., 2024, "Generative Verifiers", arXiv:2408.15240).
With m_t = 1 on judgment tokens (prompt and padding are masked, label -100) and N the number of judgment tokens in
the whole gradient-accumulation step across all processes (`num_items_in_batch`):

    L = -(1/N) * sum_{micro-batches, rows, t} m_t * log p_theta(x_t | x_<t)

so every judgment token weighs the same whatever the micro-batch split: (bs 4, GA 2) gives the update of (bs 8, GA 1).
Evaluation adds the base's generative accuracy: judgments are generated for the eval prompts, the answer is read
with `answer_extractor`, and compared with the row's reference answer (`eval_answer_field`, or the answer inside the
row's own reference judgment).
"""

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from datasets import IterableDataset
from trl import prepare_multimodal_messages

from ..base.answers import extract_answer
from ..base.config import PolicyConfig, document_fields
from ..base.data import (
    column_names,
    get_images,
    is_conversational_prompt,
    pad,
    split_prompt_completion,
    tokenize_prompt_completion,
)
from ..base.trainer import PolicyTrainerBase


@document_fields
@dataclass
class GRMConfig(PolicyConfig):
    """Configuration of `GRMTrainer`: `trl.SFTConfig`'s names for the fields that mean the same, plus the base's
    generative-evaluation fields (`max_completion_length` = tokens per generated judgment, `answer_extractor`,
    `eval_answer_field`)."""

    _unimplemented_fields = {
        "packing": "Sequence packing is not implemented; rows are padded per batch.",
        "padding_free": "Padding-free batches are not implemented; rows are padded per batch.",
        "loss_type": "Only the negative log-likelihood ('nll') is implemented.",
    }

    learning_rate: float = field(default=2e-5, metadata={"help": "Initial AdamW learning rate."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Maximum tokens per row (prompt + judgment). None: no truncation."}
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={
            "help": "'keep_start' drops the end of a too-long row, 'keep_end' its beginning (the prompt's start)."
        },
    )
    completion_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Loss on the judgment only (prompt masked). None: True for prompt/completion and messages rows."
        },
    )
    assistant_only_loss: bool = field(
        default=False,
        metadata={
            "help": "For 'messages' rows: loss on every assistant turn (needs {% generation %} in the chat template)."
        },
    )
    dataset_text_field: str = field(
        default="text", metadata={"help": "Column of plain-text rows (no prompt: loss on all)."}
    )
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used to tokenise the dataset."})
    eos_token: str | None = field(
        default=None, metadata={"help": "Token appended to standard completions. None uses the tokenizer's EOS."}
    )
    packing: bool = field(default=False, metadata={"help": "Pack rows into max_length blocks (not implemented)."})
    padding_free: bool = field(default=False, metadata={"help": "Flatten batches without padding (not implemented)."})
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"help": "Pad each batch's length to a multiple of this."}
    )
    loss_type: str = field(default="nll", metadata={"help": "Loss: 'nll' (negative log-likelihood of the judgment)."})

    def __post_init__(self):
        super().__post_init__()
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode={self.truncation_mode!r} is not one of ['keep_end', 'keep_start'].")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length={self.max_length} must be >= 2 (or None for no truncation).")


class GRMTrainer(PolicyTrainerBase):
    """Train a generative reward model (see the module docstring). Same constructor as `trl.SFTTrainer`."""

    _name = "GRM"
    config_class = GRMConfig

    def __init__(
        self,
        model,
        args: GRMConfig | None = None,
        data_collator=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        compute_loss_func=None,
        compute_metrics=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        preprocess_logits_for_metrics=None,
        quantization_config=None,
        peft_config=None,
        formatting_func=None,
    ):
        for name, value in (
            ("compute_loss_func", compute_loss_func),
            ("optimizer_cls_and_kwargs", optimizer_cls_and_kwargs),
        ):
            if value is not None:
                raise NotImplementedError(f"{name} is not supported by GRMTrainer: the loss is the judgment NLL.")
        self.formatting_func = formatting_func
        super().__init__(
            model,
            args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            quantization_config=quantization_config,
            peft_config=peft_config,
        )
        self.loss_is_scaled_for_ga = True  # divided by num_items_in_batch, the judgment tokens of the whole step
        self.model_accepts_loss_kwargs = True  # so the Trainer counts num_items_in_batch from the labels

    # ------------------------------------------------------------------ data
    def prepare_dataset(self, dataset, processing_class, args, name):
        if dataset is None:
            if name == "train":
                raise ValueError("train_dataset is required: GRMTrainer needs judging rows to learn from.")
            return None
        streaming = isinstance(dataset, IterableDataset)
        columns = column_names(dataset) or (list(next(iter(dataset), {})) if streaming else [])
        if self.formatting_func is not None:
            self._check_formatting_func(columns, args)
            dataset = dataset.map(lambda row: {args.dataset_text_field: self.formatting_func(row)})
            columns = [*columns, args.dataset_text_field]
        if not streaming and len(dataset) == 0:
            raise ValueError(f"{name} dataset is empty: GRMTrainer needs at least one row.")
        if not (
            {"prompt", "completion"} <= set(columns) or "messages" in columns or args.dataset_text_field in columns
        ):
            raise ValueError(
                f"{name} dataset has columns {columns}, but GRMTrainer needs the judgment: 'prompt' + 'completion' "
                "(the judgment), 'messages' (the judgment as the last assistant turn), "
                f"or {args.dataset_text_field!r}."
            )
        if any(c in columns for c in ("image", "images")):
            return dataset  # vision-language rows are tokenised with their images in the collator
        # IterableDataset.map takes neither num_proc nor desc: streaming rows are tokenised as they are read.
        map_kwargs = {} if streaming else {"num_proc": args.dataset_num_proc, "desc": f"Tokenizing {name} dataset"}
        return dataset.map(
            _tokenize_row,
            fn_kwargs={"processing_class": processing_class, "args": args},
            with_indices=True,
            **map_kwargs,
        )

    @staticmethod
    def _check_formatting_func(columns, args):
        """As `trl.SFTTrainer`: a formatting function turns rows into plain text, which has no prompt to mask."""
        judgment_rows = {"prompt", "completion"} <= set(columns) or "messages" in columns
        if args.completion_only_loss or (args.completion_only_loss is None and judgment_rows):
            raise ValueError(
                "A formatting function was provided while `completion_only_loss=True`, which is incompatible. "
                f"The dataset has columns {columns}: GRMTrainer would train on the judgment only, but a formatting "
                "function turns each row into one text with no prompt to mask. Drop formatting_func (the "
                "prompt/completion or messages rows are used as they are), or set completion_only_loss=False to "
                "train on the whole formatted text."
            )

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = [
                "input_ids",
                "completion_mask",
                "prompt",
                "completion",
                "messages",
                "image",
                "images",
                self.args.dataset_text_field,
            ]

    def make_data_collator(self, processing_class, args):
        return _GRMCollator(processing_class, args)

    # ------------------------------------------------------------------ loss
    def compute_policy_loss(self, model, inputs, num_items_in_batch=None):
        labels = inputs["labels"]
        outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
        logits, targets = outputs.logits[:, :-1, :], labels[:, 1:]  # (B, T-1, V), (B, T-1): position t predicts t+1
        nll = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-100, reduction="sum"
        )
        mask = targets != -100
        if num_items_in_batch is None:  # evaluation: mean over this batch's judgment tokens
            loss = nll / mask.sum().clamp(min=1)
        else:
            loss = nll / num_items_in_batch
            if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
                loss = loss * self.accelerator.num_processes  # N counts every process; DDP averages gradients
        with torch.no_grad():
            correct = (logits.argmax(-1) == targets) & mask
            self.log_metric("mean_token_accuracy", (correct.sum() / mask.sum().clamp(min=1)).item())
            self.log_metric("num_judgment_tokens", mask.sum().item())
        return loss, outputs

    # ------------------------------------------------------------------ generative evaluation
    def eval_prompt(self, row):
        prompt, _ = split_prompt_completion(row, self.args.dataset_text_field)
        images = get_images(row)
        return prepare_multimodal_messages(prompt, images=images) if images else prompt

    def reference_answer(self, row) -> str | None:
        value = row.get(self.args.eval_answer_field)
        if value is not None:
            return str(value)
        _, completion = split_prompt_completion(row, self.args.dataset_text_field)
        text = completion[-1]["content"] if is_conversational_prompt(completion) else completion
        return extract_answer(text if isinstance(text, str) else str(text), self.args.answer_extractor)

    def _has_reference_answers(self, names):
        return self.args.eval_answer_field in names or {"prompt", "completion"} <= set(names) or "messages" in names


def _tokenize_row(row: dict[str, Any], index: int, processing_class, args) -> dict[str, list[int]]:
    """`input_ids` and `completion_mask` (1 on tokens that carry the loss) of one text row, truncated."""
    prompt, completion = split_prompt_completion(row, args.dataset_text_field)
    if args.assistant_only_loss and row.get("messages"):
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        out = tokenizer.apply_chat_template(
            row["messages"],
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **(args.chat_template_kwargs or {}),
        )
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        if not any(mask):
            raise ValueError(
                "assistant_only_loss=True but the chat template marks no assistant tokens: it needs "
                "{% generation %} ... {% endgeneration %} around assistant turns."
            )
    else:
        prompt_ids, completion_ids = tokenize_prompt_completion(
            processing_class, prompt, completion, args.chat_template_kwargs, args.eos_token
        )
        only_completion = args.completion_only_loss is not False and bool(prompt_ids)
        ids = prompt_ids + completion_ids
        mask = [0 if only_completion else 1] * len(prompt_ids) + [1] * len(completion_ids)
    if args.max_length is not None and len(ids) > args.max_length:
        keep = slice(None, args.max_length) if args.truncation_mode == "keep_start" else slice(-args.max_length, None)
        ids, mask = ids[keep], mask[keep]
    if sum(mask[1:]) == 0:
        raise ValueError(
            f"Row {index} has no judgment tokens left to learn from (all labels masked) after truncation to "
            f"max_length={args.max_length} with truncation_mode={args.truncation_mode!r}. Increase max_length, "
            "shorten the prompt, or remove the row."
        )
    return {"input_ids": ids, "completion_mask": mask}


class _GRMCollator:
    """Right-pads tokenised rows (labels -100 off the judgment); tokenises vision-language rows with the processor."""

    def __init__(self, processing_class, args):
        self.processing_class, self.args = processing_class, args
        self.tokenizer = getattr(processing_class, "tokenizer", processing_class)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if "input_ids" in rows[0]:
            ids = [torch.tensor(r["input_ids"]) for r in rows]
            masks = [torch.tensor(r["completion_mask"]) for r in rows]
            input_ids = pad(ids, self.tokenizer.pad_token_id, "right", self.args.pad_to_multiple_of)
            attention_mask = pad([torch.ones_like(t) for t in ids], 0, "right", self.args.pad_to_multiple_of)
            loss_mask = pad(masks, 0, "right", self.args.pad_to_multiple_of)
            return {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "labels": input_ids.masked_fill(loss_mask == 0, -100),
            }
        return self._collate_multimodal(rows)

    def _collate_multimodal(self, rows):
        kwargs = self.args.chat_template_kwargs or {}
        full_texts, prompt_texts, images = [], [], []
        for row in rows:
            prompt, completion = split_prompt_completion(row, self.args.dataset_text_field)
            if not is_conversational_prompt(prompt):
                raise ValueError("Rows with images need conversational prompts (lists of messages).")
            row_images = get_images(row) or []
            prompt = prepare_multimodal_messages(prompt, images=row_images)
            completion = prepare_multimodal_messages(completion, images=[])
            prompt_texts.append(
                self.processing_class.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **kwargs)
            )
            full_texts.append(self.processing_class.apply_chat_template(prompt + completion, tokenize=False, **kwargs))
            if not full_texts[-1].startswith(prompt_texts[-1]):
                raise ValueError("The chat template's generation prompt is not a prefix of the assistant turn.")
            images.append(row_images)
        batch = self.processing_class(
            text=full_texts, images=images, padding=True, padding_side="right", return_tensors="pt"
        )
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        for i, (text, row_images) in enumerate(zip(prompt_texts, images, strict=True)):
            prompt_len = self.processing_class(text=[text], images=[row_images], return_tensors="pt")[
                "input_ids"
            ].size(1)
            labels[i, :prompt_len] = -100
        if self.args.max_length is not None and batch["input_ids"].size(1) > self.args.max_length:
            raise ValueError(
                f"A vision-language row has {batch['input_ids'].size(1)} tokens, more than max_length="
                f"{self.args.max_length}; image tokens cannot be truncated. Increase max_length."
            )
        return {**batch, "labels": labels}
