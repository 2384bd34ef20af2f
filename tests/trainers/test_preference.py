"""DPOTrainer and KTOTrainer: TRL's configs and constructors, data handling, the shared collator, precomputed
reference log-probs for later eval sets, generative accuracy next to the preference metrics, and learning."""

import copy
import dataclasses
import inspect
import math
import random
import time

import pytest
import torch
import trl
from datasets import Dataset

import trl_unified
from tests.helpers import tiny_run_args
from trl_unified import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, PairedCollator, UnpairedCollator
from trl_unified.preference.data import pack
from trl_unified.testing import build_causal_lm


@pytest.mark.parametrize("name", ["DPO", "KTO"])
def test_config_has_every_trl_field_with_the_same_default(name):
    ours = {f.name: f for f in dataclasses.fields(getattr(trl_unified, f"{name}Config"))}
    for f in dataclasses.fields(getattr(trl, f"{name}Config")):
        assert f.name in ours, f.name
        if f.default is not dataclasses.MISSING:
            assert ours[f.name].default == f.default, (f.name, ours[f.name].default, f.default)
        else:
            assert ours[f.name].default_factory() == f.default_factory(), f.name


@pytest.mark.parametrize("name", ["DPO", "KTO"])
def test_constructor_takes_trl_arguments_in_trl_order(name):
    theirs = list(inspect.signature(getattr(trl, f"{name}Trainer").__init__).parameters)
    ours = list(inspect.signature(getattr(trl_unified, f"{name}Trainer").__init__).parameters)
    assert ours == theirs


@pytest.mark.parametrize(
    "config, field, value",
    [
        (DPOConfig, "activation_offloading", True),
        (KTOConfig, "use_liger_kernel", True),
        (KTOConfig, "activation_offloading", True),
    ],
)
def test_unimplemented_fields_raise_when_set(config, field, value, tmp_path):
    with pytest.raises(NotImplementedError, match=f"{field}={value!r} is accepted for compatibility"):
        config(output_dir=str(tmp_path), **{field: value})


def test_collator_stacks_chosen_then_rejected_and_truncates():
    rows = [
        {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6], "ref_chosen_logps": -1.0,
         "ref_rejected_logps": -2.0},
        {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11], "ref_chosen_logps": -3.0,
         "ref_rejected_logps": -4.0},
    ]  # fmt: skip
    batch = PairedCollator(pad_token_id=0, max_length=4)(rows)
    assert batch.sequences.input_ids.tolist() == [[1, 2, 3, 4], [7, 8, 9, 0], [1, 2, 3, 6], [7, 8, 10, 11]]
    assert batch.sequences.completion_mask.tolist() == [[0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 1, 1]]
    assert batch.sequences.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert batch.ref_chosen_logps.tolist() == [-1.0, -3.0] and batch.ref_rejected_logps.tolist() == [-2.0, -4.0]
    second = batch.select(torch.tensor([1]))  # a pair's chosen and rejected rows stay together
    assert second.sequences.input_ids.tolist() == [[7, 8, 9, 0], [7, 8, 10, 11]]
    assert second.ref_chosen_logps.tolist() == [-3.0]
    unpaired = UnpairedCollator(pad_token_id=0)(
        [
            {"prompt_ids": [1], "completion_ids": [2, 3], "KL_completion_ids": [4], "label": True},
            {"prompt_ids": [5, 6], "completion_ids": [7], "KL_completion_ids": [2, 3], "label": False},
        ]
    )
    assert unpaired.label.tolist() == [True, False] and unpaired.ref_logps is None
    assert unpaired.kl_sequences.input_ids.tolist() == [[1, 4, 0, 0], [5, 6, 2, 3]]
    assert unpaired.kl_sequences.completion_mask.tolist() == [[0, 1, 0, 0], [0, 0, 1, 1]]
    keep_end = pack([[1, 2, 3]], [[4, 5]], pad_token_id=0, max_length=3, truncation_mode="keep_end")
    assert keep_end.input_ids.tolist() == [[3, 4, 5]] and keep_end.completion_mask.tolist() == [[0, 1, 1]]


def dpo_args(tmp_path, **overrides):
    defaults = dict(per_device_eval_batch_size=4, max_length=16, max_completion_length=4)
    return tiny_run_args(DPOConfig, tmp_path / "dpo", **{**defaults, **overrides})


def pairs(n, seed, answer=False):
    """Toy preference: chosen completions use words a-m, rejected ones n-z; prompts are random words."""
    rng = random.Random(seed)
    words = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        rows["prompt"].append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))))
        rows["chosen"].append(" " + " ".join(rng.choice(words[:13]) for _ in range(3)))
        rows["rejected"].append(" " + " ".join(rng.choice(words[13:]) for _ in range(3)))
    if answer:
        rows["answer"] = [row.split()[0] for row in rows["chosen"]]
    return rows


def test_training_changes_parameters_and_logs_trl_metrics(tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2")
    initial = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPOTrainer(model, args=dpo_args(tmp_path), train_dataset=Dataset.from_dict(pairs(8, 0)),
                         processing_class=tokenizer)  # fmt: skip
    batches, policy_loss = [], trainer.compute_policy_loss

    def recording_policy_loss(model, inputs, num_items_in_batch=None):
        batches.append(inputs.sequences)
        return policy_loss(model, inputs, num_items_in_batch)

    trainer.compute_policy_loss = recording_policy_loss
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach().cpu(), before[n])]
    assert len(changed) == len(before)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["step"] for log in logs] == [1, 2] and len(batches) == 2
    # Step 1 runs with the policy equal to the reference: h_w = h_l = 0, so every reward is 0, no pair is "accurate"
    # (strict >) and the sigmoid loss is -log sigmoid(0) = log 2. Log-probs and entropy: the untrained model's, over
    # the completion tokens of the first batch (rows 0..3 chosen, 4..7 rejected), by a plain forward.
    first = logs[0]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert first[key] == pytest.approx(0.0, abs=1e-6), key
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4)
    seq = batches[0]
    with torch.no_grad():
        logits = initial(input_ids=seq.input_ids, attention_mask=seq.attention_mask).logits[:, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    mask = seq.completion_mask[:, 1:].float()
    token_logps = log_probs.gather(-1, seq.input_ids[:, 1:, None]).squeeze(-1)
    chosen_logps, rejected_logps = (token_logps * mask).sum(1).chunk(2)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    assert first["logps/chosen"] == pytest.approx(chosen_logps.mean().item(), abs=1e-4)
    assert first["logps/rejected"] == pytest.approx(rejected_logps.mean().item(), abs=1e-4)
    assert first["entropy"] == pytest.approx(((entropy * mask).sum() / mask.sum()).item(), abs=1e-4)
    # num_tokens: the running total of non-padding tokens (prompt + completion, chosen and rejected rows) trained on.
    seen = [b.attention_mask.sum().item() for b in batches]
    assert [log["num_tokens"] for log in logs] == [seen[0], seen[0] + seen[1]]
    second = logs[1]  # after one update: margins are the mean difference, accuracies a fraction of 4 pairs
    assert second["rewards/margins"] == pytest.approx(second["rewards/chosen"] - second["rewards/rejected"], abs=1e-6)
    assert second["rewards/accuracies"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert trainer.ref_model is not None and trainer.beta == 0.1
    assert {"trl", "dpo", "trl_unified"} <= set(trainer.model.model_tags)


def test_precomputed_reference_serves_eval_sets_passed_later(tokenizer, tmp_path):
    """Before training, the policy is the reference: a new eval set gets correct reference log-probs (margins 0).
    After training, with no ref_model, TRL's error; with a ref_model, it works."""
    model = build_causal_lm(tokenizer, "qwen2")
    args = dpo_args(tmp_path, precompute_ref_log_probs=True)
    trainer = DPOTrainer(model, args=args, train_dataset=Dataset.from_dict(pairs(8, 0)), processing_class=tokenizer)
    assert trainer.reference_model.kind == "policy" and trainer.ref_model is None  # no copy is kept
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(trainer.train_dataset.column_names)
    metrics = trainer.evaluate(Dataset.from_dict(pairs(4, 1)))
    assert abs(metrics["eval_rewards/margins"]) < 1e-6 and abs(metrics["eval_rewards/chosen"]) < 1e-6
    trainer.train()
    with pytest.raises(ValueError, match="after training started"):
        trainer.evaluate(Dataset.from_dict(pairs(4, 1)))
    ref = build_causal_lm(tokenizer, "qwen2")
    trainer = DPOTrainer(build_causal_lm(tokenizer, "qwen2"), ref, args=args,
                         train_dataset=Dataset.from_dict(pairs(8, 0)), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    after = trainer.evaluate(Dataset.from_dict(pairs(4, 1)))
    trainer_fresh = DPOTrainer(build_causal_lm(tokenizer, "qwen2"), build_causal_lm(tokenizer, "qwen2"),
                               args=dpo_args(tmp_path), train_dataset=Dataset.from_dict(pairs(8, 0)),
                               processing_class=tokenizer)  # fmt: skip
    trainer_fresh.train()
    on_the_fly = trainer_fresh.evaluate(Dataset.from_dict(pairs(4, 1)))
    assert after["eval_rewards/margins"] == pytest.approx(on_the_fly["eval_rewards/margins"], abs=1e-5)
    assert after["eval_loss"] == pytest.approx(on_the_fly["eval_loss"], abs=1e-5)


def test_generative_accuracy_next_to_preference_metrics(tokenizer, tmp_path):
    trainer = DPOTrainer(
        build_causal_lm(tokenizer, "qwen2"),
        args=dpo_args(tmp_path, answer_extractor=r"regex:(\w+)"),
        train_dataset=Dataset.from_dict(pairs(8, 0)),
        eval_dataset=Dataset.from_dict(pairs(4, 1, answer=True)),
        processing_class=tokenizer,
    )
    metrics = trainer.evaluate()
    assert {"eval_accuracy", "eval_answer_parse_rate", "eval_rewards/accuracies", "eval_loss"} <= set(metrics)
    records = list(open(trainer.last_eval_records_path))
    assert len(records) == 4


def test_kto_unpairs_paired_rows_and_pairs_kl_completions_with_the_previous_row(tokenizer, tmp_path):
    args = KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, bf16=False, report_to=[],
                     gradient_checkpointing=False, save_strategy="no")  # fmt: skip
    trainer = KTOTrainer(build_causal_lm(tokenizer, "qwen2"), args=args,
                         train_dataset=Dataset.from_dict(pairs(4, 0)), processing_class=tokenizer)  # fmt: skip
    data = trainer.train_dataset
    assert data["label"] == [True] * 4 + [False] * 4
    completions, kl = data["completion_ids"], data["KL_completion_ids"]
    for block in (0, 4):  # within each device batch, row i gets row i-1's completion (the first the last's)
        assert kl[block : block + 4] == [completions[block + 3]] + completions[block : block + 3]


@pytest.mark.parametrize("trainer_name", ["DPO", "KTO"])
def test_policy_learns_held_out_preferences(trainer_name, tokenizer, tmp_path):
    """Held-out preference accuracy (policy log-prob of chosen > rejected) goes from about chance to > 0.9."""
    model = build_causal_lm(tokenizer, "qwen2", hidden_size=32, seed=0)
    held_out = Dataset.from_dict(pairs(64, 123))

    def accuracy(m):
        collate = PairedCollator(pad_token_id=tokenizer.pad_token_id)
        probe = DPOTrainer(m, args=dpo_args(tmp_path / "probe"), train_dataset=held_out, processing_class=tokenizer)
        batch = collate([probe.train_dataset[i] for i in range(len(held_out))])
        with torch.no_grad():
            logps = probe.completion_logps(m.eval(), batch.sequences).sum(1)
        chosen, rejected = logps.chunk(2)
        return (chosen > rejected).float().mean().item()

    before = accuracy(model)
    name = trainer_name.lower()
    config = (DPOConfig if name == "dpo" else KTOConfig)(
        output_dir=str(tmp_path / name), per_device_train_batch_size=8, max_steps=30, learning_rate=3e-3,
        logging_steps=5, bf16=False, report_to=[], save_strategy="no", gradient_checkpointing=False, seed=0,
    )  # fmt: skip
    trainer_class = DPOTrainer if name == "dpo" else KTOTrainer
    trainer = trainer_class(model, args=config, train_dataset=Dataset.from_dict(pairs(128, 7)),
                            processing_class=tokenizer)  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    after = accuracy(trainer.model)
    print(f"{trainer_name}: held-out accuracy {before:.2f} -> {after:.2f} in {time.perf_counter() - start:.1f}s")
    assert 0.2 < before < 0.8, before
    assert after > 0.9, after


@pytest.mark.parametrize("name", ["DPO", "KTO"])
def test_collated_batches_read_like_trls(name, llama_path, tmp_path):
    """TRL's preference collators return input_ids / attention_mask / completion_mask; users' code reads them."""
    rows = {"prompt": ["a b", "c"], "chosen": [" d e", " f"], "rejected": [" g", " h i"]}
    if name == "KTO":
        rows = {"prompt": ["a b", "c"], "completion": [" d e", " h i"], "label": [True, False]}
    args = getattr(trl_unified, f"{name}Config")(output_dir=str(tmp_path), bf16=False, report_to=[])
    trainer = getattr(trl_unified, f"{name}Trainer")(llama_path, args=args, train_dataset=Dataset.from_dict(rows))
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert "input_ids" in batch and "completion_mask" in batch and "attention_mask" in batch
    assert torch.equal(batch["input_ids"], batch.sequences.input_ids)
    assert batch["input_ids"][0, -1].item() == trainer.processing_class.eos_token_id
    mask = batch["completion_mask"][0].tolist()
    first = mask.index(1)
    assert first > 0 and not any(mask[:first])
