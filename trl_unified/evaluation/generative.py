"""Generative evaluation accuracy, for every trainer: generate for the eval rows that carry a reference answer, read
the predicted answer (`evaluation/answers.py`), compare, log `{prefix}_accuracy` / `{prefix}_answer_parse_rate` (and
`generative_metrics`), and write the records (prompt, generation, predicted, reference, correct), gathered across
processes in dataset order, to `output_dir/eval_records/`."""

import json
import logging
import os

from accelerate.utils import gather_object
from datasets import Dataset

from ..data.datasets import column_names, get_images, get_videos
from .answers import answers_match, extract_answer, reference_answers


logger = logging.getLogger(__name__)


class GenerativeEvalMixin:
    """The generative-evaluation half of `PolicyTrainerBase.evaluate` (a mixin of the base trainer: it reads
    `self.args`, `self.accelerator`, `self.generate`, and the hooks `eval_prompt(row)` / `reference_answer(row)`)."""

    def _local_eval_rows(self, dataset) -> list[tuple[int, dict]]:
        """This process's share of the eval rows, with their global index: disjoint, no padding duplicates."""
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        if isinstance(dataset, Dataset):
            indices = list(range(rank, len(dataset), world))
            return list(zip(indices, dataset.select(indices), strict=True))
        return [(i, row) for i, row in enumerate(dataset) if i % world == rank]

    def evaluate_generations(self, dataset, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Generative accuracy on `dataset`: the metrics and records of the module docstring (unparseable: wrong)."""
        names = column_names(dataset)
        if not self.args.generative_eval or dataset is None:
            return {}
        if names is not None and not self._has_reference_answers(names):
            self._warn_no_answer_column(names)
            return {}
        local = []
        for index, row in self._local_eval_rows(dataset):
            where = f"eval row {index}'s {self.args.eval_answer_field!r}"
            accepted = reference_answers(self.reference_answer(row), where)
            if accepted is not None:
                local.append((index, row, accepted))
        prompts = [self.eval_prompt(row) for _, row, _ in local]
        texts = self.generate_eval_texts([row for _, row, _ in local], prompts)
        records = []
        for (index, _, accepted), prompt, text in zip(local, prompts, texts, strict=True):
            predicted = extract_answer(text, self.args.answer_extractor)
            reference = accepted[0] if len(accepted) == 1 else accepted
            record = dict(index=index, prompt=prompt, generation=text, predicted=predicted, reference=reference)
            records.append({**record, "correct": answers_match(predicted, accepted)})
        records = sorted(gather_object(records), key=lambda r: r["index"])
        if not records:
            return {}
        predictions = [r["predicted"] for r in records]
        metrics = {
            f"{metric_key_prefix}_accuracy": sum(r["correct"] for r in records) / len(records),
            f"{metric_key_prefix}_answer_parse_rate": sum(p is not None for p in predictions) / len(predictions),
        }
        references = [r["reference"] if isinstance(r["reference"], str) else r["reference"][0] for r in records]
        for metric in self.generative_metrics:
            result = metric.compute(predictions=[p or "" for p in predictions], references=references)
            metrics.update({f"{metric_key_prefix}_{k}": v for k, v in result.items() if isinstance(v, (int, float))})
        if self.accelerator.is_main_process:
            self._write_records(records, metric_key_prefix)
        return metrics

    def generate_eval_texts(self, rows: list[dict], prompts: list) -> list[str]:
        """The texts generative evaluation reads answers from (greedy unless `eval_do_sample`). Every process
        generates, even with no rows: under ZeRO-3 the parameter gather is a collective."""
        images, videos = [get_images(row) for row in rows], [get_videos(row) for row in rows]
        return self.generate(
            prompts,
            images=images if any(img is not None for img in images) else None,
            videos=videos if any(video is not None for video in videos) else None,
            do_sample=self.args.eval_do_sample,
            max_new_tokens=self.args.eval_max_new_tokens,
            batch_size=self.args.per_device_eval_batch_size,
        ).texts

    def _warn_no_answer_column(self, names: list[str]) -> None:
        """Say, once per run and from the main process, why no accuracy is logged: no reference-answer column."""
        if not self.accelerator.is_main_process or getattr(self, "_warned_no_answers", False):
            return
        self._warned_no_answers = True
        logger.warning(
            f"Generative evaluation is on, but the eval dataset has no {self.args.eval_answer_field!r} column "
            f"(eval_answer_field; its columns: {names}), so no eval_accuracy is logged. Name the reference-answer "
            "column with eval_answer_field, or set generative_eval=False to silence this."
        )

    def _has_reference_answers(self, names: list[str]) -> bool:
        return self.args.eval_answer_field in names

    def _write_records(self, records: list[dict], prefix: str) -> None:
        folder = os.path.join(self.args.output_dir, "eval_records")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{prefix}-step{self.state.global_step}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(record, ensure_ascii=False, default=str) + "\n" for record in records)
        self.last_eval_records_path = path
        logger.warning(f"Generative evaluation: {len(records)} records written to {path}")
        self._log_records_table(records, prefix)

    def _log_records_table(self, records: list[dict], prefix: str) -> None:
        """A sample table for W&B and TensorBoard when they are enabled (`report_to`)."""
        report_to = self.args.report_to or []
        sample = records[:32]
        if "wandb" in report_to:
            import wandb

            if wandb.run is not None:
                columns = ["index", "prompt", "generation", "predicted", "reference", "correct"]
                rows = [[str(r[c]) for c in columns] for r in sample]
                wandb.log({f"{prefix}_samples": wandb.Table(columns=columns, data=rows)})
        if "tensorboard" in report_to:
            text = "\n\n".join(
                f"**{r['index']}** correct={r['correct']} predicted={r['predicted']!r} "
                f"reference={r['reference']!r}\n\n{r['generation']}"
                for r in sample
            )
            for callback in self.callback_handler.callbacks:
                if getattr(callback, "tb_writer", None) is not None:
                    callback.tb_writer.add_text(f"{prefix}_samples", text, self.state.global_step)
