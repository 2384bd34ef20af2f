"""What a TRL user runs into (issue "drop-in, round three"): each finding of the TRL-conformance runs and of the
new-user probe, as a test in our own suite. TRL's own tests run through ../shared/trl_conformance (see
benchmarks/RESULTS.md, "Conformance")."""

import logging

import pytest
import torch
from datasets import Dataset
from transformers import DynamicCache, GenerationConfig

from tests.helpers import count_a, prompt_dataset, rloo_args, tiny_run_args, varied_reward
from trl_unified import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    PolicyTrainerBase,
    RLOOTrainer,
    answers_match,
    compute_token_logprobs,
    generate_batched,
)
from trl_unified.evaluation.answers import reference_answers
from trl_unified.generation.sharing import _unsupported
from trl_unified.testing import build_causal_lm


PAIRS = {
    "prompt": ["a b c", "d e", "f g h i", "j k"] * 2,
    "chosen": [" a b", " c", " d e f", " g"] * 2,
    "rejected": [" o", " p q", " r", " s t u"] * 2,
}


def pref_args(config, tmp_path, **overrides):
    return tiny_run_args(config, tmp_path / "pref", **overrides)


# ------------------------------------------------------------------ models and references
def test_models_load_in_float32_by_default_and_an_explicit_reference_stays_frozen(llama_path, tmp_path):
    """TRL loads a model id in float32 unless model_init_kwargs says otherwise; a reference passed in is used as it
    is and never trained (TRL's test_train_with_explicit_ref_model)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.bfloat16).float()
    before = {n: p.clone() for n, p in reference.named_parameters()}
    trainer = DPOTrainer(
        llama_path, ref_model=reference, args=pref_args(DPOConfig, tmp_path), train_dataset=Dataset.from_dict(PAIRS)
    )
    assert trainer.model.dtype == torch.float32 and trainer.ref_model is reference
    trainer.train()
    for name, value in before.items():
        assert torch.equal(value, trainer.ref_model.get_parameter(name)), name
    with pytest.raises(ValueError, match="Invalid `dtype`"):
        RLOOTrainer(
            llama_path,
            varied_reward,
            args=rloo_args(tmp_path, model_init_kwargs={"dtype": "int8"}),
            train_dataset=prompt_dataset(),
        )


@pytest.mark.parametrize("make", ["rloo", "grpo", "dpo", "kto"])
def test_trl_attributes_read_by_callbacks(make, llama_path, tmp_path):
    if make in ("rloo", "grpo"):
        trainer_class, config = (RLOOTrainer, rloo_args(tmp_path)) if make == "rloo" else (GRPOTrainer, None)
        config = config or GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=8,
            bf16=False,
            report_to=[],
        )
        trainer = trainer_class(llama_path, varied_reward, args=config, train_dataset=prompt_dataset())
    else:
        trainer_class, config_class = (DPOTrainer, DPOConfig) if make == "dpo" else (KTOTrainer, KTOConfig)
        trainer = trainer_class(
            llama_path, args=pref_args(config_class, tmp_path), train_dataset=Dataset.from_dict(PAIRS)
        )
    assert trainer.aux_loss_enabled is False and trainer.router_aux_loss_coef == 0.0  # a dense model


# ------------------------------------------------------------------ online trainers
def test_an_iterable_eval_set_passed_to_evaluate(llama_path, tmp_path):
    """Untrained, the policy is the reference (KL 0) and the ratio is 1, so each batch's loss is -mean A_i: 0, as
    the leave-one-out advantages of a group sum to 0 and an eval batch of 4 holds 2 whole groups of 2. The reward
    is the mean of every score the reward function returned (batches of equal size)."""
    scored = []

    def recorded_reward(completions, **kwargs):
        values = varied_reward(completions)
        scored.extend(values)
        return values

    trainer = RLOOTrainer(
        llama_path,
        recorded_reward,
        args=rloo_args(tmp_path, per_device_eval_batch_size=4),
        train_dataset=prompt_dataset(),
    )
    metrics = trainer.evaluate(eval_dataset=prompt_dataset(8).to_iterable_dataset())
    assert len(scored) == 8 * 2  # 8 prompts x num_generations_eval
    assert metrics["eval_loss"] == pytest.approx(0.0, abs=1e-5) and metrics["eval_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["eval_reward"] == pytest.approx(sum(scored) / len(scored), abs=1e-6)
    scored.clear()
    metrics = trainer.evaluate(eval_dataset={"a": prompt_dataset(4).to_iterable_dataset(), "b": prompt_dataset(4)})
    assert len(scored) == 2 * 4 * 2  # split a's 8 completions, then b's
    for i, split in enumerate("ab"):
        assert metrics[f"eval_{split}_loss"] == pytest.approx(0.0, abs=1e-5)
        # TRL's generation metrics keep the plain `eval_` prefix: each split's own log record holds them
        (record,) = [log for log in trainer.state.log_history if f"eval_{split}_loss" in log]
        assert record["eval_reward"] == pytest.approx(sum(scored[8 * i : 8 * (i + 1)]) / 8, abs=1e-6)
        assert record["eval_kl"] == pytest.approx(0.0, abs=1e-6)


def test_beam_search_generation_kwargs_fall_back_from_the_shared_prefix(llama_path, tmp_path):
    args = rloo_args(
        tmp_path, generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2, "length_penalty": -0.1}
    )
    trainer = RLOOTrainer(llama_path, varied_reward, args=args, train_dataset=prompt_dataset())
    before = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, trainer.model.get_parameter(n)) for n, p in before.items())


def test_a_cache_that_cannot_expand_by_row_falls_back_with_the_same_numbers(tokenizer, monkeypatch, caplog):
    """Hybrid Mamba / linear-attention caches (e.g. Nemotron-H) cannot be indexed by row: the shared prefix falls
    back to the plain path (once, with a reason), generation and log-probs unchanged."""
    model = build_causal_lm(tokenizer, "llama").eval()
    ids = torch.tensor([[3, 4, 5, 6, 7]] * 2 + [[8, 9, 10, 11, 12]] * 2)
    mask = torch.ones_like(ids)
    plain = compute_token_logprobs(model, ids, mask, 2).logps
    prompts = [[3, 4, 5], [3, 4, 5], [8, 9], [8, 9]]
    config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    greedy = generate_batched(model, tokenizer, prompts, config).completion_ids

    def cannot(self, indices):
        raise AttributeError("'LinearAttentionLayer' object has no attribute 'batch_select_indices'")

    monkeypatch.setattr(DynamicCache, "batch_select_indices", cannot)
    try:
        with caplog.at_level(logging.INFO, logger="trl_unified.generation.sharing"):
            shared = compute_token_logprobs(model, ids, mask, 2, shared_prefix=True).logps
            generated = generate_batched(model, tokenizer, prompts, config, shared_prefix=True).completion_ids
        assert type(model) in _unsupported  # later calls skip the attempt
    finally:
        _unsupported.pop(type(model), None)
    torch.testing.assert_close(shared, plain)
    assert torch.equal(generated, greedy)
    assert "cannot be expanded by row" in caplog.text


def test_max_completion_length_none_trains_with_generates_default(llama_path, tmp_path):
    trainer = RLOOTrainer(
        llama_path,
        varied_reward,
        args=rloo_args(tmp_path, max_completion_length=None, max_steps=1),
        train_dataset=prompt_dataset(),
    )
    trainer.train()
    assert trainer.state.log_history[0]["completions/max_length"] > 0


def test_reward_function_may_return_a_generator(llama_path, tmp_path):
    lengths = []

    def lazy(completions, **kwargs):
        lengths.extend(len(c) for c in completions)
        return (float(len(c)) for c in completions)

    trainer = RLOOTrainer(llama_path, lazy, args=rloo_args(tmp_path, max_steps=1), train_dataset=prompt_dataset())
    trainer.train()
    assert len(lengths) == 4  # one step: 2 prompts x 2 completions
    assert trainer.state.log_history[0]["rewards/lazy/mean"] == pytest.approx(sum(lengths) / 4, abs=1e-5)


def test_top_p_zero_is_accepted_as_in_transformers(tmp_path):
    assert GRPOConfig(output_dir=str(tmp_path), top_p=0.0, bf16=False).top_p == 0.0


def test_cast_lm_head_to_fp32_keeps_the_head_and_logits_in_float32(llama_path, tmp_path):
    args = rloo_args(tmp_path, cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "bfloat16"}, max_steps=1)
    trainer = RLOOTrainer(llama_path, varied_reward, args=args, train_dataset=prompt_dataset())
    assert trainer.model.lm_head.weight.dtype == torch.float32 and trainer.model.dtype == torch.bfloat16
    out = trainer.model(input_ids=torch.tensor([[3, 4, 5]]))
    assert out.logits.dtype == torch.float32
    trainer.train()


@pytest.mark.slow  # ~30 s: paged attention on CPU
def test_continuous_batching_generation(llama_path, tmp_path):
    """TRL's use_transformers_continuous_batching (and its deprecated alias use_transformers_paged) generate with
    transformers' generate_batch; the trainer trains on those completions."""
    with pytest.warns(FutureWarning, match="use_transformers_paged"):
        args = rloo_args(tmp_path, use_transformers_paged=True, max_steps=1)
    assert args.use_transformers_continuous_batching
    trainer = RLOOTrainer(llama_path, varied_reward, args=args, train_dataset=prompt_dataset())
    trainer.train()
    assert trainer.state.log_history[0]["completions/mean_length"] > 0


# ------------------------------------------------------------------ generative evaluation
def test_reference_answers_numbers_and_aliases():
    assert answers_match("2", 2.0) and answers_match("2.0", "2") and answers_match("1,000", 1000)
    assert (
        answers_match("two", ["2", "two"])
        and answers_match("2", ["2", "two"])
        and not answers_match("3", ["2", "two"])
    )
    assert not answers_match("2", None) and not answers_match(None, 2)
    assert reference_answers(float("nan")) is None and reference_answers([]) is None
    with pytest.raises(TypeError, match="eval row 3's 'answer' is a dict"):
        reference_answers({"value": 2}, "eval row 3's 'answer'")


def test_generative_eval_scores_float_and_alias_answers_and_warns_without_an_answer_column(
    llama_path, tmp_path, caplog
):
    trainer = RLOOTrainer(
        llama_path,
        varied_reward,
        args=rloo_args(tmp_path, answer_extractor="regex:(\\S+)\\s*$", per_device_eval_batch_size=2),
        train_dataset=prompt_dataset(),
    )
    probe = trainer.generate(["a b", "c d"], do_sample=False)
    last = [t.split()[-1] if t.split() else "" for t in probe.texts]
    data = Dataset.from_dict({"prompt": ["a b", "c d"], "answer": [[last[0], "zzz"], ["not it"]]})
    metrics = trainer.evaluate_generations(data)
    assert metrics["eval_accuracy"] == 0.5  # the alias list matched, the other did not
    with caplog.at_level(logging.WARNING):
        trainer.evaluate_generations(Dataset.from_dict({"prompt": ["a b"], "answers": ["x"]}))
        trainer.evaluate_generations(Dataset.from_dict({"prompt": ["a b"], "answers": ["x"]}))
    assert caplog.text.count("has no 'answer' column") == 1  # warned once


# ------------------------------------------------------------------ preference trainers
def test_dpo_compute_metrics_gets_the_logits_and_labels(llama_path, tmp_path):
    seen = []

    def metric(eval_pred):
        seen.append((eval_pred.predictions.shape, eval_pred.label_ids.shape))
        return {"my_metric": 0.123}

    args = pref_args(DPOConfig, tmp_path, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    trainer = DPOTrainer(
        llama_path,
        args=args,
        train_dataset=Dataset.from_dict(PAIRS),
        eval_dataset=Dataset.from_dict(PAIRS),
        compute_metrics=metric,
    )
    trainer.train()
    assert [log["eval_my_metric"] for log in trainer.state.log_history if "eval_my_metric" in log] == [0.123, 0.123]
    assert seen[0][0][0] == 2 * len(PAIRS["prompt"])  # chosen and rejected rows


def test_kto_takes_integer_labels_and_counts_one_sided_data_right(llama_path, tmp_path, caplog):
    data = {"prompt": PAIRS["prompt"], "completion": PAIRS["chosen"], "label": [1, 0] * 4}
    trainer = KTOTrainer(llama_path, args=pref_args(KTOConfig, tmp_path), train_dataset=Dataset.from_dict(data))
    trainer.train()
    # Step 1 (sequential sampler: rows 0-3, labels 1 0 1 0) runs with the policy equal to the reference: h = 0 and
    # z_0 = 0, so every reward is 0 and each row's loss is 1 - sigmoid(0) = 0.5 (weights 1).
    first = trainer.state.log_history[0]
    assert first["step"] == 1
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert first[key] == pytest.approx(0.0, abs=1e-6), key
    assert first["loss"] == pytest.approx(0.5, abs=1e-4)
    with caplog.at_level(logging.WARNING):
        KTOTrainer(
            llama_path,
            args=pref_args(KTOConfig, tmp_path),
            train_dataset=Dataset.from_dict({**data, "label": [0] * 8}),
        )
    assert "0 desirable and 8 undesirable rows: every row is undesirable" in caplog.text


def test_a_subclass_without_a_paper_writes_no_empty_paper_link(llama_path, tmp_path):
    class MyTrainer(RLOOTrainer):
        _name = "MyAlgo"

    trainer = MyTrainer(llama_path, count_a, args=rloo_args(tmp_path, max_steps=1), train_dataset=prompt_dataset())
    trainer.create_model_card()
    card = open(tmp_path / "out" / "README.md").read()
    assert "papers/)" not in card and "Paper:" not in card and "MyAlgo" in card
    assert issubclass(MyTrainer, PolicyTrainerBase)


# ------------------------------------------------------------------ generate_batched inputs
def test_generate_batched_padded_tensor_and_ragged_encoding(tokenizer):
    model = build_causal_lm(tokenizer, "llama")
    config = GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    pad = tokenizer.pad_token_id
    with pytest.raises(ValueError, match="padded tensor: row 1 starts or ends with the pad token"):
        generate_batched(model, tokenizer, torch.tensor([[3, 4, 5], [pad, 6, 7]]), config)
    ragged = {"input_ids": [[3, 4, 5], [6, 7]], "attention_mask": [[1, 1, 1], [1, 1]]}
    out = generate_batched(model, tokenizer, ragged, config)
    assert out.texts == generate_batched(model, tokenizer, [[3, 4, 5], [6, 7]], config).texts
