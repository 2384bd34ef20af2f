"""A teacher served by a real vLLM CPU server (the `vllm` group): its top-k log-probs equal the same teacher's local
ones, its vocabulary is read and checked, a student distilled from it moves toward it, and two teachers with
weights 0.5 / 0.5 give the weighted sum of their losses."""

import copy

import pytest
import torch

from tests.helpers import prompt_dataset, tiny_run_args
from tests.trainers.test_distillation import fixed_batch
from tests.vllm.test_vllm import HIDDEN, vllm_server
from trl_unified import DistillationConfig, DistillationTrainer, ServerDistillationConfig, ServerDistillationTrainer
from trl_unified.online.teachers import TeacherServer, served_vocab_size
from trl_unified.testing import build_causal_lm


pytestmark = pytest.mark.vllm


def local_log_probs(teacher, sequence, temperature=1.0):
    with torch.no_grad():
        logits = teacher(input_ids=torch.tensor([sequence])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)  # row p scores the token at p + 1


def own_completions_kl(trainer, teacher):
    """KL(teacher || student) over the whole vocabulary on the student's own greedy completions of held-out prompts
    (where on-policy distillation trains it)."""
    trainer.model.eval()
    batch = trainer.rollout([{"prompt": p} for p in prompt_dataset(16)["prompt"]])
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    width = batch.completion_ids.size(1)
    with torch.no_grad():
        logits = [
            m(input_ids=input_ids, attention_mask=attention_mask).logits[:, -width - 1 : -1]
            for m in (trainer.model, teacher)
        ]
    labels = batch.completion_ids.masked_fill(batch.completion_mask == 0, -100)
    return DistillationTrainer.generalized_jsd_loss(*logits, labels, beta=0.0).item()


def test_a_served_teacher_scores_as_the_local_one_and_a_student_learns_from_it(tokenizer, tmp_path):
    teacher = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=1).eval()
    with torch.no_grad():  # a peaked teacher, far from the random student
        teacher.lm_head.weight.mul_(4.0)
    student = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=0)
    batch = {k: v for k, v in fixed_batch(tokenizer).items() if k != "num_items_in_batch"}
    with vllm_server(teacher, tokenizer, tmp_path) as (port, _):
        url = f"http://127.0.0.1:{port}"
        client = TeacherServer(url, timeout=240)
        assert served_vocab_size(url, 85) == teacher.config.vocab_size == 85

        # 1. the top-5 and the sampled token's log-prob, position by position, against the local teacher's
        sequences = [[5, 9, 12, 7, 8, 30, 31], [6, 11, 40, 41]]
        result = client.get_sequence_logprobs(sequences, [2, 1], top_logprobs=5, temperature=1.0)
        for row, (sequence, start) in enumerate(zip(sequences, [2, 1], strict=True)):
            local = local_log_probs(teacher, sequence)
            for j, position in enumerate(range(start, len(sequence))):
                top = local[position - 1].topk(5)
                torch.testing.assert_close(torch.tensor(result["logprobs"][row][j]), top.values, atol=1e-4, rtol=0)
                assert result["logprob_token_ids"][row][j] == top.indices.tolist()
                own = local[position - 1, sequence[position]].item()
                assert result["actual_logprobs"][row][j][0] == pytest.approx(own, abs=1e-4)

        # 2. two teachers, 0.5 / 0.5: the weighted sum of each one's loss
        other = build_causal_lm(tokenizer, "qwen2", hidden_size=HIDDEN, seed=2)

        def loss(local, served, weights):
            args = tiny_run_args(
                DistillationConfig,
                tmp_path / "mix",
                beta=1.0,
                teacher_model_server_url=served,
                teacher_weights=weights,
                max_steps=1,
                max_completion_length=8,
            )
            trainer = DistillationTrainer(
                copy.deepcopy(student), local, args=args, train_dataset=prompt_dataset(), processing_class=tokenizer
            )
            trainer.model.eval()
            with torch.no_grad():
                return trainer.compute_loss(trainer.model, batch)

        both = loss(other, url, [0.5, 0.5])
        torch.testing.assert_close(
            both, 0.5 * loss(other, None, [1.0]) + 0.5 * loss(None, url, [1.0]), atol=1e-5, rtol=1e-4
        )

        # 3. a student distilled from the served teacher moves toward it
        args = tiny_run_args(
            ServerDistillationConfig,
            tmp_path / "server",
            teacher_model_server_url=url,
            beta=0.0,
            loss_top_k=16,
            max_steps=30,
            per_device_train_batch_size=8,
            learning_rate=5e-3,
            max_completion_length=8,
        )
        trainer = ServerDistillationTrainer(
            copy.deepcopy(student), args=args, train_dataset=prompt_dataset(64), processing_class=tokenizer
        )
        start = own_completions_kl(trainer, teacher)
        trainer.train()
        assert own_completions_kl(trainer, teacher) < 0.8 * start  # 0.49 -> 0.25 against the stand-in
