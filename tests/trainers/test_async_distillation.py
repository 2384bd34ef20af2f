"""AsyncDistillationTrainer against HTTP stand-ins of vLLM servers (tests/jobs/vllm_server_stand_in.py: one samples
for the student, each teacher scores with a local model): TRL's constructor and fields, the support (top-k and the
sampled token), asynchronous training that logs TRL's metrics, and rows routed to their own teacher."""

import copy
import dataclasses
import inspect

import pytest
import torch
from datasets import Dataset

from tests.helpers import PROMPTS, tiny_run_args
from tests.jobs.vllm_server_stand_in import VLLMServerStandIn
from tests.trainers.test_distillation import fixed_batch
from trl_unified import AsyncDistillationConfig, AsyncDistillationTrainer, DistillationConfig, DistillationTrainer
from trl_unified.online.distillation import teacher_support_divergence
from trl_unified.testing import build_causal_lm, build_tokenizer


trl_async = pytest.importorskip("trl.experimental.async_distillation")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture()
def servers(tokenizer):
    """The student's server (it samples) and two teacher servers (seeds 1 and 2)."""
    stand_ins = [VLLMServerStandIn(completion=(7, 8, 9, 10))]
    stand_ins += [VLLMServerStandIn(teacher=build_causal_lm(tokenizer, seed=seed).eval()) for seed in (1, 2)]
    yield stand_ins
    for stand_in in stand_ins:
        stand_in.down()


def async_args(tmp_path, student_url, teachers, **overrides):
    settings = dict(
        vllm_server_base_url=student_url,
        vllm_server_timeout=20,
        teacher_server_urls=teachers,
        max_staleness=1,
        max_completion_length=8,
        per_device_train_batch_size=4,
        max_steps=3,
    )
    return tiny_run_args(AsyncDistillationConfig, tmp_path / "async", **{**settings, **overrides})


def test_config_has_every_trl_field_with_trls_default():
    def default(f):
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    ours = {f.name: default(f) for f in dataclasses.fields(AsyncDistillationConfig)}
    for f in dataclasses.fields(trl_async.AsyncDistillationConfig):
        assert f.name in ours, f.name
        if f.name not in ("output_dir", "bf16"):
            assert ours[f.name] == default(f), (f.name, ours[f.name], default(f))


def test_constructor_takes_trls_arguments_in_trls_order():
    theirs = list(inspect.signature(trl_async.AsyncDistillationTrainer.__init__).parameters)
    assert list(inspect.signature(AsyncDistillationTrainer.__init__).parameters)[: len(theirs)] == theirs


def test_the_forward_support_is_the_top_k_and_the_sampled_token():
    """beta = 0: the teacher's top-2 and, where it is not among them, the sampled token (TRL's reported candidates)."""
    student = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]]), dim=-1)
    teacher_top = torch.log(torch.tensor([[0.5, 0.3], [0.6, 0.2]]))
    ids = torch.tensor([[3, 2], [0, 1]])
    sampled, sampled_lp = torch.tensor([0, 1]), torch.log(torch.tensor([0.1, 0.2]))
    d = teacher_support_divergence(student, sampled, sampled_lp, teacher_top, ids, 0.0, False, with_sampled=True)
    t0 = torch.tensor([0.5, 0.3, 0.1]) / 0.9  # row 0: {3, 2, 0} renormalised
    s0 = student[0, [3, 2, 0]].exp() / student[0, [3, 2, 0]].exp().sum()
    t1 = torch.tensor([0.6, 0.2]) / 0.8  # row 1: the sampled token 1 is the top-2's second
    s1 = student[1, [0, 1]].exp() / student[1, [0, 1]].exp().sum()
    expected = torch.stack([(t0 * (t0.log() - s0.log())).sum(), (t1 * (t1.log() - s1.log())).sum()])
    torch.testing.assert_close(d, expected)


def test_asynchronous_training_against_served_teachers(servers, tokenizer, tmp_path):
    student_server, teacher_server, _ = servers
    args = async_args(tmp_path, student_server.url, teacher_server.url)
    trainer = AsyncDistillationTrainer(
        build_causal_lm(tokenizer, seed=0),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 3
    assert any(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    logged = {key for log in trainer.state.log_history for key in log}
    assert {"jsd", "entropy", "sample/staleness_mean", "perf/rollout_wait_s"} <= logged
    scored = [body for body in teacher_server.bodies if body and body.get("prompt_logprobs") is not None]
    assert scored and all(body["prompt_logprobs"] == 8 for body in scored)


def test_each_row_is_scored_by_its_own_teacher(servers, tokenizer, tmp_path):
    student_server, first, second = servers
    teachers = {"first": first.url, "second": second.url}
    student = build_causal_lm(tokenizer, seed=0)
    batch = {k: v for k, v in fixed_batch(tokenizer).items() if k != "num_items_in_batch"}
    args = async_args(tmp_path, student_server.url, teachers, beta=1.0)
    routed = AsyncDistillationTrainer(
        copy.deepcopy(student),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS, "teacher_id": ["first"] * 8}),
        processing_class=tokenizer,
    )
    routed.model.eval()
    with torch.no_grad():
        loss = routed.compute_loss(routed.model, {**batch, "teacher_index": torch.tensor([0, 1, 1])})
        alone = []
        for url in (first.url, second.url):  # each teacher alone on every row, as the plain distillation trainer
            plain = DistillationTrainer(
                copy.deepcopy(student),
                args=tiny_run_args(
                    DistillationConfig,
                    tmp_path / "plain",
                    beta=1.0,
                    teacher_model_server_url=url,
                    loss_top_k=1,
                    max_completion_length=8,
                    max_steps=1,
                ),
                train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                processing_class=tokenizer,
            )
            plain.model.eval()
            rows = []
            for i in range(3):
                one = {k: v[i : i + 1] for k, v in batch.items()}
                rows.append(plain.compute_loss(plain.model, one) * batch["completion_mask"][i].sum())
            alone.append(rows)
    expected = (alone[0][0] + alone[1][1] + alone[1][2]) / batch["completion_mask"].sum()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-4)


def test_a_row_naming_no_teacher_is_refused_with_trls_message(servers, tokenizer, tmp_path):
    student_server, first, second = servers
    args = async_args(tmp_path, student_server.url, {"first": first.url, "second": second.url})
    rows = Dataset.from_dict({"prompt": PROMPTS, "teacher_id": ["third"] * len(PROMPTS)})
    trainer = AsyncDistillationTrainer(
        build_causal_lm(tokenizer), args=args, train_dataset=rows, processing_class=tokenizer
    )
    with pytest.raises(ValueError, match="`teacher_id='third'`, which is not among the teachers"):
        trainer.train()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(async_rollouts=False), "use_vllm and async_rollouts must stay True"),
        (dict(teacher_server_urls={}), "teacher_server_urls must have at least one entry"),
        (dict(beta=1.5), r"beta must be in \[0.0, 1.0\]"),
        (dict(teacher_model_name_or_path="x"), "does not apply to asynchronous distillation"),
    ],
)
def test_bad_config_is_named_before_training(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        async_args(tmp_path, "http://student.invalid:1", "http://teacher.invalid:2", **overrides)
