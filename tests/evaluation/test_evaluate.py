"""Generative evaluation accuracy: generate, extract, compare, log `eval_accuracy`, write records."""

import json
import math

from datasets import Dataset

from tests.helpers import rloo_args, varied_reward
from trl_unified import RLOOTrainer, extract_answer, generate_batched


PROMPTS = ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q"]


def last_word_answers(trainer, prompts):
    """What the trainer's greedy generation will answer, read with the 'last word' extractor."""
    out = generate_batched(
        trainer.model, trainer.processing_class, prompts, trainer.make_generation_config(do_sample=False)
    )
    return [extract_answer(t, r"regex:(\S+)\s*$") for t in out.texts]


def make_trainer(llama_path, tmp_path, eval_dataset, **overrides):
    overrides = {"answer_extractor": r"regex:(\S+)\s*$", **overrides}
    args = rloo_args(tmp_path, per_device_eval_batch_size=2, **overrides)
    return RLOOTrainer(
        llama_path,
        varied_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 2}),
        eval_dataset=eval_dataset,
    )


def test_evaluate_logs_accuracy_and_writes_records(llama_path, tmp_path):
    probe = make_trainer(llama_path, tmp_path, None)
    predicted = last_word_answers(probe, PROMPTS)
    assert all(p is not None for p in predicted)
    # Even rows get the answer the model will give (correct), odd rows a wrong one.
    answers = [p if i % 2 == 0 else "wrong" for i, p in enumerate(predicted)]
    trainer = make_trainer(llama_path, tmp_path, Dataset.from_dict({"prompt": PROMPTS, "answer": answers}))
    metrics = trainer.evaluate()
    assert metrics["eval_accuracy"] == 4 / 7
    assert metrics["eval_answer_parse_rate"] == 1.0
    assert math.isfinite(metrics["eval_loss"]) and 0 <= metrics["eval_reward"] <= 6 / 7  # varied_reward's range
    logged = [log for log in trainer.state.log_history if "eval_accuracy" in log]
    assert len(logged) == 1
    assert logged[0]["eval_accuracy"] == 4 / 7 and logged[0]["eval_loss"] == metrics["eval_loss"]
    with open(trainer.last_eval_records_path) as f:
        records = [json.loads(line) for line in f]
    assert [r["index"] for r in records] == list(range(7))
    assert [r["correct"] for r in records] == [i % 2 == 0 for i in range(7)]
    assert [r["prompt"] for r in records] == PROMPTS
    assert all(r["predicted"] == p for r, p in zip(records, predicted))


def test_evaluate_per_dataset_accuracy_with_dict(llama_path, tmp_path):
    probe = make_trainer(llama_path, tmp_path, None)
    predicted = last_word_answers(probe, PROMPTS)
    eval_sets = {
        "right": Dataset.from_dict({"prompt": PROMPTS[:4], "answer": predicted[:4]}),
        "wrong": Dataset.from_dict({"prompt": PROMPTS[:4], "answer": ["nope"] * 4}),
        "no_answers": Dataset.from_dict({"prompt": PROMPTS[:4]}),
    }
    metrics = make_trainer(llama_path, tmp_path, eval_sets).evaluate()
    assert metrics["eval_right_accuracy"] == 1.0
    assert metrics["eval_wrong_accuracy"] == 0.0
    assert "eval_no_answers_accuracy" not in metrics and math.isfinite(metrics["eval_no_answers_loss"])


def test_unparseable_generation_is_wrong(llama_path, tmp_path):
    # The default extractor wants <answer> tags, which a random model never writes.
    args = dict(answer_extractor="tags")
    trainer = make_trainer(
        llama_path, tmp_path, Dataset.from_dict({"prompt": PROMPTS[:4], "answer": ["a"] * 4}), **args
    )
    metrics = trainer.evaluate()
    assert metrics["eval_accuracy"] == 0.0 and metrics["eval_answer_parse_rate"] == 0.0


def test_user_evaluate_metrics_plug_in(llama_path, tmp_path):
    import evaluate

    class FirstCharMatch(evaluate.Metric):
        def _info(self):
            import datasets

            return evaluate.MetricInfo(
                description="",
                citation="",
                features=datasets.Features(
                    {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
                ),
            )

        def _compute(self, predictions, references):
            return {"first_char": sum(p[:1] == r[:1] for p, r in zip(predictions, references)) / len(predictions)}

    probe = make_trainer(llama_path, tmp_path, None)
    predicted = last_word_answers(probe, PROMPTS[:4])
    assert all(predicted)
    # Even rows: the prediction's first character, then a different tail; odd rows: an unlikely character.
    answers = [p[:1] + "zzz" if i % 2 == 0 else "\u00e9" for i, p in enumerate(predicted)]
    first_char = sum(p[:1] == a[:1] for p, a in zip(predicted, answers)) / 4
    assert first_char >= 0.5
    eval_set = Dataset.from_dict({"prompt": PROMPTS[:4], "answer": answers})
    trainer = make_trainer(llama_path, tmp_path, eval_set)
    trainer.generative_metrics = [FirstCharMatch()]
    metrics = trainer.evaluate()
    assert metrics["eval_first_char"] == first_char  # the metric saw the predictions and the references, in order
    assert metrics["eval_accuracy"] == sum(p == a for p, a in zip(predicted, answers)) / 4
