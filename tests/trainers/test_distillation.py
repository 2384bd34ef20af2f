"""DistillationTrainer: TRL's config and loss API, the chunked divergence against full logits, losses and gradients
against TRL's DistillationTrainer, training, learning, and bad input before training."""

import copy
import dataclasses

import pytest
import torch
import trl
from peft import LoraConfig

from tests.helpers import prompt_dataset, tiny_run_args
from trl_unified import DistillationConfig, DistillationTrainer
from trl_unified.core.divergence import generalized_jsd_loss, token_divergence
from trl_unified.testing import build_causal_lm, build_tokenizer


def distill_args(tmp_path, **overrides) -> DistillationConfig:
    defaults = dict(max_completion_length=6, per_device_train_batch_size=2)
    return tiny_run_args(DistillationConfig, tmp_path / "distill", **{**defaults, **overrides})


def naive_jsd(student_logits, teacher_logits, beta, temperature=1.0):
    """D per position in probability space (the module docstring's formula), `(B, T)`."""
    ps = torch.softmax(student_logits / temperature, -1)
    pt = torch.softmax(teacher_logits / temperature, -1)
    if beta == 0:
        return (pt * (pt.log() - ps.log())).sum(-1)
    if beta == 1:
        return (ps * (ps.log() - pt.log())).sum(-1)
    m = (1 - beta) * ps + beta * pt
    return beta * (pt * (pt.log() - m.log())).sum(-1) + (1 - beta) * (ps * (ps.log() - m.log())).sum(-1)


# ------------------------------------------------------------------ config and API parity
def test_config_has_every_trl_field_with_the_same_default(tmp_path):
    ours = {f.name: f for f in dataclasses.fields(DistillationConfig)}
    for f in dataclasses.fields(trl.DistillationConfig):
        assert f.name in ours, f.name
        theirs_default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        mine = (
            ours[f.name].default if ours[f.name].default is not dataclasses.MISSING else ours[f.name].default_factory()
        )
        if f.name not in ("output_dir", "bf16"):  # bf16: None resolves per machine (docs/departures.md)
            assert mine == theirs_default, (f.name, mine, theirs_default)


def test_constructor_signature_is_trls():
    import inspect

    ours = list(inspect.signature(DistillationTrainer.__init__).parameters)
    theirs = list(inspect.signature(trl.DistillationTrainer.__init__).parameters)
    assert ours == theirs


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_loss_is_the_formula_and_gkds(beta, temperature):
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    labels = torch.tensor([[-100, 1, 2], [-100, -100, 3]])
    loss = DistillationTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature)
    expected = naive_jsd(student, teacher, beta, temperature)[labels != -100].mean()
    torch.testing.assert_close(loss, expected)
    from trl.experimental.gkd import GKDTrainer

    gkd = GKDTrainer.generalized_jsd_loss(student, teacher, labels, beta=beta,
                                                               temperature=temperature)  # fmt: skip
    torch.testing.assert_close(loss, gkd)
    unreduced = generalized_jsd_loss(student, teacher, beta=beta, temperature=temperature, reduction="none")
    assert unreduced.shape == (2, 3, 5)


def test_chunked_divergence_equals_full_logits_values_and_gradients():
    torch.manual_seed(0)
    head_s, head_t = torch.nn.Linear(8, 11, bias=False), torch.nn.Linear(8, 11, bias=False)
    hidden_s = torch.randn(3, 4, 8, requires_grad=True)
    hidden_t = torch.randn(3, 4, 8)
    for beta in (0.0, 0.5, 1.0):
        div, entropy = token_divergence(hidden_s, hidden_t, head_s, head_t, beta, temperature=1.5, chunk_size=5)
        expected = naive_jsd(head_s(hidden_s), head_t(hidden_t), beta, 1.5)
        torch.testing.assert_close(div, expected, atol=1e-6, rtol=1e-5)
        (grad,) = torch.autograd.grad(div.sum(), hidden_s)
        (expected_grad,) = torch.autograd.grad(expected.sum(), hidden_s)
        torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)
        p = torch.softmax(head_s(hidden_s) / 1.5, -1)
        torch.testing.assert_close(entropy, -(p * p.log()).sum(-1).detach())


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("weighting", ["uniform", "per_position"])
def test_gradient_in_the_forward_equals_autograd(beta, weighting):
    """`LinearDivergence` (both heads plain linear: the closed-form gradient computed in the forward) gives autograd's
    values and gradients for the hidden states and the student's head, for a loss weighing positions alike (scaled
    in the backward) and one that does not (the chunks recomputed)."""
    torch.manual_seed(0)
    head_s, head_t = torch.nn.Linear(8, 11, bias=False), torch.nn.Linear(8, 11, bias=False)
    hidden_s, hidden_t = torch.randn(3, 4, 8, requires_grad=True), torch.randn(3, 4, 8)
    weights = torch.full((3, 4), 0.25) if weighting == "uniform" else torch.rand(3, 4)
    results = []
    for linear in (None, ((head_s.weight, 2.0), (head_t.weight, 0.5))):
        hidden_s.grad = head_s.weight.grad = None
        div, entropy = token_divergence(hidden_s, hidden_t, head_s, head_t, beta, 1.5, (2.0, None), (0.5, None),
                                        chunk_size=5, linear=linear)  # fmt: skip
        (div * weights).sum().backward()
        results.append((div.detach(), entropy, hidden_s.grad, head_s.weight.grad))
    for ours, autograd in zip(*results, strict=True):
        torch.testing.assert_close(ours, autograd, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ equivalence with TRL's trainer
def fixed_batch(tokenizer, common=0):
    """Three rows, prompts left-padded to 4 (to 6 with `common`: their real tokens then begin with the same `common`
    tokens, a system prompt, which the trainer encodes once for all rows)."""
    torch.manual_seed(3)
    vocab = len(tokenizer)
    prompt_ids = torch.randint(5, vocab, (3, 4))
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    if common:
        prefix = torch.randint(5, vocab, (common,))
        rows = [torch.cat([prefix, ids[mask == 1]]) for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        width = max(len(r) for r in rows)
        prompt_ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
        prompt_mask = torch.stack([(torch.arange(width) >= width - len(r)).long() for r in rows])
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, tokenizer.pad_token_id)
    completion_ids = torch.randint(5, vocab, (3, 5))
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, num_items_in_batch=completion_mask.sum())  # fmt: skip


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_loss_and_gradients_equal_trls(beta, temperature, peft, tmp_path, system_prompt=0):
    tokenizer = build_tokenizer()
    student, teacher = build_causal_lm(tokenizer, seed=0), build_causal_lm(tokenizer, seed=1)
    common = dict(beta=beta, temperature=temperature, report_to=[], bf16=False, use_cpu=True, max_steps=1,
                  max_completion_length=8, gradient_checkpointing=False)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0) if peft else None
    trainers = []
    for cls, config in ((DistillationTrainer, DistillationConfig), (trl.DistillationTrainer, trl.DistillationConfig)):
        torch.manual_seed(7)  # the same LoRA initialisation
        args = config(output_dir=str(tmp_path / cls.__module__), **common)
        trainers.append(cls(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), args=args,
                            train_dataset=prompt_dataset(), processing_class=tokenizer, peft_config=lora))  # fmt: skip
    losses, grads = [], []
    for trainer in trainers:
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        loss = trainer.compute_loss(trainer.model, fixed_batch(tokenizer, system_prompt))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_a_prompt_prefix_common_to_all_rows_is_encoded_once_with_trls_numbers(peft, tmp_path, monkeypatch):
    """Prompts that begin with the same 3 tokens, left-padded to different lengths: both models encode those tokens
    in one pass (a batch of 1), the rows run on its cache, and the loss and gradients are still TRL's."""
    from trl_unified.generation import sharing

    passes = []
    encode = sharing.encode_prefix

    def recorded(model, ids, mask, length, groups, *args, **kwargs):
        passes.append((length, groups[0].tolist()))
        return encode(model, ids, mask, length, groups, *args, **kwargs)

    monkeypatch.setattr(sharing, "encode_prefix", recorded)
    test_loss_and_gradients_equal_trls(0.5, 0.7, peft, tmp_path, system_prompt=3)
    assert passes == [(3, [0])] * 2  # student, then teacher: the 3 common tokens, one pass (row 0's)


# ------------------------------------------------------------------ training
def test_training_changes_every_parameter_and_logs_trls_metrics(tokenizer, tmp_path):
    student, teacher = build_causal_lm(tokenizer, seed=0), build_causal_lm(tokenizer, seed=1)
    args = distill_args(tmp_path, max_steps=2, gradient_accumulation_steps=2, learning_rate=0.1)
    trainer = DistillationTrainer(
        student, teacher, args=args, train_dataset=prompt_dataset(), processing_class=tokenizer
    )
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    teacher_before = {n: p.clone() for n, p in trainer.teacher_model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    assert all(torch.equal(p, trainer.teacher_model.get_parameter(n)) for n, p in teacher_before.items())
    log = trainer.state.log_history[0]
    for key in ("loss", "entropy", "completions/mean_length", "completions/clipped_ratio", "num_tokens", "step_time"):
        assert key in log, key
    assert log["loss"] >= 0


def test_loss_is_the_mean_divergence_over_the_optimiser_steps_tokens(tokenizer, tmp_path, monkeypatch):
    """TRL's normalisation: each micro-step divides its token sum by the token count of the whole accumulation
    window (all processes), so the accumulated loss is the mean over that window's tokens."""
    calls = []
    original = DistillationTrainer._reduce_divergence_loss

    def recording(jsd, completion_mask=None, reduction="batchmean", num_items_in_batch=None):
        calls.append((completion_mask.sum().item(), float(num_items_in_batch)))
        return original(jsd, completion_mask=completion_mask, num_items_in_batch=num_items_in_batch)

    monkeypatch.setattr(DistillationTrainer, "_reduce_divergence_loss", staticmethod(recording))
    args = distill_args(tmp_path, max_steps=1, gradient_accumulation_steps=2)
    trainer = DistillationTrainer(build_causal_lm(tokenizer, seed=0), build_causal_lm(tokenizer, seed=1), args=args,
                                  train_dataset=prompt_dataset(), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    assert len(calls) == 2
    assert calls[0][1] == calls[1][1] == sum(tokens for tokens, _ in calls)


def test_student_learns_the_teachers_distribution(tokenizer, tmp_path):
    student, teacher = build_causal_lm(tokenizer, seed=0), build_causal_lm(tokenizer, seed=1)
    with torch.no_grad():  # a peaked teacher, far from the random student
        teacher.lm_head.weight.mul_(8.0)
    args = distill_args(tmp_path, max_steps=30, per_device_train_batch_size=8, learning_rate=1e-2, beta=0.5)
    trainer = DistillationTrainer(student, teacher, args=args, train_dataset=prompt_dataset(64),
                                  processing_class=tokenizer)  # fmt: skip
    batch = fixed_batch(tokenizer)

    def held_out_divergence():
        trainer.model.eval()
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, {k: v for k, v in batch.items() if k != "num_items_in_batch"})

    before = held_out_divergence()
    trainer.train()
    after = held_out_divergence()
    assert after < 0.7 * before, (before, after)


# ------------------------------------------------------------------ bad input, before training
@pytest.mark.parametrize(
    "overrides, teacher, error, match",
    [
        (dict(beta=1.5), "same", ValueError, r"beta must be in \[0.0, 1.0\], got 1.5"),
        (dict(epsilon=0.3), "same", ValueError, "epsilon=0.3 does not apply to distillation"),
        ({}, "other_vocab", ValueError, "The student model has vocab_size"),
        (dict(teacher_model_init_kwargs={"dtype": "float32"}), "same", ValueError, "teacher_model_init_kwargs"),
        ({}, None, ValueError, "DistillationTrainer needs a teacher"),
    ],
)
def test_bad_input_is_named_before_training(overrides, teacher, error, match, tokenizer, tmp_path):
    models = {"same": build_causal_lm(tokenizer, seed=1), None: None,
              "other_vocab": build_causal_lm(build_tokenizer(["zz", "yy", *"abc"]))}  # fmt: skip
    with pytest.raises(error, match=match):
        args = distill_args(tmp_path, **overrides)
        DistillationTrainer(build_causal_lm(tokenizer), models[teacher], args=args, train_dataset=prompt_dataset(),
                            processing_class=tokenizer)  # fmt: skip


def test_teacher_by_path_from_the_config(tokenizer, tmp_path, qwen2_path):
    args = distill_args(tmp_path, teacher_model_name_or_path=qwen2_path, max_steps=1)
    trainer = DistillationTrainer(build_causal_lm(tokenizer), args=args, train_dataset=prompt_dataset(),
                                  processing_class=tokenizer)  # fmt: skip
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    trainer.train()


def test_logit_scaling_of_the_models_that_have_it():
    from types import SimpleNamespace

    from trl_unified.core.lm_head import logit_transform

    def model(**config):
        return SimpleNamespace(config=SimpleNamespace(**config))

    assert logit_transform(model()) == (1.0, None)
    assert logit_transform(model(logit_scale=0.0625)) == (0.0625, None)  # Cohere
    assert logit_transform(model(logits_scaling=16.0)) == (1 / 16, None)  # Granite divides
    assert logit_transform(model(lm_head_multiplier=0.5, final_logit_softcapping=30.0)) == (0.5, 30.0)
