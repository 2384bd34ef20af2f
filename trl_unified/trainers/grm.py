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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from datasets import IterableDataset

from ..core.config import PolicyConfig, TruncationConfig, document_fields, option
from ..core.trainer import PolicyTrainerBase
from ..data.datasets import dataset_columns, is_conversational_prompt, split_prompt_completion
from ..data.sft import SFTBatch, SFTCollator, tokenize_sft_row
from ..data.vision import with_row_visuals
from ..evaluation.answers import extract_answer
from ..models.token_ids import embedding_rows, mask_padding


# The dataset columns GRMTrainer reads (with the config's dataset_text_field).
_COLUMNS = ("input_ids", "completion_mask", "prompt", "completion", "messages", "image", "images", "video", "videos")


@document_fields
@dataclass
class GRMConfig(TruncationConfig, PolicyConfig):
    """Configuration of `GRMTrainer`: `trl.SFTConfig`'s names for the fields that mean the same, plus the base's
    generative-evaluation fields (`max_completion_length` = tokens per generated judgment, `answer_extractor`,
    `eval_answer_field`)."""

    _unimplemented_fields = {
        "packing": "Sequence packing is not implemented; rows are padded per batch.",
        "padding_free": "Padding-free batches are not implemented; rows are padded per batch.",
        "loss_type": "Only the negative log-likelihood ('nll') is implemented.",
        "shared_prefix": "GRM rows do not repeat a prompt: there is nothing to share.",
    }

    learning_rate: float = option(2e-5, "Initial AdamW learning rate.")
    max_length: int | None = option(1024, "Maximum tokens per row (prompt + judgment). None: no truncation.")
    completion_only_loss: bool | None = option(
        None, "Loss on the judgment only (prompt masked). None: True for prompt/completion and messages rows."
    )
    assistant_only_loss: bool = option(
        False, "For 'messages' rows: loss on every assistant turn (needs {% generation %} in the chat template)."
    )
    dataset_text_field: str = option("text", "Column of plain-text rows (no prompt: loss on all).")
    dataset_num_proc: int | None = option(None, "Processes used to tokenise the dataset.")
    eos_token: str | None = option(None, "Token appended to standard completions. None uses the tokenizer's EOS.")
    packing: bool = option(False, "Pack rows into max_length blocks (not implemented).")
    padding_free: bool = option(False, "Flatten batches without padding (not implemented).")
    pad_to_multiple_of: int | None = option(None, "Pad each batch's length to a multiple of this.")
    loss_type: str = option("nll", "Loss: 'nll' (negative log-likelihood of the judgment).")

    def __post_init__(self):
        super().__post_init__()
        self.check_truncation_mode()
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length={self.max_length} must be >= 2 (or None for no truncation).")


class GRMTrainer(PolicyTrainerBase):
    """Train a generative reward model (see the module docstring). Same constructor as `trl.SFTTrainer`."""

    _name = "GRM"
    config_class = GRMConfig
    loss_is_scaled_for_ga = True  # divided by num_items_in_batch, the judgment tokens of the whole step

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
        if compute_loss_func is not None or optimizer_cls_and_kwargs is not None:
            name = "compute_loss_func" if compute_loss_func is not None else "optimizer_cls_and_kwargs"
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

    def setup(self) -> None:
        self.model_accepts_loss_kwargs = True  # so the Trainer counts num_items_in_batch from the labels

    # ------------------------------------------------------------------ data
    def prepare_dataset(self, dataset, name):
        dataset = super().prepare_dataset(dataset, name)
        args = self.args
        if dataset is None:
            if name == "train":
                raise ValueError("train_dataset is required: GRMTrainer needs judging rows to learn from.")
            return None
        streaming = isinstance(dataset, IterableDataset)
        columns = dataset_columns(dataset)
        judgment_rows = {"prompt", "completion"} <= set(columns) or "messages" in columns
        if self.formatting_func is not None:
            # As `trl.SFTTrainer`: a formatting function turns rows into plain text, which has no prompt to mask.
            if args.completion_only_loss or (args.completion_only_loss is None and judgment_rows):
                raise ValueError(
                    "A formatting function was provided while `completion_only_loss=True`, which is incompatible. "
                    f"The dataset has columns {columns}: GRMTrainer would train on the judgment only, but a "
                    "formatting function turns each row into one text with no prompt to mask. Drop formatting_func "
                    "(the prompt/completion or messages rows are used as they are), or set completion_only_loss=False "
                    "to train on the whole formatted text."
                )
            dataset = dataset.map(lambda row: {args.dataset_text_field: self.formatting_func(row)})
            columns = [*columns, args.dataset_text_field]
        if not streaming and len(dataset) == 0:
            raise ValueError(f"{name} dataset is empty: GRMTrainer needs at least one row.")
        if not (judgment_rows or args.dataset_text_field in columns):
            raise ValueError(
                f"{name} dataset has columns {columns}, but GRMTrainer needs the judgment: 'prompt' + 'completion' "
                "(the judgment), 'messages' (the judgment as the last assistant turn), "
                f"or {args.dataset_text_field!r}."
            )
        if any(c in columns for c in ("image", "images", "video", "videos")):
            return dataset  # vision-language rows are tokenised with their images / videos in the collator
        # IterableDataset.map takes neither num_proc nor desc: streaming rows are tokenised as they are read.
        map_kwargs = {} if streaming else {"num_proc": args.dataset_num_proc, "desc": f"Tokenizing {name} dataset"}
        fn_kwargs = {"processing_class": self.processing_class, "args": args}
        return dataset.map(tokenize_sft_row, fn_kwargs=fn_kwargs, with_indices=True, **map_kwargs)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = [*_COLUMNS, self.args.dataset_text_field]

    def make_data_collator(self):
        return SFTCollator(self.processing_class, self.args)

    # ------------------------------------------------------------------ loss
    def compute_policy_loss(self, model, inputs: SFTBatch, num_items_in_batch=None):
        model_inputs = inputs.model_inputs()
        ids, mask = model_inputs["input_ids"], model_inputs["attention_mask"]
        model_inputs["input_ids"] = mask_padding(ids, mask, embedding_rows(model))  # a pad beyond the table: 0
        outputs = model(**model_inputs)
        logits, targets = outputs.logits[:, :-1], inputs.labels[:, 1:]  # (B, T-1, V), (B, T-1): t predicts t+1
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
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
        return with_row_visuals(prompt, row)

    def reference_answer(self, row):
        value = row.get(self.args.eval_answer_field)
        if value is not None:
            return value
        _, completion = split_prompt_completion(row, self.args.dataset_text_field)
        text = completion[-1]["content"] if is_conversational_prompt(completion) else completion
        return extract_answer(text if isinstance(text, str) else str(text), self.args.answer_extractor)

    def _has_reference_answers(self, names):
        return self.args.eval_answer_field in names or {"prompt", "completion"} <= set(names) or "messages" in names
