"""Drop-in proof: with generation fixed, trl_unified.RLOOTrainer's losses, gradients and updates equal trl's."""

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM, TrainerCallback

import trl_unified


COMPLETION_LEN = 6


def fake_generate(self, input_ids, attention_mask=None, generation_config=None, **kwargs):
    """Deterministic 'generation': tokens from the prompt's content and the row's position; some rows stop at EOS."""
    rows = []
    eos = self.config.eos_token_id
    vocab = self.config.vocab_size
    for i, prompt in enumerate(input_ids):
        seed = int((prompt * attention_mask[i]).sum()) * 7 + i * 13
        tokens = [(seed + 5 * j + j * j) % (vocab - 10) + 5 for j in range(COMPLETION_LEN)]
        if i % 3 != 2:
            tokens[2 + i % 3] = eos
        rows.append(tokens)
    return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=1)


def reward_len_and_a(completions, **kwargs):
    return [len(c.split()) / 6 + c.split().count("a") for c in completions]


def reward_first_token(completion_ids, **kwargs):
    return [float(ids[0] % 5) / 5 for ids in completion_ids]


class GradRecorder(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def run(module, model_path, tokenizer, tmp_path, peft, trainer="RLOO", **overrides):
    """Train 3 steps with `module`'s (trl or trl_unified) `<trainer>Trainer`; losses, gradients, parameters, logs."""
    kwargs = dict(
        output_dir=str(tmp_path / module.__name__),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=COMPLETION_LEN,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        seed=7,
    )
    kwargs.update(overrides)
    dataset = Dataset.from_dict({"prompt": ["a b c", "d e", "f g h i", "j k", "l", "m n o", "p q", "r s t u"]})
    recorder = GradRecorder()
    policy_trainer = getattr(module, f"{trainer}Trainer")(
        model_path,
        reward_funcs=[reward_len_and_a, reward_first_token],
        args=getattr(module, f"{trainer}Config")(**kwargs),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[recorder],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None,
    )
    policy_trainer.train()
    history = policy_trainer.state.log_history
    losses = [log["loss"] for log in history if "loss" in log]
    params = {n: p.detach().clone() for n, p in policy_trainer.model.named_parameters() if p.requires_grad}
    return losses, recorder.grads, params, history


def run_both_and_compare(model_path, tokenizer, tmp_path, peft, trainer, **overrides):
    """Train with trl and with trl_unified; assert equal losses (1e-5), per-step gradients and final parameters.
    Returns both log histories (ours, TRL's) for the metric checks of each test."""
    ref_losses, ref_grads, ref_params, ref_logs = run(trl, model_path, tokenizer, tmp_path, peft, trainer, **overrides)
    losses, grads, params, logs = run(trl_unified, model_path, tokenizer, tmp_path, peft, trainer, **overrides)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    assert len(grads) == len(ref_grads) == 3
    for step, (g, ref_g) in enumerate(zip(grads, ref_grads)):
        assert g.keys() == ref_g.keys()
        assert any(v.abs().sum() > 0 for v in g.values()), f"no gradient at step {step}"
        for name in g:
            torch.testing.assert_close(g[name], ref_g[name], rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")
    for name in params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-4, atol=1e-5, msg=name)
    return logs, ref_logs


CASES = {
    "beta0": dict(beta=0.0),
    "beta": dict(beta=0.1),
    "peft_beta": dict(beta=0.1, peft=True),
    "num_iterations2": dict(
        beta=0.1, num_iterations=2, learning_rate=5e-5
    ),  # small steps: ratios stay inside the clip
    "normalize_advantages": dict(beta=0.05, normalize_advantages=True),
    "grad_accumulation": dict(beta=0.1, per_device_train_batch_size=3, gradient_accumulation_steps=2),
    "steps_per_generation": dict(beta=0.0, per_device_train_batch_size=3, steps_per_generation=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rloo_matches_trl(case, qwen2_path, tmp_path, monkeypatch):
    monkeypatch.setattr(Qwen2ForCausalLM, "generate", fake_generate)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen2_path)
    overrides = dict(CASES[case])
    peft = overrides.pop("peft", False)
    logs, ref_logs = run_both_and_compare(qwen2_path, tokenizer, tmp_path, peft, "RLOO", **overrides)
    for key in ("reward", "rewards/reward_len_and_a/mean", "kl", "entropy", "completions/mean_length"):
        ours = [log[key] for log in logs if key in log]
        theirs = [log[key] for log in ref_logs if key in log]
        assert len(ours) == len(theirs) > 0 or key == "kl", key
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5, msg=key)
