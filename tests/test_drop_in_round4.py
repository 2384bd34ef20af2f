"""Round four of the drop-in findings (issue 28): each a TRL usage that gave a different result or an error here."""

import logging

import torch
from datasets import Dataset
from peft import LoraConfig

from tests.helpers import PROMPTS, prompt_dataset, rloo_args, tiny_run_args, varied_reward
from trl_unified import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, RLOOTrainer


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def test_a_prompt_ids_column_reaches_reward_functions_unchanged(llama_path, tmp_path):
    """TRL passes every other column to the reward functions as it is; ours replaced a `prompt_ids` column by the
    prompt's token ids."""
    seen = []

    def reward(completions, prompt_ids, **kwargs):
        seen.extend(prompt_ids)
        return [0.0] * len(completions)

    data = prompt_dataset(4, prompt_ids=["id-a", "id-b", "id-c", "id-d"])
    args = tiny_run_args(GRPOConfig, tmp_path, num_generations=2, max_completion_length=4, max_steps=1)
    GRPOTrainer(llama_path, reward_funcs=reward, args=args, train_dataset=data).train()
    assert len(seen) == 4 and set(seen) <= {"id-a", "id-b", "id-c", "id-d"}  # 2 prompts x 2 completions


def test_without_such_a_column_reward_functions_still_get_the_prompt_token_ids(llama_path, tokenizer, tmp_path):
    seen = []

    def reward(completions, prompt_ids, **kwargs):
        seen.extend(prompt_ids)
        return [0.0] * len(completions)

    args = tiny_run_args(GRPOConfig, tmp_path, num_generations=2, max_completion_length=4, max_steps=1)
    GRPOTrainer(llama_path, reward_funcs=reward, args=args, train_dataset=prompt_dataset(4)).train()
    encoded = {tuple(tokenizer(p)["input_ids"]) for p in PROMPTS[:4]}
    assert len(seen) == 4 and all(tuple(ids) in encoded for ids in seen)


PAIRS = Dataset.from_dict({"prompt": PROMPTS[:4] * 2, "chosen": [" a a"] * 8, "rejected": [" b"] * 8})


def test_an_explicit_ref_model_beside_peft_is_the_reference(llama_path, qwen2_path, tmp_path):
    """TRL's DPO and KTO use a given ref_model as the reference, also when the policy gets a LoRA adapter; ours
    refused the pair. The reference is then the given (different) model, not the adapter-disabled policy."""
    from transformers import AutoModelForCausalLM

    for config, trainer_cls in ((DPOConfig, DPOTrainer), (KTOConfig, KTOTrainer)):
        ref = AutoModelForCausalLM.from_pretrained(qwen2_path)
        args = tiny_run_args(config, tmp_path / config.__name__, max_steps=1)
        trainer = trainer_cls(
            llama_path, ref_model=ref, peft_config=LoraConfig(**LORA), args=args, train_dataset=PAIRS
        )
        assert trainer.reference_model.kind == "copy" and trainer.ref_model is ref
        assert not any(p.requires_grad for p in ref.parameters())
        frozen = {n: p.detach().clone() for n, p in ref.named_parameters()}
        adapter = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
        trainer.train()
        assert all(torch.equal(frozen[n], p) for n, p in ref.named_parameters())  # the reference stays as given
        changed = [n for n, p in trainer.model.named_parameters() if n in adapter and not torch.equal(adapter[n], p)]
        assert changed  # the adapter trained against it


def test_the_generative_eval_notice_is_printed_once_per_run(llama_path, tmp_path, caplog):
    trainer = DPOTrainer(llama_path, args=tiny_run_args(DPOConfig, tmp_path, per_device_eval_batch_size=4),
                         train_dataset=PAIRS, eval_dataset=PAIRS)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer.evaluate()
        trainer.evaluate()
    notices = [r for r in caplog.records if "Generative evaluation is on" in r.getMessage()]
    assert len(notices) == 1


def _first_completions(lib, model_path, tokenizer, tmp_path, lora_dropout):
    args = lib.GRPOConfig(
        output_dir=str(tmp_path / lib.__name__), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=6, max_steps=1, report_to=[], seed=0, bf16=False, use_cpu=True,
    )  # fmt: skip
    peft_config = LoraConfig(**LORA, lora_dropout=lora_dropout)
    trainer = lib.GRPOTrainer(model_path, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                              args=args, train_dataset=prompt_dataset(8), processing_class=tokenizer,
                              peft_config=peft_config)  # fmt: skip
    trainer.train()
    return list(trainer._logs["completion"])


def test_peft_samples_equal_trls_at_step_zero(qwen2_path, tmp_path):
    """The same seed gives TRL's completions with a LoRA adapter (PEFT's default lora_dropout=0). With
    lora_dropout > 0 TRL samples with the policy in train mode (dropout on, and drawing random numbers), ours in eval
    mode: our samples then stay those of the policy itself (docs/departures.md)."""
    import trl
    from transformers import PreTrainedTokenizerFast

    import trl_unified

    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen2_path)
    ours = _first_completions(trl_unified, qwen2_path, tokenizer, tmp_path, 0.0)
    assert ours == _first_completions(trl, qwen2_path, tokenizer, tmp_path, 0.0)
    assert _first_completions(trl_unified, qwen2_path, tokenizer, tmp_path / "dropout", 0.1) == ours


def test_fsdp_asked_for_on_cpu_is_named_before_training(llama_path, tmp_path, monkeypatch, caplog):
    """accelerate engages FSDP only on accelerator devices: an FSDP launch on CPU runs unsharded, and the trainer
    says so before training (the notice names the engine that runs and what is not sharded)."""
    from trl_unified.core.engines import engine_notice

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file fsdp.yaml` sets
    with caplog.at_level(logging.WARNING):
        trainer = RLOOTrainer(llama_path, varied_reward, args=rloo_args(tmp_path, max_steps=1),
                              train_dataset=prompt_dataset())  # fmt: skip
    notice = engine_notice(trainer.accelerator, trainer.args)
    assert notice is not None and notice in caplog.text
    assert "FSDP was requested" in notice and "nothing is sharded" in notice and "NO on cpu" in notice
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    assert engine_notice(trainer.accelerator, trainer.args) is None
