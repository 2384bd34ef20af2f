"""Teachers on a vLLM server (the HTTP stand-in, `tests/jobs/vllm_server_stand_in.py`, scoring with a local teacher):
the client's parsing, ServerDistillationTrainer's loss and gradients against TRL's on fixed batches, the sparse forward
KL on a support as large as the vocabulary against the dense divergence, several teachers with weights, the
vocabulary check, and training that moves the student toward the served teacher."""

import copy
import types

import pytest
import torch

from tests.helpers import prompt_dataset, tiny_run_args
from tests.jobs.vllm_server_stand_in import VLLMServerStandIn
from tests.trainers.test_distillation import fixed_batch
from trl_unified import DistillationConfig, DistillationTrainer, ServerDistillationConfig, ServerDistillationTrainer
from trl_unified.online.teachers import TeacherServer, build_teacher_request_inputs, served_vocab_size
from trl_unified.testing import build_causal_lm, build_tokenizer


trl_server = pytest.importorskip("trl.experimental.server_distillation")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture()
def served(tokenizer):
    """A stand-in vLLM server scoring with a teacher model (seed 1)."""
    teacher = build_causal_lm(tokenizer, seed=1).eval()
    server = VLLMServerStandIn(teacher=teacher)
    yield server, teacher
    server.down()


def server_args(tmp_path, url, **overrides):
    defaults = dict(teacher_model_server_url=url, max_completion_length=6, per_device_train_batch_size=2)
    return tiny_run_args(ServerDistillationConfig, tmp_path / "server", **{**defaults, **overrides})


def test_the_client_reads_the_teachers_top_k_and_sampled_log_probs(served):
    server, teacher = served
    client = TeacherServer(server.url, timeout=10)
    sequence = [5, 9, 12, 7, 8]
    result = client.get_sequence_logprobs([sequence], [2], top_logprobs=3, temperature=0.7)
    with torch.no_grad():
        log_probs = torch.log_softmax(teacher(input_ids=torch.tensor([sequence])).logits[0] / 0.7, dim=-1)
    for j, position in enumerate(range(2, len(sequence))):  # the log-probs of the token at `position`
        expected = log_probs[position - 1].topk(3)
        assert result["logprob_token_ids"][0][j] == expected.indices.tolist()
        torch.testing.assert_close(torch.tensor(result["logprobs"][0][j]), expected.values, atol=1e-5, rtol=0)
        assert result["actual_logprobs"][0][j][0] == pytest.approx(log_probs[position - 1, sequence[position]].item())
    assert served_vocab_size(server.url, 85) == teacher.config.vocab_size == 85  # the guess confirmed
    assert served_vocab_size(server.url, 40) == served_vocab_size(server.url, 200) == 85  # found by bisection


class LocalScorer:
    """TRL's client contract, answered from a local teacher (what the stand-in server computes, without HTTP)."""

    def __init__(self, teacher):
        self.teacher, self.calls = teacher, []

    def get_sequence_logprobs(self, sequences, prompt_lengths, top_logprobs, temperature):
        self.calls.append(dict(top_logprobs=top_logprobs, temperature=temperature))
        out = {"logprobs": [], "logprob_token_ids": [], "actual_logprobs": [], "actual_token_ids": []}
        for sequence, start in zip(sequences, prompt_lengths, strict=True):
            with torch.no_grad():
                logits = self.teacher(input_ids=torch.tensor([sequence])).logits[0, :-1]
            log_probs = torch.log_softmax(logits / temperature, dim=-1)[start - 1 :]
            top = log_probs.topk(top_logprobs)
            out["logprobs"].append(top.values.tolist())
            out["logprob_token_ids"].append(top.indices.tolist())
            actual = log_probs.gather(1, torch.tensor(sequence[start:])[:, None])
            out["actual_logprobs"].append(actual.tolist())
            out["actual_token_ids"].append([[t] for t in sequence[start:]])
        return out


@pytest.mark.parametrize(
    "beta, top_k, add_tail", [(1.0, 1, True), (0.5, 1, True), (0.5, 1, False), (0.0, 4, True), (0.0, 4, False)]
)
def test_loss_and_gradients_equal_trls(beta, top_k, add_tail, tokenizer, tmp_path, monkeypatch):
    import trl.generation.vllm_client as vllm_client

    student, teacher = build_causal_lm(tokenizer, seed=0), build_causal_lm(tokenizer, seed=1).eval()
    monkeypatch.setattr(vllm_client, "VLLMClient", lambda *args, **kwargs: LocalScorer(teacher))
    common = dict(
        beta=beta,
        loss_top_k=top_k,
        loss_add_tail=add_tail,
        temperature=0.8,
        report_to=[],
        bf16=False,
        use_cpu=True,
        max_steps=1,
        max_completion_length=8,
        gradient_checkpointing=False,
        teacher_model_server_url="http://teacher.invalid:8000",
    )
    pairs = (
        (ServerDistillationTrainer, ServerDistillationConfig),
        (trl_server.ServerDistillationTrainer, trl_server.ServerDistillationConfig),
    )
    losses, grads = [], []
    for cls, config in pairs:
        args = config(output_dir=str(tmp_path / cls.__module__), **common)
        trainer = cls(
            model=copy.deepcopy(student), args=args, train_dataset=prompt_dataset(), processing_class=tokenizer
        )
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        batch = {k: v for k, v in fixed_batch(tokenizer).items() if k != "num_items_in_batch"}
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad})
    assert losses[0] > 0
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_forward_kl_on_a_support_as_large_as_the_vocabulary_is_the_dense_divergence(tokenizer, tmp_path, monkeypatch):
    import trl.generation.vllm_client as vllm_client

    student, teacher = build_causal_lm(tokenizer, seed=0), build_causal_lm(tokenizer, seed=1).eval()
    monkeypatch.setattr(vllm_client, "VLLMClient", lambda *args, **kwargs: LocalScorer(teacher))
    vocabulary = student.config.vocab_size
    batch = {k: v for k, v in fixed_batch(tokenizer).items() if k != "num_items_in_batch"}
    common = dict(beta=0.0, max_steps=1, temperature=0.9, max_completion_length=8)
    served = ServerDistillationTrainer(
        copy.deepcopy(student),
        args=server_args(tmp_path, "http://t.invalid:1", loss_top_k=vocabulary, loss_add_tail=False, **common),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )
    dense = DistillationTrainer(
        copy.deepcopy(student),
        teacher,
        args=tiny_run_args(DistillationConfig, tmp_path / "dense", **common),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer,
    )
    for trainer in (served, dense):
        trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            served.compute_loss(served.model, batch), dense.compute_loss(dense.model, batch), atol=1e-5, rtol=1e-5
        )


def test_two_teachers_with_weights_give_the_weighted_sum_of_their_losses(served, tokenizer, tmp_path):
    server, served_teacher = served
    local_teacher = build_causal_lm(tokenizer, seed=2)
    batch = {k: v for k, v in fixed_batch(tokenizer).items() if k != "num_items_in_batch"}
    student = build_causal_lm(tokenizer, seed=0)

    def loss(teacher_model, url, weights):
        args = tiny_run_args(
            DistillationConfig,
            tmp_path / "mix",
            beta=1.0,
            teacher_model_server_url=url,
            teacher_weights=weights,
            max_steps=1,
            max_completion_length=8,
        )
        trainer = DistillationTrainer(
            copy.deepcopy(student),
            teacher_model,
            args=args,
            train_dataset=prompt_dataset(),
            processing_class=tokenizer,
        )
        trainer.model.eval()
        with torch.no_grad():
            return trainer.compute_loss(trainer.model, batch)

    both = loss(local_teacher, server.url, [0.5, 0.5])
    alone = loss(local_teacher, None, [1.0]), loss(None, server.url, [1.0])
    assert alone[0] != alone[1]
    torch.testing.assert_close(both, 0.5 * alone[0] + 0.5 * alone[1], atol=1e-6, rtol=1e-5)


def test_a_served_teacher_with_another_vocabulary_is_refused_before_training(tokenizer, tmp_path):
    other = build_causal_lm(build_tokenizer(["zz", "yy", *"abc"]))
    server = VLLMServerStandIn(teacher=other)
    try:
        with pytest.raises(ValueError, match="vocab_size .* teacher server at .* vocab_size"):
            ServerDistillationTrainer(
                build_causal_lm(tokenizer),
                args=server_args(tmp_path, server.url),
                train_dataset=prompt_dataset(),
                processing_class=tokenizer,
            )
    finally:
        server.down()


def test_training_against_the_served_teacher_lowers_the_divergence(served, tokenizer, tmp_path):
    server, teacher = served
    with torch.no_grad():  # a peaked teacher, far from the random student
        teacher.lm_head.weight.mul_(8.0)
    args = server_args(
        tmp_path, server.url, max_steps=40, per_device_train_batch_size=8, learning_rate=2e-2, beta=0.0, loss_top_k=16
    )
    trainer = ServerDistillationTrainer(
        build_causal_lm(tokenizer, seed=0), args=args, train_dataset=prompt_dataset(64), processing_class=tokenizer
    )
    batch = fixed_batch(tokenizer)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)

    def dense_kl():  # KL(teacher || student) over the whole vocabulary, on held-out completions
        with torch.no_grad():
            width = batch["completion_ids"].size(1)
            models = (trainer.model, teacher)
            logits = [m(input_ids=input_ids, attention_mask=attention_mask).logits[:, -width - 1 : -1] for m in models]
        labels = batch["completion_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        return ServerDistillationTrainer.generalized_jsd_loss(*logits, labels, beta=0.0).item()

    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    start = dense_kl()
    trainer.train()
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())
    assert dense_kl() < 0.8 * start  # 0.41 -> 0.30 measured
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in trainer.state.log_history if "loss" in log)


def test_request_inputs_are_trls(tokenizer):
    input_ids = torch.tensor([[0, 5, 6, 7, 8], [9, 10, 11, 12, 0]])
    attention_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    labels = torch.tensor([[-100, -100, -100, 7, 8], [-100, -100, 11, 12, -100]])
    ours = build_teacher_request_inputs(input_ids, attention_mask, labels=labels)
    assert ours == trl_server.server_distillation_trainer.build_teacher_request_inputs(
        input_ids, attention_mask, labels=labels
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(teacher_model_server_url=None), "teacher_model_server_url must be set"),
        (dict(beta=0.5, loss_top_k=2), "loss_top_k must be 1 with beta>0"),
        (dict(reverse_kl_top_1_mode="argmax"), "reverse_kl_top_1_mode='argmax' is not supported"),
        (dict(use_liger_kernel=True), "use_liger_kernel=True is not supported by ServerDistillationTrainer"),
        (dict(teacher_model_name_or_path="x"), "does not apply to server distillation"),
        (dict(beta=1.0, loss_add_tail=False), "identically 0"),
    ],
)
def test_bad_config_is_named_before_training(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        server_args(tmp_path, "http://teacher.invalid:8000", **overrides)


@pytest.mark.parametrize("beta, add_tail", [(0.0, True), (0.0, False), (0.5, True), (1.0, False)])
def test_the_student_side_in_chunks_equals_the_whole_vocabulary_at_once(beta, add_tail):
    """`student_support_divergence` from hidden states, two positions per chunk under `checkpoint`, against
    `teacher_support_divergence` on the whole (N, V) log-probs: the same D, entropy and gradients."""
    from trl_unified.online.distillation import student_support_divergence, teacher_support_divergence

    torch.manual_seed(0)
    n, hidden_size, vocabulary, k, temperature = 5, 8, 11, 3, 0.7
    hidden = torch.randn(n, hidden_size, requires_grad=True)
    head = types.SimpleNamespace(head=torch.nn.Linear(hidden_size, vocabulary, bias=False))
    head.logits = head.head
    sampled = torch.randint(vocabulary, (n,))
    topk_ids = torch.stack([torch.randperm(vocabulary)[:k] for _ in range(n)])
    teacher = torch.log_softmax(torch.randn(n, vocabulary), dim=-1)
    support = (sampled, teacher.gather(-1, sampled[:, None])[:, 0], teacher.gather(-1, topk_ids), topk_ids, beta,
               add_tail, False)  # fmt: skip
    chunked, entropy = student_support_divergence(hidden, head, temperature, support, chunk_size=2)
    chunked.sum().backward()
    grads = hidden.grad.clone(), head.head.weight.grad.clone()
    hidden.grad = head.head.weight.grad = None
    log_probs = torch.log_softmax(head.head(hidden) / temperature, dim=-1)
    whole = teacher_support_divergence(log_probs, *support[:4], beta, add_tail)
    whole.sum().backward()
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1).detach())
    torch.testing.assert_close(grads, (hidden.grad, head.head.weight.grad))
    assert not entropy.requires_grad
    empty, _ = student_support_divergence(hidden[:0], head, temperature, tuple(v[:0] if torch.is_tensor(v) else v
                                          for v in support))  # fmt: skip
    assert empty.shape == (0,) and empty.requires_grad  # a batch without loss positions still backpropagates
