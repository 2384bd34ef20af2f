"""SDFT and SDPO (the self-distillation core): TRL's configs and constructors, the per-token divergences against
TRL 1.16's `loss_utils` and by hand, the losses and gradients of both trainers equal to TRL's on fixed batches (the
teacher at a fixed state), the EMA teacher's update by hand (full copy and LoRA adapter) and across a resume, SDPO's
demonstrations, and learning."""

import dataclasses
import inspect
import os
from statistics import mean

import pytest
import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast

from tests.helpers import tiny_run_args
from trl_unified import SDFTConfig, SDFTTrainer, SDPOConfig, SDPOTrainer
from trl_unified.core.divergence import clipped_importance_weights, self_distillation_divergence
from trl_unified.data.datasets import pad
from trl_unified.online.teacher_contexts import successful_demonstrations
from trl_unified.testing import DEFAULT_WORDS, build_causal_lm, build_tokenizer


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
PROMPTS = ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q", "r s t u"]


@pytest.mark.parametrize("name", ["sdft", "sdpo"])
def test_config_and_constructor_are_trls(name):
    import importlib

    trl_module = importlib.import_module(f"trl.experimental.{name}")
    ours = {"sdft": (SDFTConfig, SDFTTrainer), "sdpo": (SDPOConfig, SDPOTrainer)}[name]
    theirs = getattr(trl_module, f"{name.upper()}Config"), getattr(trl_module, f"{name.upper()}Trainer")
    fields = {f.name: f for f in dataclasses.fields(ours[0])}
    for f in dataclasses.fields(theirs[0]):
        assert f.name in fields, f.name
        if f.default is not dataclasses.MISSING and f.name not in ("gradient_checkpointing", "logging_steps"):
            assert fields[f.name].default == f.default, (f.name, fields[f.name].default, f.default)
    signature = list(inspect.signature(theirs[1].__init__).parameters)
    assert list(inspect.signature(ours[1].__init__).parameters) == signature


def test_bad_settings_are_refused_before_training():
    with pytest.raises(ValueError, match="only supports reverse KL"):
        SDFTConfig(output_dir="out", distillation_mode="sampled_token", distillation_alpha=0.5)
    with pytest.raises(ValueError, match="must contain both"):
        SDFTConfig(output_dir="out", teacher_prompt_template="{prompt}")
    with pytest.raises(ValueError, match="teacher_model_kind='copy' is not one of"):
        SDFTConfig(output_dir="out", teacher_model_kind="copy")
    with pytest.raises(ValueError, match="distillation_weight` must be in"):
        SDPOConfig(output_dir="out", distillation_weight=1.5)
    with pytest.raises(ValueError, match="requires `use_vllm=True`"):
        SDPOConfig(output_dir="out", use_teacher_server=True)
    with pytest.raises(ValueError, match=r"loss_type='cispo' is not one of \['grpo', 'bnpo', 'dr_grpo', 'dapo'\]"):
        SDPOConfig(output_dir="out", loss_type="cispo")
    with pytest.raises(ValueError, match="importance_sampling_level='seq' is not one of"):
        SDPOConfig(output_dir="out", importance_sampling_level="seq")
    assert SDPOConfig(output_dir="out", scale_rewards=False).scale_rewards == "none"
    with pytest.raises(ValueError, match="beta=0.1 does not apply to SDPO"):
        SDPOConfig(output_dir="out", beta=0.1)
    with pytest.raises(ValueError, match="`reward_funcs` is required"):
        SDPOTrainer("model", None, train_dataset=Dataset.from_dict({"prompt": ["a"]}))


@pytest.mark.parametrize(
    "mode, alpha, top_k, tail",
    [
        ("full_logits", 0.0, None, False),
        ("full_logits", 0.5, None, False),
        ("full_logits", 1.0, None, False),
        ("topk_logits", 0.5, 4, False),
        ("topk_logits", 0.3, 4, True),
        ("sampled_token", 1.0, None, False),
    ],
)
def test_divergences_equal_trls(mode, alpha, top_k, tail):
    from trl.experimental.sdft import loss_utils

    torch.manual_seed(0)
    student, teacher = torch.randn(3, 5, 11, requires_grad=True), torch.randn(3, 5, 11)
    ids = torch.randint(0, 11, (3, 5))
    ours = self_distillation_divergence(student, teacher, ids, mode, alpha, top_k, tail)
    if mode == "full_logits":
        theirs = loss_utils.compute_full_logit_self_distillation_loss(student, teacher, distillation_alpha=alpha)
    elif mode == "topk_logits":
        theirs = loss_utils.compute_topk_self_distillation_loss(
            student, teacher, distillation_topk=top_k, distillation_alpha=alpha, distillation_add_tail=tail
        )
    else:
        theirs = loss_utils.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(ours.sum(), student)
    (ref_grad,) = torch.autograd.grad(theirs.sum(), student)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_divergences_by_hand():
    """Forward KL over the vocabulary, the top-2 support renormalised, and the clipped importance weight."""
    p_s, p_t = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.25, 0.25, 0.5])
    student, teacher = p_s.log().view(1, 1, 3), p_t.log().view(1, 1, 3)  # logits: log-probs up to a constant
    forward = (p_t * (p_t.log() - p_s.log())).sum()
    value = self_distillation_divergence(student, teacher, None, "full_logits", 0.0)
    assert value.item() == pytest.approx(forward.item(), rel=1e-5)
    # top-2 of the student: tokens 0 and 1; renormalised there p_S = (5/8, 3/8), p_T = (1/2, 1/2); reverse KL
    top2 = self_distillation_divergence(student, teacher, None, "topk_logits", 1.0, 2)
    s, t = torch.tensor([5 / 8, 3 / 8]), torch.tensor([0.5, 0.5])
    assert top2.item() == pytest.approx((s * (s.log() - t.log())).sum().item(), rel=1e-5)
    weights = clipped_importance_weights(torch.tensor([0.0, 0.0, -1.0]), torch.tensor([-1.0, 0.5, -1.0]), 2.0)
    torch.testing.assert_close(weights, torch.tensor([2.0, torch.e**-0.5, 1.0]))


def test_successful_demonstrations():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]  # groups of 2: (1, 0), (0, 0), (1, 1)
    assert successful_demonstrations(rewards, 2, 1.0, exclude_self=True) == [None, 0, None, None, 5, 4]
    assert successful_demonstrations(rewards, 2, 1.0, exclude_self=False) == [0, 0, None, None, 4, 4]


def fixed_batch(width=4, prompt=3, teacher_prompt=5, rows=2, vocab=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(5, vocab, (rows, n), generator=generator)  # noqa: E731
    completion_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])[:rows, :width]
    teacher_mask = torch.ones(rows, teacher_prompt, dtype=torch.long)
    teacher_mask[0, 0] = 0  # a left-padded teacher prompt
    completion_ids = ids(width)
    return {
        "prompt_ids": ids(prompt),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "teacher_input_ids": torch.cat([ids(teacher_prompt), completion_ids], dim=1),
        "teacher_attention_mask": torch.cat([teacher_mask, completion_mask], dim=1),
        "old_per_token_logps": -torch.rand(rows, width, generator=generator) * 4,
        "advantages": torch.tensor([1.0, -0.5])[:rows],
        "self_distillation_mask": torch.tensor([1.0, 0.0])[:rows],
    }


def loss_and_grads(trainer, batch):
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def build_pair(name, qwen2_path, tmp_path, **config):
    """TRL's trainer and ours, same weights; the student moved off its start and the teacher set to a fixed state."""
    import importlib

    trl_module = importlib.import_module(f"trl.experimental.{name}")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen2_path, padding_side="left")
    dataset = Dataset.from_dict({"prompt": PROMPTS[:2], "privileged_context": ["x", "y"]})
    trainers = []
    for module, label in ((trl_module, "trl"), (__import__("trl_unified"), "ours")):
        Config, Trainer = getattr(module, f"{name.upper()}Config"), getattr(module, f"{name.upper()}Trainer")
        args = Config(output_dir=str(tmp_path / label), report_to=[], bf16=False, num_generations=2,
                      per_device_train_batch_size=2, **config)  # fmt: skip
        rewards = () if name == "sdft" else ([lambda completions, **kw: [0.0] * len(completions)],)
        trainers.append(Trainer(qwen2_path, *rewards, args=args, train_dataset=dataset, processing_class=tokenizer))
    torch.manual_seed(1)
    student_shift = {n: torch.randn_like(p) * 0.05 for n, p in trainers[0].model.named_parameters()}
    teacher_state = {n: p + torch.randn_like(p) * 0.05 for n, p in trainers[0].teacher_model.state_dict().items()}
    for trainer in trainers:
        with torch.no_grad():
            for n, p in trainer.model.named_parameters():
                p.add_(student_shift[n])
        if trainer.teacher_model is not trainer.model:
            trainer.teacher_model.load_state_dict(teacher_state)
    return trainers


@pytest.mark.parametrize(
    "config",
    [
        dict(distillation_mode="topk_logits", distillation_topk=8, distillation_alpha=0.5, num_loss_tokens_to_skip=1),
        dict(distillation_mode="topk_logits", distillation_topk=8, distillation_add_tail=True),
        dict(distillation_mode="full_logits", distillation_alpha=0.0, distillation_is_clip=None),
        dict(distillation_mode="sampled_token", distillation_alpha=1.0, teacher_model_kind="ema", temperature=0.7),
    ],
)
def test_sdft_loss_and_gradients_equal_trls(qwen2_path, tmp_path, config):
    theirs, ours = build_pair("sdft", qwen2_path, tmp_path, **config)
    batch = fixed_batch()
    batch.pop("self_distillation_mask"), batch.pop("advantages")
    ref_loss, ref_grads = loss_and_grads(theirs, batch)
    loss, grads = loss_and_grads(ours, batch)
    assert ref_loss.abs() > 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "config",
    [
        dict(distillation_weight=1.0),
        dict(
            distillation_weight=0.5,
            loss_type="grpo",
            distillation_mode="topk_logits",
            distillation_topk=8,
            distillation_alpha=0.5,
        ),  # fmt: skip
        dict(distillation_weight=0.3, loss_type="dr_grpo", importance_sampling_level="sequence"),
        dict(distillation_weight=0.0, loss_type="dapo", epsilon_high=0.28),
    ],
)
def test_sdpo_loss_and_gradients_equal_trls(qwen2_path, tmp_path, config):
    theirs, ours = build_pair("sdpo", qwen2_path, tmp_path, max_completion_length=6, **config)
    batch = fixed_batch()
    ref_loss, ref_grads = loss_and_grads(theirs, batch)
    loss, grads = loss_and_grads(ours, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "config",
    [
        dict(include_environment_feedback=True, remove_thinking_from_demonstration=True),
        dict(include_environment_feedback=True, environment_feedback_only_without_solution=True),
        dict(dont_reprompt_on_self_success=False, success_reward_threshold=0.5),
        dict(use_successful_as_teacher=False, include_environment_feedback=True),
    ],
)
@pytest.mark.parametrize("conversational", [False, True])
def test_sdpo_teacher_prompts_equal_trls(qwen2_path, tmp_path, config, conversational):
    """`SuccessfulRolloutContext` against TRL's `SuccessfulRolloutTeacherContextBuilder` on one generation batch
    (3 groups of 2: rewards (1, 0), (0, 0), (1, 1); feedback on some rows; texts or conversations with a system
    turn): the teacher prompts, `self_distillation_mask` and the context metrics."""
    from types import SimpleNamespace

    theirs, ours = build_pair("sdpo", qwen2_path, tmp_path, max_completion_length=6, **config)
    tokenizer = build_tokenizer([*DEFAULT_WORDS, "<think>", "</think>", "ok", "no", "yes", "wrong", "close"])
    ours.processing_class = theirs.processing_class = theirs._tokenizer = tokenizer  # decodes the demonstrations
    prompts = ["a b c", "d e", "f g", "h", "i j", "k"]
    if conversational:
        prompts = [[{"role": "system", "content": "s"}, {"role": "user", "content": p}] for p in prompts]
    feedbacks = ["wrong", "too long", "", None, "close", "  "]
    texts = ["<think> a </think> ok", "no", "no", "no", "yes", "<think> b c </think> yes"]
    completion_ids = pad([torch.tensor(tokenizer(t)["input_ids"]) for t in texts], tokenizer.pad_token_id, "right")
    completion_mask = (completion_ids != tokenizer.pad_token_id).long()
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    captured = []
    tokenize = theirs._tokenize_prompts_untruncated
    theirs._tokenize_prompts_untruncated = lambda messages: captured.extend(messages) or tokenize(messages)
    output = {"completion_ids": completion_ids, "completion_mask": completion_mask}
    expected = theirs.teacher_context_builder.build(output, prompts, rewards, feedbacks)
    batch = SimpleNamespace(rewards=rewards, completion_ids=completion_ids, row_index=torch.arange(6))
    batch.gather_global = lambda values: values  # one process
    samples = SimpleNamespace(prompts=prompts, rows=[{"privileged_context": f} for f in feedbacks])
    teacher_prompts = ours.teacher_context_builder.teacher_prompts(batch, samples, "train")
    assert teacher_prompts == captured
    torch.testing.assert_close(batch.self_distillation_mask, expected["self_distillation_mask"])
    assert ours.teacher_context_builder.last_metrics == pytest.approx(theirs.teacher_context_builder.last_metrics)


def sdft_trainer(tokenizer, tmp_path, peft_config=None, **overrides):
    defaults = dict(num_generations=1, per_device_train_batch_size=2, max_completion_length=4, distillation_topk=8)
    args = tiny_run_args(SDFTConfig, tmp_path, **{**defaults, **overrides})
    dataset = Dataset.from_dict({"prompt": PROMPTS[:4], "privileged_context": ["say a"] * 4})
    model = build_causal_lm(tokenizer)
    return SDFTTrainer(model, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)


def test_ema_teacher_update_by_hand(tokenizer, tmp_path):
    """θ_T ← (1 - r) θ_T + r θ_S after each optimiser step (r = 0.25), on a full copy."""
    trainer = sdft_trainer(tokenizer, tmp_path, teacher_model_kind="ema", teacher_update_rate=0.25, max_steps=1)
    teacher_before = {n: p.clone() for n, p in trainer.teacher_model.named_parameters()}
    trainer.train()
    for name, student in trainer.model.named_parameters():
        expected = 0.75 * teacher_before[name] + 0.25 * student.detach()
        torch.testing.assert_close(dict(trainer.teacher_model.named_parameters())[name], expected)


def test_lora_ema_teacher_adapter_by_hand(tokenizer, tmp_path):
    """A LoRA policy's EMA teacher is a second adapter, zero at the start (the base model), then r times the student
    adapter after one step; frozen throughout, and the student adapter alone is trained."""
    from peft import LoraConfig, get_peft_model_state_dict

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = sdft_trainer(tokenizer, tmp_path, lora, teacher_model_kind="ema", teacher_update_rate=0.25, max_steps=1)
    teacher = get_peft_model_state_dict(trainer.model, adapter_name="teacher")
    assert all(v.abs().sum() == 0 for v in teacher.values())
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if ".teacher." in n)
    trainer.train()
    student = get_peft_model_state_dict(trainer.model)
    teacher = get_peft_model_state_dict(trainer.model, adapter_name="teacher")
    for key, value in student.items():
        torch.testing.assert_close(teacher[key], 0.25 * value)
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if ".teacher." in n)


def test_a_resume_restores_the_ema_teacher(tokenizer, tmp_path):
    """The EMA teacher is saved with each checkpoint and read back on resume (TRL restarts it from the policy)."""

    def make():
        return sdft_trainer(
            tokenizer, tmp_path, teacher_model_kind="ema", max_steps=4, save_strategy="steps", save_steps=2
        )

    make().train()
    saved = torch.load(tmp_path / "checkpoint-2" / "trl_unified_state_0.pt", weights_only=False)
    saved = saved["trainer"]["self_teacher"]["weights"]
    resumed, restored = make(), []
    restore = resumed.restore_checkpoint_state

    def restore_and_look(state):
        restore(state)
        restored.append({k: v.clone() for k, v in resumed.teacher_model.state_dict().items()})

    resumed.restore_checkpoint_state = restore_and_look
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert len(restored) == 1 and restored[0].keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(restored[0][name], value)
    assert any(not torch.equal(restored[0][n], v) for n, v in resumed.teacher_model.state_dict().items())


def test_sdft_trains_and_logs(tokenizer, tmp_path):
    trainer = sdft_trainer(tokenizer, tmp_path, max_steps=2)
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = trainer.state.log_history
    assert any("self_distillation/distillation_loss" in log and "sdft/distillation_loss" in log for log in logs)


def test_sdft_student_moves_toward_the_informed_teacher(tokenizer, tmp_path):
    """The teacher sees the answer ("say a"): the distillation loss (its divergence from the student, on the student's
    own completions) falls as the student learns to answer without it."""
    trainer = sdft_trainer(
        tokenizer, tmp_path, max_steps=40, learning_rate=3e-3, distillation_alpha=1.0, max_completion_length=6
    )
    trainer.train()
    losses = [log["sdft/distillation_loss"] for log in trainer.state.log_history if "sdft/distillation_loss" in log]
    assert mean(losses[-8:]) < 0.7 * mean(losses[:8]), losses


def contains_a(completions, **kwargs):
    return [float("a" in c.split()) for c in completions]


def test_sdpo_learns_a_binary_reward(tokenizer, tmp_path):
    """Reward 1 when the completion says "a"; the teacher sees a successful sibling: the mean reward rises."""
    args = tiny_run_args(
        SDPOConfig,
        tmp_path,
        max_steps=40,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        distillation_weight=0.5,
        logging_steps=1,
    )
    prompts = Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(64)]})
    trainer = SDPOTrainer(
        build_causal_lm(tokenizer), contains_a, args=args, train_dataset=prompts, processing_class=tokenizer
    )
    trainer.train()
    key = "self_distillation/reward_mean"
    rewards = [log[key] for log in trainer.state.log_history if key in log]
    assert mean(rewards[-8:]) > mean(rewards[:8]) + 0.2, rewards


def test_sampled_token_distillation_reads_no_vocabulary_logits(tokenizer, tmp_path, monkeypatch):
    """SDPO's default (`sampled_token`) reads only the sampled tokens' log-probs: the student's and the teacher's
    forwards take the core's log-prob path (a group's prompt encoded once, the chunked head), never `(B, C, V)`
    logits."""
    from trl_unified.core import trainer as core_trainer
    from trl_unified.online.self_distillation import SelfDistillationCore

    calls = []
    original = core_trainer.compute_token_logprobs
    monkeypatch.setattr(core_trainer, "compute_token_logprobs", lambda *a, **k: calls.append(k) or original(*a, **k))
    monkeypatch.setattr(SelfDistillationCore, "completion_logits", lambda *a, **k: pytest.fail("(B, C, V) logits"))
    args = tiny_run_args(SDPOConfig, tmp_path, max_steps=1, per_device_train_batch_size=4, num_generations=2,
                         max_completion_length=4, success_reward_threshold=0.0)  # fmt: skip
    prompts = Dataset.from_dict({"prompt": PROMPTS[:4]})
    trainer = SDPOTrainer(
        build_causal_lm(tokenizer), contains_a, args=args, train_dataset=prompts, processing_class=tokenizer
    )
    trainer.train()
    assert trainer.args.distillation_mode == "sampled_token" and trainer.args.distillation_weight == 1.0
    assert len(calls) >= 2 and all(k["from_hidden_states"] for k in calls)  # the student's and the teacher's
    assert any(k.get("shared_prefix") for k in calls)  # the student's group of 2 reads its prompt once
    assert any(name.endswith("distillation_loss") for log in trainer.state.log_history for name in log)


class LocalTeacherClient:
    """A stand-in for the vLLM server's `get_sequence_logprobs`: each unpadded sequence scored by `model` here."""

    def __init__(self, model):
        self.model = model

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs, temperature):
        out = {"actual_logprobs": [], "logprobs": [], "logprob_token_ids": []}
        for ids, start in zip(sequences, prompt_lengths, strict=True):
            with torch.no_grad():
                logps = (self.model(torch.tensor([ids])).logits[0, :-1] / temperature).log_softmax(-1)[start - 1 :]
            top = logps.topk(top_logprobs, dim=-1)
            out["actual_logprobs"].append([[logps[t, token].item()] for t, token in enumerate(ids[start:])])
            out["logprobs"].append(top.values.tolist())
            out["logprob_token_ids"].append(top.indices.tolist())
        return out


@pytest.mark.parametrize("mode", ["sampled_token", "topk_logits"])
def test_sdpo_teacher_on_a_server(tokenizer, tmp_path, mode):
    """The live teacher scored by a server (`use_teacher_server`; here a stand-in client scoring with the same
    weights): `sampled_token` equals the local live teacher's loss; `topk_logits` is D on the teacher's top-k,
    by hand (reverse KL, α = 1)."""
    config = dict(distillation_mode=mode, distillation_topk=3 if mode == "topk_logits" else None)
    args = tiny_run_args(SDPOConfig, tmp_path, teacher_model_kind="live", num_generations=2,
                         per_device_train_batch_size=2, max_completion_length=4, **config)  # fmt: skip
    dataset = Dataset.from_dict({"prompt": PROMPTS[:2]})
    trainer = SDPOTrainer(build_causal_lm(tokenizer), contains_a, args=args, train_dataset=dataset,
                          processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    batch = fixed_batch()
    batch["self_distillation_mask"] = torch.ones(2)
    local = trainer.compute_loss(trainer.model, dict(batch))
    trainer.use_teacher_server, trainer.teacher_client = True, LocalTeacherClient(trainer.model)
    served = trainer.compute_loss(trainer.model, dict(batch))
    if mode == "sampled_token":
        torch.testing.assert_close(served, local, rtol=1e-5, atol=1e-6)
        return
    # by hand: the student's and the teacher's log-probs on the teacher's top-3 tokens, renormalised there
    student = trainer.student_outputs(trainer.model, batch).logits.log_softmax(-1)
    with torch.no_grad():
        teacher = trainer.completion_logits(trainer.model, batch["teacher_input_ids"],
                                            batch["teacher_attention_mask"], 4).log_softmax(-1)  # fmt: skip
    top = teacher.topk(3, dim=-1)
    s, t = student.gather(-1, top.indices).log_softmax(-1), top.values.log_softmax(-1)
    per_token = (s.exp() * (s - t)).sum(-1)  # reverse KL on the support
    weights = torch.exp(student.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
                        - batch["old_per_token_logps"]).clamp(max=2.0)  # fmt: skip
    mask = batch["completion_mask"].float()
    expected = ((per_token * weights * mask).sum(-1) / mask.sum(-1)).mean()
    torch.testing.assert_close(served, expected, rtol=1e-4, atol=1e-5)
