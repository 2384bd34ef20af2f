"""Malformed inputs are rejected before training starts, with an error naming the field, the value and the fix.

Each row: (id, builder, exception, pattern the message must match). Builders construct the config/trainer only;
nothing is trained. Runtime failures of reward functions (which cannot be known before they run) are tested at the
end: they name the function, the step and the row, and leave the last checkpoint intact.
"""

import json
import os

import pytest
import torch
from datasets import Dataset, DatasetDict
from peft import LoraConfig, get_peft_model
from transformers import BitsAndBytesConfig, GenerationConfig

from tests.helpers import prompt_dataset, rloo_args, varied_reward
from trl_unified import (
    DPOConfig,
    DPOTrainer,
    GRMConfig,
    GRMTrainer,
    KTOConfig,
    KTOTrainer,
    RLOOConfig,
    RLOOTrainer,
    generate_batched,
)
from trl_unified.testing import (
    build_causal_lm,
    build_image,
    build_sequence_classifier,
    build_tokenizer,
    build_vision_language_model,
)


LORA = dict(r=4, target_modules=["q_proj", "v_proj"])


def rloo(ctx, dataset=None, funcs=varied_reward, **kwargs):
    args = kwargs.pop("args", None) or rloo_args(ctx["tmp"], **kwargs.pop("config", {}))
    return RLOOTrainer(
        kwargs.pop("model", ctx["llama"]),
        funcs,
        args=args,
        train_dataset=prompt_dataset() if dataset is None else dataset,
        **kwargs,
    )


def grm(ctx, data, **config):
    args = GRMConfig(output_dir=str(ctx["tmp"]), bf16=False, report_to=[], **config)
    return GRMTrainer(
        ctx["llama"],
        args=args,
        train_dataset=Dataset.from_dict(data) if type(data) is dict else data,
        processing_class=ctx["tok"],
    )


def generate(ctx, prompts):
    return generate_batched(
        build_causal_lm(ctx["tok"], "llama"), ctx["tok"], prompts, GenerationConfig(max_new_tokens=2)
    )


def evaluate_with(ctx, **config):
    trainer = rloo(ctx, eval_dataset=prompt_dataset(4), config=config)
    return trainer.evaluate()


def grm_with_formatting_func(ctx, **config):
    args = GRMConfig(output_dir=str(ctx["tmp"]), bf16=False, report_to=[], **config)
    data = Dataset.from_dict({"prompt": ["a b"], "completion": ["<answer> a </answer>"]})
    return GRMTrainer(ctx["llama"], args=args, train_dataset=data, processing_class=ctx["tok"],
                      formatting_func=lambda row: row["prompt"] + row["completion"])  # fmt: skip


PAIRS = {"prompt": ["a b", "c d e"], "chosen": [" f g", " h"], "rejected": [" i", " j k"]}
UNPAIRED = {"prompt": ["a b", "c d e"], "completion": [" f g", " h"], "label": [True, False]}


def preference(ctx, name, data, dataset=None, **kwargs):
    config = kwargs.pop("config", {})
    args = (DPOConfig if name == "dpo" else KTOConfig)(
        output_dir=str(ctx["tmp"]), bf16=False, report_to=[], per_device_train_batch_size=2, **config
    )
    return (DPOTrainer if name == "dpo" else KTOTrainer)(
        kwargs.pop("model", ctx["llama"]),
        args=args,
        train_dataset=Dataset.from_dict(data) if dataset is None else dataset,
        processing_class=ctx["tok"],
        **kwargs,
    )


def dpo_config(ctx, **kwargs):
    return DPOConfig(output_dir=str(ctx["tmp"]), bf16=False, **kwargs)


def kto_config(ctx, **kwargs):
    return KTOConfig(output_dir=str(ctx["tmp"]), bf16=False, **kwargs)


def rloo_config(ctx, **kwargs):
    return RLOOConfig(output_dir=str(ctx["tmp"]), bf16=False, **kwargs)


def big_vocab_reward_model(ctx):
    words = [f"w{i}" for i in range(300)]
    return build_sequence_classifier(build_tokenizer(words[:10]))  # embedding for a 15-token vocabulary


CASES = [
    # --- datasets
    (
        "rloo_no_prompt",
        lambda c: rloo(c, Dataset.from_dict({"text": ["a"] * 8})),
        ValueError,
        r"needs a 'prompt' column.*rename_column",
    ),
    ("rloo_empty", lambda c: rloo(c, Dataset.from_dict({"prompt": []})), ValueError, r"empty"),
    (
        "rloo_no_train",
        lambda c: RLOOTrainer(c["llama"], varied_reward, args=rloo_args(c["tmp"]), train_dataset=None),
        ValueError,
        r"^`train_dataset` is required",
    ),
    (
        "rloo_eval_no_prompt",
        lambda c: rloo(c, eval_dataset=Dataset.from_dict({"question": ["a"]})),
        ValueError,
        r"eval dataset .*'prompt'",
    ),
    ("grm_no_judgment", lambda c: grm(c, {"prompt": ["a"]}), ValueError, r"needs the judgment.*'completion'"),
    ("grm_empty", lambda c: grm(c, {"prompt": [], "completion": []}), ValueError, r"empty"),
    (
        "grm_all_labels_masked",
        lambda c: grm(c, {"prompt": ["a b c d e f g h"], "completion": ["x"]}, max_length=5),
        ValueError,
        r"Row 0 has no judgment tokens.*max_length=5",
    ),
    (
        "grm_messages_not_assistant",
        lambda c: grm(c, {"messages": [[{"role": "user", "content": "a"}]]}),
        ValueError,
        r"must be the assistant's",
    ),
    (
        "images_text_only_tokenizer",
        lambda c: rloo(
            c, Dataset.from_list([{"prompt": [{"role": "user", "content": "a"}], "image": build_image(0)}] * 4)
        ),
        ValueError,
        r"appears to be vision-related .* not seem to be a vision-language model",
    ),
    # --- config fields
    (
        "num_generations_lt_2",
        lambda c: rloo_config(c, num_generations=1),
        ValueError,
        r"num_generations=1, .* Set num_generations >= 2",
    ),
    (
        "batch_not_divisible_by_G",
        lambda c: rloo_config(c, per_device_train_batch_size=3, num_generations=2),
        ValueError,
        r"generation_batch_size=3 .* divisible by num_generations=2",
    ),
    (
        "generation_batch_vs_global",
        lambda c: rloo_config(c, per_device_train_batch_size=4, generation_batch_size=6),
        ValueError,
        r"generation_batch_size=6 must be divisible by the global batch size",
    ),
    (
        "generation_batch_and_steps",
        lambda c: rloo_config(c, generation_batch_size=8, steps_per_generation=2),
        ValueError,
        r"generation_batch_size or steps_per_generation, not both",
    ),
    ("negative_beta", lambda c: rloo_config(c, beta=-0.1), ValueError, r"beta=-0.1 must be >= 0"),
    ("zero_temperature", lambda c: rloo_config(c, temperature=0.0), ValueError, r"temperature=0.0.*> 0"),
    ("top_p_out_of_range", lambda c: rloo_config(c, top_p=1.5), ValueError, r"top_p=1.5 must be in \[0, 1\]"),
    (
        "bad_answer_extractor",
        lambda c: rloo_config(c, answer_extractor="xml"),
        ValueError,
        r"answer_extractor='xml' is not one of",
    ),
    (
        "bad_reward_clip_range",
        lambda c: rloo_config(c, reward_clip_range=(1.0, 0.0)),
        ValueError,
        r"reward_clip_range=\(1.0, 0.0\) must be \(min, max\)",
    ),
    ("zero_iterations", lambda c: rloo_config(c, num_iterations=0), ValueError, r"num_iterations=0 must be >= 1"),
    (
        "auto_find_batch_size",
        lambda c: rloo_config(c, auto_find_batch_size=True),
        ValueError,
        r"auto_find_batch_size=True",
    ),
    (
        "sync_ref_without_beta",
        lambda c: rloo_config(c, sync_ref_model=True, beta=0.0),
        ValueError,
        r"^You passed `sync_ref_model=True` while `beta=0.0`",
    ),
    (
        "use_vllm",
        lambda c: rloo(c, config={"use_vllm": True}),
        ImportError,
        r"use_vllm=True with vllm_mode='colocate' needs vLLM, which is not installed: "
        r"pip install 'trl_unified\[vllm\]'",
    ),
    (
        "grm_packing",
        lambda c: GRMConfig(output_dir=str(c["tmp"]), bf16=False, packing=True),
        NotImplementedError,
        r"packing=True",
    ),
    (
        "grm_truncation_mode",
        lambda c: GRMConfig(output_dir=str(c["tmp"]), bf16=False, truncation_mode="middle"),
        ValueError,
        r"truncation_mode='middle' is not one of",
    ),
    (
        "grm_compute_loss_func",
        lambda c: GRMTrainer(c["llama"], args=GRMConfig(output_dir=str(c["tmp"]), bf16=False), compute_loss_func=len),
        NotImplementedError,
        r"compute_loss_func",
    ),
    # --- rewards
    ("no_reward_funcs", lambda c: rloo(c, funcs=[]), ValueError, r"No reward source provided. Pass `reward_funcs`"),
    ("reward_not_callable", lambda c: rloo(c, funcs=[3]), TypeError, r"reward_funcs\[0\] is a int"),
    (
        "reward_weights_length",
        lambda c: rloo(c, funcs=[varied_reward, varied_reward], config={"reward_weights": [1.0]}),
        ValueError,
        r"reward_weights has 1 values but there are 2 reward functions",
    ),
    (
        "reward_processing_classes_length",
        lambda c: rloo(c, funcs=[varied_reward], reward_processing_classes=[c["tok"], c["tok"]]),
        ValueError,
        r"number of reward processing classes \(2\) must match the number of reward functions \(1",
    ),
    (
        "reward_model_other_tokenizer",
        lambda c: rloo(c, funcs=[big_vocab_reward_model(c)], reward_processing_classes=[c["tok"]]),
        ValueError,
        r"tokenizer for reward model .* do not belong together",
    ),
    (
        "router_aux_on_dense_model",
        lambda c: rloo(c, config={"router_aux_loss_coef": 0.1}),
        ValueError,
        r"`router_aux_loss_coef` is set to 0.1 but .* is not a Mixture-of-Experts",
    ),
    # --- models
    (
        "unknown_model_offline",
        lambda c: rloo(c, model="no-such-org/no-such-model"),
        ValueError,
        r"(?s)no-such-org/no-such-model.*Hub could not resolve it",
    ),
    (
        "incomplete_model_dir",
        lambda c: rloo(c, model=str(c["tmp"])),
        ValueError,
        r"does not hold a complete saved model",
    ),
    (
        "ref_model_with_beta0",
        lambda c: rloo(c, config={"beta": 0.0}, ref_model=c["llama"]),
        ValueError,
        r"ref_model was given but .* beta=0.0",
    ),
    (
        "peft_model_and_config",
        lambda c: rloo(
            c,
            model=get_peft_model(build_causal_lm(c["tok"], "llama"), LoraConfig(**LORA)),
            peft_config=LoraConfig(**LORA),
            processing_class=c["tok"],
        ),
        ValueError,
        r"already a PeftModel",
    ),
    ("peft_config_type", lambda c: rloo(c, peft_config={"r": 4}), TypeError, r"peft_config must be a peft.PeftConfig"),
    (
        "quantized_without_peft",
        lambda c: rloo(
            c,
            config={"model_init_kwargs": {"device_map": "cpu"}},
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        ),
        ValueError,
        r"quantised .* no peft_config .*QLoRA",
    ),
    (
        "quantization_twice",
        lambda c: rloo(
            c,
            config={"model_init_kwargs": {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)}},
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        ),
        ValueError,
        r"quantization_config is set both",
    ),
    # --- round two: datasets
    (
        "rloo_dataset_smaller_than_a_generation_batch",
        lambda c: rloo(c, prompt_dataset(1)),
        ValueError,
        r"train_dataset has 1 prompts, but one generation batch needs 2 distinct prompts",
    ),
    (
        "rloo_dataset_smaller_with_steps_per_generation",
        lambda c: rloo(c, prompt_dataset(3), config={"steps_per_generation": 2}),
        ValueError,
        r"has 3 prompts, but one generation batch needs 4",
    ),
    (
        "rloo_dataset_dict",
        lambda c: rloo(c, DatasetDict(train=prompt_dataset(), test=prompt_dataset())),
        ValueError,
        r"train_dataset is a DatasetDict with splits \['train', 'test'\].*dataset\['train'\]",
    ),
    (
        "grm_dataset_dict",
        lambda c: grm(c, DatasetDict(train=Dataset.from_dict({"prompt": ["a"], "completion": ["b"]}))),
        ValueError,
        r"train_dataset is a DatasetDict",
    ),
    (
        "rloo_train_dataset_is_a_list",
        lambda c: rloo(c, [{"prompt": "a"}] * 8),
        TypeError,
        r"`train_dataset` must be a `Dataset` or `IterableDataset`, got `list`",
    ),
    (
        "rloo_empty_prompt",
        lambda c: rloo(c, Dataset.from_dict({"prompt": ["a b", "", "c", "d"] * 2})),
        ValueError,
        r"train dataset row 1 has prompt '': every row needs a non-empty prompt",
    ),
    (
        "rloo_none_prompt",
        lambda c: rloo(c, Dataset.from_dict({"prompt": ["a b", "c", None, "d"] * 2})),
        ValueError,
        r"train dataset row 2 has prompt None",
    ),
    (
        "rloo_empty_conversation",
        lambda c: rloo(c, Dataset.from_list([{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": []}] * 4)),
        ValueError,
        r"row 1 has prompt \[\]",
    ),
    (
        "rloo_eval_empty_prompt",
        lambda c: rloo(c, eval_dataset=Dataset.from_dict({"prompt": ["a", " "]})),
        ValueError,
        r"eval dataset row 1 has prompt ' '",
    ),
    (
        "rloo_completion_beyond_positions",
        lambda c: rloo(c, config={"max_completion_length": 600}),
        ValueError,
        r"that is \d+ positions, beyond the model's maximum of 512 .*lower max_completion_length",
    ),
    (
        "rloo_prompt_beyond_positions",
        lambda c: rloo(c, Dataset.from_dict({"prompt": ["a b"] * 7 + [" ".join(["a"] * 600)]})),
        ValueError,
        r"train dataset row 7 has a prompt of 60\d tokens",
    ),
    (
        "grm_formatting_func_with_judgment_rows",
        lambda c: grm_with_formatting_func(c),
        ValueError,
        r"A formatting function was provided while `completion_only_loss=True`.*Drop formatting_func",
    ),
    (
        "grm_formatting_func_completion_only",
        lambda c: grm_with_formatting_func(c, completion_only_loss=True),
        ValueError,
        r"completion_only_loss=True",
    ),
    # --- round two: configuration validated at construction
    (
        "answer_extractor_bad_regex",
        lambda c: rloo_config(c, answer_extractor="regex:(("),
        ValueError,
        r"answer_extractor='regex:\(\(': the pattern does not compile",
    ),
    (
        "answer_extractor_regex_without_group",
        lambda c: rloo_config(c, answer_extractor="regex:Answer: \\d+"),
        ValueError,
        r"has no capture group",
    ),
    (
        "eval_batch_not_multiple_of_G_manual_evaluate",
        lambda c: evaluate_with(c, per_device_eval_batch_size=3),
        ValueError,
        r"per_device_eval_batch_size \* num_processes = 3 must be divisible by the eval num_generations \(2\)",
    ),
    (
        "eval_batch_not_multiple_of_G_eval",
        lambda c: evaluate_with(c, per_device_eval_batch_size=4, num_generations_eval=3),
        ValueError,
        r"= 4 must be divisible by the eval num_generations \(3\)",
    ),
    # --- round two: generate_batched input forms
    (
        "generate_single_string",
        lambda c: generate(c, "a b c"),
        TypeError,
        r"prompts is a single string .* Pass \[prompt\]",
    ),
    (
        "generate_1d_tensor",
        lambda c: generate(c, torch.tensor([4, 5, 6])),
        TypeError,
        r"1-D torch.int64 tensor; pass token ids as a 2-D",
    ),
    ("generate_float_tensor", lambda c: generate(c, torch.zeros(2, 3)), TypeError, r"2-D torch.float32 tensor"),
    (
        "generate_mixed_forms",
        lambda c: generate(c, ["a b", [4, 5]]),
        TypeError,
        r"prompts\[1\] is '\[4, 5\]' \(list\); every prompt must be of the same form",
    ),
    ("generate_none_prompt", lambda c: generate(c, ["a", None]), TypeError, r"prompts\[1\] is 'None' \(NoneType\)"),
    (
        "generate_mapping_without_ids",
        lambda c: generate(c, {"attention_mask": torch.ones(1, 2)}),
        TypeError,
        r"needs 'input_ids'",
    ),
    ("generate_empty_string", lambda c: generate(c, ["a", ""]), ValueError, r"prompts\[1\] encode to no tokens"),
    ("generate_int", lambda c: generate(c, 3), TypeError, r"prompts is a int"),
    # ---------------------------------------------------------------- DPO / KTO
    (
        "dpo_no_train_dataset",
        lambda c: DPOTrainer(c["llama"], args=dpo_config(c)),
        ValueError,
        r"`train_dataset` is required",
    ),
    (
        "dpo_missing_rejected",
        lambda c: preference(c, "dpo", {"prompt": ["a"], "chosen": [" b"]}),
        ValueError,
        r"columns \['chosen', 'prompt'\], but DPOTrainer needs chosen/rejected",
    ),
    ("dpo_unpaired_rows", lambda c: preference(c, "dpo", UNPAIRED), ValueError, r"DPOTrainer needs chosen/rejected"),
    (
        "kto_missing_label",
        lambda c: preference(c, "kto", {"prompt": ["a"], "completion": [" b"]}),
        ValueError,
        r"KTOTrainer needs completion/label or chosen/rejected",
    ),
    (
        "kto_label_strings",
        lambda c: preference(c, "kto", {**UNPAIRED, "label": ["good", "bad"]}),
        ValueError,
        r"label column has type string",
    ),
    (
        "dpo_prompts_fill_max_length",
        lambda c: preference(c, "dpo", PAIRS, config={"max_length": 2}),
        ValueError,
        r"Every row of the train dataset has a prompt of max_length=2 tokens or more",
    ),
    ("dpo_max_length_1", lambda c: dpo_config(c, max_length=1), ValueError, r"max_length=1: a row needs at least"),
    (
        "dpo_ref_model_other_vocabulary",
        lambda c: preference(
            c, "dpo", PAIRS, ref_model=build_causal_lm(build_tokenizer(words=[f"w{i}" for i in range(300)]), "llama")
        ),
        ValueError,
        r"vocabulary \(\d+ tokens\) differs from the policy",
    ),
    (
        "dpo_ref_model_is_model",
        lambda c: preference(c, "dpo", PAIRS, model=(m := build_causal_lm(c["tok"])), ref_model=m),
        ValueError,
        r"cannot be the same object",
    ),
    ("dpo_unknown_loss", lambda c: dpo_config(c, loss_type="dpo"), ValueError, r"loss_type \['dpo'\] unknown"),
    (
        "dpo_loss_weights_length",
        lambda c: dpo_config(c, loss_type=["sigmoid", "sft"], loss_weights=[1.0]),
        ValueError,
        r"loss_weights has 1 weights for 2 loss types",
    ),
    (
        "dpo_exo_without_smoothing",
        lambda c: dpo_config(c, loss_type="exo_pair"),
        ValueError,
        r"'exo_pair' needs label_smoothing > 0",
    ),
    (
        "dpo_f_divergence_with_bco",
        lambda c: dpo_config(c, loss_type="bco_pair", f_divergence_type="forward_kl"),
        ValueError,
        r"f_divergence_type='forward_kl' only applies to",
    ),
    (
        "dpo_unknown_f_divergence",
        lambda c: dpo_config(c, f_divergence_type="kl"),
        ValueError,
        r"f_divergence_type='kl' is not one of",
    ),
    (
        "dpo_weighting_with_aot",
        lambda c: dpo_config(c, loss_type="aot", use_weighting=True),
        NotImplementedError,
        r"use_weighting is not defined for 'aot'",
    ),
    ("dpo_ld_alpha_out_of_range", lambda c: dpo_config(c, ld_alpha=1.5), ValueError, r"ld_alpha=1.5 must be in"),
    (
        "dpo_bad_truncation_mode",
        lambda c: dpo_config(c, truncation_mode="middle"),
        ValueError,
        r"truncation_mode='middle' is not one of",
    ),
    (
        "dpo_sync_with_precompute",
        lambda c: dpo_config(c, sync_ref_model=True, precompute_ref_log_probs=True),
        ValueError,
        r"sync_ref_model=True with precompute_ref_log_probs=True",
    ),
    (
        "dpo_sync_with_peft",
        lambda c: preference(c, "dpo", PAIRS, config={"sync_ref_model": True}, peft_config=LoraConfig(**LORA)),
        NotImplementedError,
        r"sync_ref_model=True.*PEFT",
    ),
    (
        "dpo_precompute_iterable",
        lambda c: preference(
            c,
            "dpo",
            None,
            dataset=Dataset.from_dict(PAIRS).to_iterable_dataset(),
            config={"precompute_ref_log_probs": True, "max_steps": 2},
        ),
        ValueError,
        r"`precompute_ref_log_probs=True` is not supported with IterableDataset",
    ),
    (
        "dpo_image_rows_text_model",
        lambda c: preference(c, "dpo", {**PAIRS, "images": [[build_image()], [build_image()]]}),
        ValueError,
        r"appears to be vision-related .* not seem to be a vision-language model",  # TRL's wording
    ),
    (
        "kto_image_rows_text_model",
        lambda c: preference(c, "kto", {**PAIRS, "images": [[build_image()], [build_image()]]}),
        ValueError,
        r"appears to be vision-related .* not seem to be a vision-language model",
    ),
    (
        "dpo_dataset_dict",
        lambda c: preference(c, "dpo", None, dataset=DatasetDict(train=Dataset.from_dict(PAIRS))),
        ValueError,
        r"train_dataset is a DatasetDict",
    ),
    (
        "dpo_aux_loss_on_dense_model",
        lambda c: preference(c, "dpo", PAIRS, config={"router_aux_loss_coef": 0.01}),
        ValueError,
        r"`router_aux_loss_coef` is set to 0.01 but .* is not a Mixture-of-Experts",
    ),
    ("kto_unknown_loss", lambda c: kto_config(c, loss_type="bco"), ValueError, r"loss_type='bco' is not one of"),
    (
        "kto_random_sampling",
        lambda c: kto_config(c, train_sampling_strategy="random"),
        ValueError,
        r"needs train_sampling_strategy='sequential'",
    ),
    (
        "kto_batch_of_one",
        lambda c: kto_config(c, per_device_train_batch_size=1),
        ValueError,
        r"per_device_train_batch_size must be > 1 for loss_type='kto'",
    ),
]


@pytest.fixture
def ctx(llama_path, tokenizer, tmp_path):
    return {"llama": llama_path, "tok": tokenizer, "tmp": tmp_path}


@pytest.mark.parametrize("name, build, error, pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_before_training(name, build, error, pattern, ctx):
    with pytest.raises(error, match=pattern):
        build(ctx)


# ------------------------------------------------------------------ failures that only show when a reward runs
@pytest.mark.parametrize(
    "reward, pattern",
    [
        (lambda completions, **kw: [1.0], r"returned 1 rewards for 4 completions"),
        (lambda completions, **kw: 1 / 0, r"raised ZeroDivisionError"),
        (
            lambda completions, **kw: [float("inf")] * len(completions),
            r"returned inf for completion 0. Rewards must be finite",
        ),
        (lambda completions, **kw: [1.0, float("-inf"), 0.0, 0.0], r"returned -inf for completion 1"),
    ],
)
def test_reward_failing_mid_run_names_step_and_row_and_keeps_the_checkpoint(reward, pattern, llama_path, tmp_path):
    calls = {"n": 0}

    def flaky(completions, **kwargs):
        calls["n"] += 1
        return varied_reward(completions) if calls["n"] <= 2 else reward(completions, **kwargs)

    trainer = RLOOTrainer(
        llama_path,
        flaky,
        args=rloo_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=1),
        train_dataset=prompt_dataset(),
    )
    with pytest.raises((ValueError, RuntimeError, TypeError), match=pattern) as info:
        trainer.train()
    assert "global step 2" in str(info.value) and "prompt" in str(info.value)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists()
    assert json.load(open(checkpoint / "trainer_state.json"))["global_step"] == 2
    assert not os.path.exists(tmp_path / "out" / "checkpoint-3")


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_max_length_that_cuts_image_tokens_raises_before_the_first_update(name, tmp_path):
    model, processor = build_vision_language_model()
    rows = {
        "prompt": [[{"role": "user", "content": "a b"}]] * 2,
        "chosen": [[{"role": "assistant", "content": "c"}]] * 2,
        "rejected": [[{"role": "assistant", "content": "d"}]] * 2,
        "images": [[build_image(0)], [build_image(1)]],
    }
    args = (DPOConfig if name == "dpo" else KTOConfig)(
        output_dir=str(tmp_path), bf16=False, report_to=[], per_device_train_batch_size=2, max_length=8, max_steps=1
    )
    trainer = (DPOTrainer if name == "dpo" else KTOTrainer)(
        model, args=args, train_dataset=Dataset.from_dict(rows), processing_class=processor
    )
    with pytest.raises(ValueError, match=r"max_length=8 cuts a prompt of \d+ tokens with its image tokens"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("model_kind", ["text", "vlm_without_video_processor"])
def test_video_rows_need_a_video_capable_model_and_processor(model_kind, tmp_path):
    from trl_unified import GRMConfig, GRMTrainer

    rows = [
        {
            "prompt": [{"role": "user", "content": "a"}],
            "completion": [{"role": "assistant", "content": "b"}],
            "videos": [[[[[0, 0, 0]]]]],  # one 1x1 frame
        }
    ]
    if model_kind == "text":
        tokenizer = build_tokenizer()
        model, processing_class, match = build_causal_lm(tokenizer), tokenizer, "is not a vision-language model"
    else:
        (model, processing_class), match = build_vision_language_model(), "has no video processor"
    args = GRMConfig(output_dir=str(tmp_path), bf16=False, report_to=[])
    with pytest.raises(ValueError, match=rf"video column \(\['videos'\]\).*{match}"):
        GRMTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=processing_class)
