"""GKDTrainer: TRL's config, constructor and loss API; the loss and gradients against TRL's GKDTrainer on fixed
batches; the on/off-policy mix (lmbda, seq_kd, evaluation); training, learning, and bad input before training."""

import copy
import dataclasses
import inspect
import random

import pytest
import torch
from datasets import Dataset

from tests.helpers import tiny_run_args
from trl_unified import GKDConfig, GKDTrainer
from trl_unified.online.completions import CompletionMix
from trl_unified.testing import build_causal_lm, build_tool_tokenizer


trl_gkd = pytest.importorskip("trl.experimental.gkd")


def conversations(n: int = 16) -> Dataset:
    """TRL's conversational language-modelling rows: a user turn, then the assistant's answer (the completion)."""
    rows = [
        [
            {"role": "user", "content": f"what is {i % 7} plus {i % 5}"},
            {"role": "assistant", "content": f"{i % 7 + i % 5}"},
        ]
        for i in range(n)
    ]
    return Dataset.from_dict({"messages": rows})


@pytest.fixture(scope="module")
def tokenizer():
    return build_tool_tokenizer()


def gkd_args(tmp_path, **overrides) -> GKDConfig:
    defaults = dict(per_device_train_batch_size=2, max_new_tokens=6, learning_rate=1e-2)
    return tiny_run_args(GKDConfig, tmp_path / "gkd", **{**defaults, **overrides})


def build(tokenizer, tmp_path, eval_dataset=None, **overrides):
    student, teacher = build_causal_lm(tokenizer, "qwen2", seed=0), build_causal_lm(tokenizer, "qwen2", seed=1)
    return GKDTrainer(
        student,
        teacher,
        args=gkd_args(tmp_path, **overrides),
        train_dataset=conversations(),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )


# ------------------------------------------------------------------ config and API parity
def test_config_has_every_trl_field_with_trls_default():
    def default(f):
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    ours = {f.name: default(f) for f in dataclasses.fields(GKDConfig)}
    for f in dataclasses.fields(trl_gkd.GKDConfig):
        theirs = default(f)
        assert f.name in ours, f.name
        if f.name not in ("output_dir", "bf16", "shuffle_dataset"):  # docs/gkd.md: shuffle_dataset's meaning
            assert ours[f.name] == theirs, (f.name, ours[f.name], theirs)


def test_constructor_signature_is_trls():
    ours = list(inspect.signature(GKDTrainer.__init__).parameters)
    assert ours == list(inspect.signature(trl_gkd.GKDTrainer.__init__).parameters)


# ------------------------------------------------------------------ the loss against TRL's GKDTrainer
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("with_count", [False, True], ids=["batchmean", "num_items"])
def test_loss_and_gradients_equal_trls_on_a_collated_batch(beta, with_count, tokenizer, tmp_path):
    student, teacher = build_causal_lm(tokenizer, "qwen2", seed=0), build_causal_lm(tokenizer, "qwen2", seed=1)
    common = dict(
        beta=beta,
        report_to=[],
        bf16=False,
        use_cpu=True,
        max_steps=1,
        gradient_checkpointing=False,
        per_device_train_batch_size=4,
        max_length=64,
    )
    trainers = [
        cls(
            model=copy.deepcopy(student),
            teacher_model=copy.deepcopy(teacher),
            args=config(output_dir=str(tmp_path / name), **common),
            train_dataset=conversations(4),
            processing_class=tokenizer,
        )
        for name, cls, config in (("ours", GKDTrainer, GKDConfig), ("trl", trl_gkd.GKDTrainer, trl_gkd.GKDConfig))
    ]
    rows = [conversations(4)[i] for i in range(4)]
    losses, grads = [], []
    for trainer in trainers:
        batch = trainer.data_collator(rows)
        batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        count = (batch["labels"][:, 1:] != -100).sum() * 2 if with_count else None
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=count)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad})
    assert losses[0] > 0
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_loss_reads_the_models_at_temperature_one_as_trls_gkd(tokenizer, tmp_path):
    """`temperature` samples; the divergence compares the models themselves (TRL's GKD passes no temperature)."""
    trainer = build(tokenizer, tmp_path, temperature=0.3)
    batch = trainer.data_collator([conversations(2)[i] for i in range(2)])
    with torch.no_grad():
        student = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        teacher = trainer.teacher_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        expected = GKDTrainer.generalized_jsd_loss(student, teacher[:, :-1], batch["labels"][:, 1:], beta=0.5)
        torch.testing.assert_close(trainer.compute_loss(trainer.model, batch), expected, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ the on/off-policy mix
def test_the_mix_draws_policy_rounds_with_probability_lmbda():
    random.seed(0)
    draws = [CompletionMix(0.3).draw("train") for _ in range(2000)]
    assert abs(draws.count("policy") / 2000 - 0.3) < 0.04 and set(draws) == {"policy", "dataset"}
    assert {CompletionMix(0.3, seq_kd=True).draw("train") for _ in range(200)} == {"policy", "teacher"}
    assert {CompletionMix(1.0).draw("train") for _ in range(200)} == {"policy"}
    assert CompletionMix(0.0, eval_source="dataset").draw("eval") == "dataset"


@pytest.mark.parametrize(
    "lmbda, seq_kd, source", [(0.0, False, "dataset"), (1.0, False, "policy"), (0.0, True, "teacher")]
)
def test_each_round_comes_from_its_source(lmbda, seq_kd, source, tokenizer, tmp_path, monkeypatch):
    trainer = build(tokenizer, tmp_path, lmbda=lmbda, seq_kd=seq_kd, max_steps=2)
    generated = []
    for name in ("_generate", "teacher_samples"):
        original = getattr(trainer, name)
        monkeypatch.setattr(trainer, name, lambda *a, _o=original, _n=name, **k: generated.append(_n) or _o(*a, **k))
    rounds = []
    finish = trainer.finish
    monkeypatch.setattr(trainer, "finish", lambda samples: rounds.append(samples) or finish(samples))
    trainer.train()
    assert len(rounds) == 2
    assert generated == {"dataset": [], "policy": ["_generate"] * 2, "teacher": ["teacher_samples"] * 2}[source]
    if source == "dataset":  # the dataset's own completion tokens, as TRL's collator splits them
        for samples in rounds:
            for row, ids in zip(samples.rows, samples.generation.completion_ids_list, strict=True):
                assert ids == row["completion_ids"]


def test_evaluation_scores_the_datasets_completions(tokenizer, tmp_path, monkeypatch):
    trainer = build(tokenizer, tmp_path, lmbda=1.0, per_device_eval_batch_size=2)
    monkeypatch.setattr(trainer, "_generate", lambda *a, **k: pytest.fail("evaluation must not generate"))
    metrics = trainer.evaluate(conversations(4))
    assert metrics["eval_loss"] > 0


# ------------------------------------------------------------------ training and learning
def test_training_changes_the_student_not_the_teacher_and_logs_eval_loss(tokenizer, tmp_path):
    eval_every_2 = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2)
    trainer = build(tokenizer, tmp_path, conversations(4), max_steps=4, **eval_every_2)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    teacher = {n: p.clone() for n, p in trainer.teacher_model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    assert all(torch.equal(p, trainer.teacher_model.get_parameter(n)) for n, p in teacher.items())
    logs = trainer.state.log_history
    assert any("eval_loss" in log for log in logs) and logs[0]["loss"] > 0


def test_student_learns_the_teachers_distribution_on_and_off_policy(tokenizer, tmp_path):
    trainer = build(tokenizer, tmp_path, max_steps=40, per_device_train_batch_size=8, lmbda=0.5)
    with torch.no_grad():  # a peaked teacher, far from the random student
        trainer.teacher_model.lm_head.weight.mul_(8.0)
    held_out = trainer.data_collator([conversations(24)[i] for i in range(16, 24)])

    def divergence():
        trainer.model.eval()
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, held_out).item()

    before = divergence()
    trainer.train()
    assert divergence() < 0.5 * before


# ------------------------------------------------------------------ bad input, before training
@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (dict(lmbda=1.5), ValueError, r"lmbda must be in the range \[0.0, 1.0\]"),
        (dict(beta=-0.1), ValueError, r"beta must be in the range \[0.0, 1.0\]"),
        (dict(packing=True), ValueError, "packing=True does not apply to GKD"),
        (dict(max_completion_length=9), ValueError, "name the same limit"),
        (dict(dataset_kwargs={"add_special_tokens": False}), ValueError, "dataset_kwargs"),
        (dict(activation_offloading=True), NotImplementedError, "activation_offloading"),
    ],
)
def test_bad_config_is_named_before_training(overrides, error, match, tmp_path):
    with pytest.raises(error, match=match):
        gkd_args(tmp_path, **overrides)


def test_rows_without_a_prompt_or_messages_are_named(tokenizer, tmp_path):
    student, teacher = build_causal_lm(tokenizer, "qwen2", seed=0), build_causal_lm(tokenizer, "qwen2", seed=1)
    with pytest.raises(ValueError, match="needs a 'messages' or 'prompt' or 'input_ids' column"):
        GKDTrainer(
            student,
            teacher,
            args=gkd_args(tmp_path),
            train_dataset=Dataset.from_dict({"text": ["a b"] * 4}),
            processing_class=tokenizer,
        )
    with pytest.raises(NotImplementedError, match="formatting_func"):
        GKDTrainer(
            student,
            teacher,
            args=gkd_args(tmp_path),
            train_dataset=conversations(),
            processing_class=tokenizer,
            formatting_func=lambda row: row,
        )
