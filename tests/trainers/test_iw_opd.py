"""IWOPDTrainer: TRL's config and constructor; IW-OPD's weights by hand; its loss and every `jsd` path against TRL's
IWOPDTrainer on collated batches (losses and gradients); training that logs TRL's metrics and moves the student
toward the teacher."""

import dataclasses
import inspect

import pytest
import torch

from tests.helpers import tiny_run_args
from tests.trainers.test_gkd import conversations
from trl_unified import IWOPDConfig, IWOPDTrainer
from trl_unified.core.divergence import position_weighted_advantages
from trl_unified.testing import build_causal_lm, build_tool_tokenizer, save_tiny_model


trl_iw_opd = pytest.importorskip("trl.experimental.iw_opd")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tool_tokenizer()


def test_config_has_every_trl_field_with_trls_default():
    def default(f):
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    ours = {f.name: default(f) for f in dataclasses.fields(IWOPDConfig)}
    for f in dataclasses.fields(trl_iw_opd.IWOPDConfig):
        assert f.name in ours, f.name
        if f.name not in ("output_dir", "bf16"):
            assert ours[f.name] == default(f), (f.name, ours[f.name], default(f))


def test_constructor_signature_is_trls():
    theirs = inspect.signature(trl_iw_opd.IWOPDTrainer.__init__).parameters
    assert list(inspect.signature(IWOPDTrainer.__init__).parameters) == list(theirs)


def test_weights_and_advantages_by_hand():
    """a = teacher - rollout on valid tokens; w_t = 1 + gamma (1 - S_t / Z), S_t the |a| before t, Z their sum."""
    teacher = torch.tensor([[0.2, -0.3, 0.5, 9.0]])
    rollout = torch.zeros(1, 4)
    valid = torch.tensor([[True, True, True, False]])
    advantage, weights = position_weighted_advantages(teacher, rollout, valid, gamma=0.5, epsilon=1e-8)
    torch.testing.assert_close(advantage, torch.tensor([[0.2, -0.3, 0.5, 0.0]]))
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5 - 0.5 * 0.2, 1.5 - 0.5 * 0.5, 1.0]]))


@pytest.mark.parametrize(
    "objective, beta, top_k, add_tail",
    [
        ("iw_opd", 1.0, 1, True),
        ("jsd", 0.5, 0, True),
        ("jsd", 0.5, 1, True),
        ("jsd", 1.0, 1, True),
        ("jsd", 0.0, 3, True),
        ("jsd", 0.0, 3, False),
        ("jsd", 1.0, 3, True),
    ],
)
def test_loss_and_gradients_equal_trls_on_a_collated_batch(objective, beta, top_k, add_tail, tokenizer, tmp_path):
    # TRL's trainer loads the teacher's tokenizer from its path: both models are saved first
    student = save_tiny_model(build_causal_lm(tokenizer, "qwen2", seed=0), tokenizer, str(tmp_path / "student"))
    teacher = save_tiny_model(build_causal_lm(tokenizer, "qwen2", seed=1), tokenizer, str(tmp_path / "teacher"))
    common = dict(
        distillation_objective=objective,
        beta=beta,
        loss_top_k=top_k,
        loss_add_tail=add_tail,
        temperature=0.8,
        report_to=[],
        bf16=False,
        use_cpu=True,
        max_steps=1,
        gradient_checkpointing=False,
        max_length=64,
        max_completion_length=16,
    )
    pairs = ((IWOPDTrainer, IWOPDConfig), (trl_iw_opd.IWOPDTrainer, trl_iw_opd.IWOPDConfig))
    rows = [conversations(4)[i] for i in range(4)]
    losses, grads = [], []
    for cls, config in pairs:
        args = config(output_dir=str(tmp_path / cls.__module__), **common)
        trainer = cls(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=conversations(4),
            processing_class=tokenizer,
        )
        batch = {k: v for k, v in trainer.data_collator(rows).items() if isinstance(v, torch.Tensor)}
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad})
    assert losses[0] != 0
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_iw_opd_trains_logs_trls_metrics_and_moves_the_student_toward_the_teacher(tokenizer, tmp_path):
    """On the student's own completions of held-out prompts (where IW-OPD's signal is), the reverse KL to the teacher
    falls: 0.0126 -> 0.0070 measured (100 steps of 16 rows)."""
    student, teacher = build_causal_lm(tokenizer, "qwen2", seed=0), build_causal_lm(tokenizer, "qwen2", seed=1)
    args = tiny_run_args(
        IWOPDConfig,
        tmp_path / "iw",
        max_steps=100,
        per_device_train_batch_size=16,
        learning_rate=3e-2,
        max_length=64,
        max_completion_length=8,
        logging_steps=10,
    )
    trainer = IWOPDTrainer(student, teacher, args=args, train_dataset=conversations(64), processing_class=tokenizer)
    rows = trainer.rows_of(trainer.data_collator([conversations(40)[i] for i in range(16, 40)]))

    def reverse_kl():  # KL(student || teacher) over the whole vocabulary, on the student's greedy completions
        trainer.model.eval()
        trainer.mix.eval_source = "policy"
        batch = trainer.rollout(rows)
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
        width = batch.completion_ids.size(1)
        with torch.no_grad():
            logits = [
                m(input_ids=input_ids, attention_mask=attention_mask).logits[:, -width - 1 : -1]
                for m in (trainer.model, trainer.teacher_model)
            ]
        labels = batch.completion_ids.masked_fill(batch.completion_mask == 0, -100)
        return IWOPDTrainer.generalized_jsd_loss(*logits, labels, beta=1.0).item()

    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    start = reverse_kl()
    trainer.train()
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    assert reverse_kl() < 0.7 * start
    logged = {key for log in trainer.state.log_history for key in log}
    assert {"iw_opd/mean_weight", "iw_opd/min_weight", "iw_opd/max_weight", "iw_opd/mean_advantage"} <= logged
