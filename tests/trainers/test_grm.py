import json
import math
import random

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from tests.helpers import tiny_run_args
from trl_unified import GRMConfig, GRMTrainer
from trl_unified.testing import build_causal_lm, build_image, build_vision_language_model


LLAMA3_TEMPLATE = (  # a different template shape: headers and an end-of-turn marker after every message
    "{% for m in messages %}{{ '<|im_start|> ' + m['role'] + ' : ' + m['content'] + ' <|im_end|> ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|> assistant : ' }}{% endif %}"
)


def judging_row(a, b):
    return {
        "prompt": [{"role": "user", "content": f"which is larger : {a} or {b} ?"}],
        "completion": [{"role": "assistant", "content": f"<answer> {max(a, b)} </answer>"}],
    }


def grm_args(tmp_path, **overrides):
    defaults = dict(learning_rate=1e-3, max_completion_length=6, per_device_eval_batch_size=8)
    return tiny_run_args(GRMConfig, tmp_path / "grm", **{**defaults, **overrides})


# ------------------------------------------------------------------ data and masks
def labelled_text(trainer, row_index=0, dataset=None):
    batch = trainer.data_collator([(dataset or trainer.train_dataset)[row_index]])
    labels = batch["labels"][0, 1:]  # targets: position 0 is never predicted
    return trainer.processing_class.decode(labels[labels != -100])


@pytest.mark.parametrize("fmt", ["standard", "conversational", "messages", "other_template"])
def test_loss_mask_covers_the_judgment_only(fmt, qwen2_model, tokenizer, tmp_path):
    tok = tokenizer
    if fmt == "standard":
        data = {"prompt": ["which is larger : 3 or 7 ?"], "completion": ["<answer> 7 </answer>"]}
        expected = "<answer> 7 </answer> <|endoftext|>"
    elif fmt == "messages":
        data = {
            "messages": [
                [
                    {"role": "user", "content": "which is larger : 3 or 7 ?"},
                    {"role": "assistant", "content": "<answer> 7 </answer>"},
                ]
            ]
        }
        expected = "<answer> 7 </answer> <|im_end|>"
    else:
        data = {k: [v] for k, v in judging_row(3, 7).items()}
        expected = "<answer> 7 </answer> <|im_end|>"
        if fmt == "other_template":
            tok = type(tokenizer)(
                tokenizer_object=tokenizer.backend_tokenizer,
                eos_token="<|endoftext|>",
                pad_token="<pad>",
                unk_token="<unk>",
            )
            tok.chat_template = LLAMA3_TEMPLATE
            expected = "<answer> 7 </answer> <|im_end|>"
    trainer = GRMTrainer(
        qwen2_model, args=grm_args(tmp_path), train_dataset=Dataset.from_dict(data), processing_class=tok
    )
    assert labelled_text(trainer) == expected


def test_assistant_only_loss_uses_template_spans(qwen2_model, tokenizer, tmp_path):
    data = {
        "messages": [
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b c"},
                {"role": "user", "content": "d"},
                {"role": "assistant", "content": "<answer> e </answer>"},
            ]
        ]
    }
    trainer = GRMTrainer(
        qwen2_model,
        args=grm_args(tmp_path, assistant_only_loss=True),
        train_dataset=Dataset.from_dict(data),
        processing_class=tokenizer,
    )
    assert labelled_text(trainer) == "b c <|im_end|> <answer> e </answer> <|im_end|>"  # both assistant turns


def test_text_rows_learn_every_token(qwen2_model, tokenizer, tmp_path):
    trainer = GRMTrainer(
        qwen2_model,
        args=grm_args(tmp_path),
        train_dataset=Dataset.from_dict({"text": ["a b c d"]}),
        processing_class=tokenizer,
    )
    assert labelled_text(trainer) == "b c d <|endoftext|>"  # position 0 is never a target


# ------------------------------------------------------------------ loss
def test_loss_matches_hand_computation(qwen2_model, tokenizer, tmp_path):
    data = Dataset.from_list([judging_row(1, 5), judging_row(9, 2), judging_row(4, 3)])
    trainer = GRMTrainer(qwen2_model, args=grm_args(tmp_path), train_dataset=data, processing_class=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    loss, _ = trainer.compute_policy_loss(trainer.model, batch, num_items_in_batch=torch.tensor(20))
    logits = qwen2_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    total, count = 0.0, 0
    for row in range(3):
        for t in range(1, batch["input_ids"].size(1)):
            if batch["labels"][row, t] != -100:
                total -= torch.log_softmax(logits[row, t - 1], -1)[batch["labels"][row, t]]
                count += 1
    assert count == int((batch["labels"][:, 1:] != -100).sum()) > 0
    torch.testing.assert_close(loss, total / 20)  # normalised by the step's judgment-token count, not the batch's
    loss_eval, _ = trainer.compute_policy_loss(trainer.model, batch)
    torch.testing.assert_close(loss_eval, total / count)


class GradRecorder(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def test_gradient_accumulation_gives_the_same_update(tokenizer, tmp_path):
    rows = [judging_row(a, b) for a, b in [(1, 5), (9, 2), (4, 3), (7, 8), (0, 6), (12, 3), (5, 15), (2, 1)]]
    rows[1]["completion"][0]["content"] = "it is 9 , so <answer> 9 </answer>"  # unequal judgment lengths
    grads, params = {}, {}
    for name, kw in {
        "bs8": dict(per_device_train_batch_size=8),
        "bs4_ga2": dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
    }.items():
        recorder = GradRecorder()
        trainer = GRMTrainer(
            build_causal_lm(tokenizer, "qwen2"),
            args=grm_args(tmp_path, max_steps=1, max_grad_norm=1e9, optim="sgd", **kw),
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[recorder],
        )
        trainer.get_train_dataloader = _ordered_loader(trainer)
        trainer.train()
        grads[name], params[name] = recorder.grads[0], dict(trainer.model.named_parameters())
    for key in grads["bs8"]:
        torch.testing.assert_close(grads["bs4_ga2"][key], grads["bs8"][key], rtol=1e-5, atol=1e-7, msg=key)
        torch.testing.assert_close(params["bs4_ga2"][key], params["bs8"][key], rtol=1e-5, atol=1e-7, msg=key)


def _ordered_loader(trainer):
    """The same row order in both runs (no shuffling), so the two splits see the same 8 rows."""
    from torch.utils.data import DataLoader, SequentialSampler

    def loader():
        return trainer.accelerator.prepare(
            DataLoader(
                trainer._remove_unused_columns(trainer.train_dataset, "training"),
                batch_size=trainer._train_batch_size,
                sampler=SequentialSampler(trainer.train_dataset),
                collate_fn=trainer.data_collator,
            )
        )

    return loader


def test_training_changes_every_parameter_and_logs(qwen2_model, tokenizer, tmp_path):
    data = Dataset.from_list([judging_row(a, b) for a, b in [(1, 5), (9, 2), (4, 3), (7, 8)]])
    trainer = GRMTrainer(qwen2_model, args=grm_args(tmp_path), train_dataset=data, processing_class=tokenizer)
    # Step 1's batch is all 4 rows (in some order) under the initial weights: its metrics can be computed by hand.
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        logits = qwen2_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    nll = torch.nn.functional.cross_entropy(logits[mask], targets[mask], reduction="sum")
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    after_step_1 = {}

    class AfterStep1(TrainerCallback):  # step 2's batch is the same 4 rows: its metrics, from step 1's weights
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                with torch.no_grad():
                    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
                after_step_1["nll"] = torch.nn.functional.cross_entropy(out[mask], targets[mask]).item()
                after_step_1["acc"] = (((out.argmax(-1) == targets) & mask).sum() / mask.sum()).item()

    trainer.add_callback(AfterStep1())
    trainer.train()
    for name, p in trainer.model.named_parameters():
        if name.endswith("k_proj.bias"):  # its gradient is exactly 0: softmax ignores a score shift shared by all keys
            continue
        assert not torch.equal(p, before[name]), name
    first, second = trainer.state.log_history[:2]
    assert first["step"] == 1 and second["step"] == 2
    assert first["num_judgment_tokens"] == second["num_judgment_tokens"] == int(mask.sum()) > 0
    assert first["mean_token_accuracy"] == pytest.approx(
        (((logits.argmax(-1) == targets) & mask).sum() / mask.sum()).item()
    )
    assert first["loss"] == pytest.approx((nll / mask.sum()).item(), rel=1e-5)
    assert second["loss"] == pytest.approx(after_step_1["nll"], rel=1e-5)
    assert second["mean_token_accuracy"] == pytest.approx(after_step_1["acc"])


# ------------------------------------------------------------------ bad input
# Malformed datasets, images with a text tokenizer and `packing` are cases of tests/test_bad_input.py's CASES table.
@pytest.mark.parametrize("field, value", [("padding_free", True), ("loss_type", "dft")])
def test_unimplemented_sft_fields_raise(field, value, tmp_path):
    with pytest.raises(NotImplementedError, match=field):
        grm_args(tmp_path, **{field: value})


# ------------------------------------------------------------------ evaluation and learning
def test_grm_learns_to_judge_which_number_is_larger(tokenizer, tmp_path):
    rng = random.Random(0)
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]
    rng.shuffle(pairs)
    train, held_out = (
        Dataset.from_list([judging_row(a, b) for a, b in pairs[:70]] * 4),
        Dataset.from_list([judging_row(a, b) for a, b in pairs[70:]]),
    )
    args = grm_args(
        tmp_path,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        max_steps=150,
        logging_steps=50,
        lr_scheduler_type="constant",
        per_device_eval_batch_size=20,
    )
    trainer = GRMTrainer(
        build_causal_lm(tokenizer, "qwen2", hidden_size=64),
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=tokenizer,
    )
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    after = trainer.evaluate()
    # Chance: the best judge that ignores the numbers and always names the same position (first or second).
    first_wins = sum(a > b for a, b in pairs[70:]) / len(held_out)
    chance = max(first_wins, 1 - first_wins)
    print(f"held-out accuracy {before:.2f} -> {after['eval_accuracy']:.2f} (chance {chance:.2f})")
    assert after["eval_accuracy"] >= 0.8 and after["eval_accuracy"] >= chance + 0.2
    assert after["eval_accuracy"] > before + 0.3
    with open(trainer.last_eval_records_path) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == len(held_out) and all(r["reference"] == str(max(*_pair(r["prompt"]))) for r in records)
    assert all(r["correct"] == (r["predicted"] == r["reference"]) for r in records)
    assert after["eval_accuracy"] == pytest.approx(sum(r["correct"] for r in records) / len(records))


def _pair(prompt):
    words = prompt[0]["content"].split()
    return int(words[4]), int(words[6])


# ------------------------------------------------------------------ vision-language
def test_vision_language_grm_trains_and_evaluates(tmp_path):
    model, processor = build_vision_language_model()
    rows = [
        {
            "prompt": [{"role": "user", "content": "which image is brighter ?"}],
            "completion": [{"role": "assistant", "content": f"<answer> {'A' if i % 2 else 'B'} </answer>"}],
            "images": [build_image(i)],
        }
        for i in range(8)
    ]
    rows[0] = {"prompt": rows[0]["prompt"], "completion": rows[0]["completion"], "image": build_image(0)}
    rows = rows[1:]  # one shape per dataset: "images" rows
    trainer = GRMTrainer(
        model,
        args=grm_args(tmp_path, max_steps=2),
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        processing_class=processor,
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert (
        "pixel_values" in batch.visual_inputs
        and processor.decode(batch["labels"][0][batch["labels"][0] != -100]) == "<answer> A </answer> <|im_end|>"
    )
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(
        not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if not n.endswith("k_proj.bias")
    )
    metrics = trainer.evaluate()
    with open(trainer.last_eval_records_path) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == len(rows)
    assert metrics["eval_accuracy"] == pytest.approx(sum(r["correct"] for r in records) / len(rows))
    assert 0.0 < metrics["eval_loss"] < math.inf  # a mean judgment NLL


def test_formatting_func_builds_text_rows(qwen2_model, tokenizer, tmp_path):
    data = Dataset.from_dict({"question": ["a b"], "verdict": ["c d"]})
    trainer = GRMTrainer(
        qwen2_model,
        args=grm_args(tmp_path),
        train_dataset=data,
        processing_class=tokenizer,
        formatting_func=lambda row: f"{row['question']} {row['verdict']}",
    )
    assert labelled_text(trainer) == "b c d <|endoftext|>"


def test_streaming_dataset_trains_like_the_map_style_one(tokenizer, tmp_path):
    """`trl.SFTTrainer` trains on an IterableDataset; so does GRMTrainer, with the same rows giving the same update."""
    from datasets import IterableDataset

    from trl_unified.testing import build_causal_lm

    rows = [judging_row(a, b) for a, b in [(1, 2), (5, 3), (7, 9), (4, 0)] * 2]
    params = {}
    for kind, data in (
        ("map", Dataset.from_list(rows)),
        ("stream", IterableDataset.from_generator(lambda: iter(rows))),
    ):
        model = build_causal_lm(tokenizer, "qwen2")
        before = {n: p.clone() for n, p in model.named_parameters()}
        args = grm_args(tmp_path / kind, dataloader_drop_last=False)
        trainer = GRMTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
        if kind == "map":  # same row order as the stream
            trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
            # Step 1 trains rows 0-3 under the initial weights: its loss is their mean judgment-token NLL.
            batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            targets = batch["labels"][:, 1:]
            mask = targets != -100
            first_loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask]).item()
        trainer.train()
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        assert len(losses) == 2 and losses[0] == pytest.approx(first_loss, rel=1e-5), kind
        for name, p in model.named_parameters():
            assert not torch.equal(p, before[name]), f"{kind}: {name} did not change"
        params[kind] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, p in params["map"].items():
        torch.testing.assert_close(params["stream"][name], p, rtol=1e-5, atol=1e-6, msg=name)
