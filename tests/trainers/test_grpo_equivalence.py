"""Drop-in proof: with generation fixed, trl_unified.GRPOTrainer's losses, gradients and updates equal trl's for every
loss type, both importance-sampling levels, each reward scaling, KL on and off, PEFT and the batch layouts."""

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from tests.trainers.test_rloo_equivalence import fake_generate, run_both_and_compare


OFF_POLICY = dict(num_iterations=2, learning_rate=2e-3)  # the second pass sees ratios != 1
CASES = {
    **{f"loss_{t}": dict(loss_type=t, **OFF_POLICY) for t in ("grpo", "dr_grpo", "dapo", "bnpo", "sapo", "luspo")},
    "loss_cispo": dict(loss_type="cispo", epsilon_high=1.0, **OFF_POLICY),
    "loss_vespo": dict(loss_type="vespo", **OFF_POLICY),
    "sequence_level": dict(importance_sampling_level="sequence", loss_type="grpo", **OFF_POLICY),
    "sequence_level_dapo": dict(importance_sampling_level="sequence", **OFF_POLICY),
    "beta": dict(beta=0.1),
    "beta_iterations_no_bias_correction": dict(beta=0.1, use_bias_correction_kl=False, **OFF_POLICY),
    "peft_beta": dict(beta=0.1, peft=True),
    "grad_accumulation": dict(beta=0.05, per_device_train_batch_size=3, gradient_accumulation_steps=2),
    "steps_per_generation": dict(per_device_train_batch_size=3, steps_per_generation=2, loss_type="dapo"),
    "steps_per_generation_bnpo": dict(per_device_train_batch_size=3, steps_per_generation=2, loss_type="bnpo"),
    "scale_batch": dict(scale_rewards="batch"),
    "scale_none": dict(scale_rewards="none", loss_type="dr_grpo"),
    "normalize_then_sum": dict(multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5]),
    "top_entropy": dict(top_entropy_quantile=0.5, **OFF_POLICY),
    "delta_and_epsilon_high": dict(delta=1.02, epsilon_high=0.28, **OFF_POLICY),
    "off_policy_mask": dict(off_policy_mask_threshold=0.001, **OFF_POLICY),
    "entropy_bonus": dict(entropy_coef=0.01),
    "adaptive_entropy": dict(use_adaptive_entropy=True, entropy_target=10.0, entropy_coef=0.01),
    "mask_truncated": dict(mask_truncated_completions=True, loss_type="grpo"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grpo_matches_trl(case, qwen2_path, tmp_path, monkeypatch):
    monkeypatch.setattr(Qwen2ForCausalLM, "generate", fake_generate)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen2_path)
    overrides = dict(CASES[case])
    peft = overrides.pop("peft", False)
    logs, ref_logs = run_both_and_compare(qwen2_path, tokenizer, tmp_path, peft, "GRPO", **overrides)
    timings = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "step_time")
    theirs_keys = {k for log in ref_logs for k in log}
    ours_keys = {k for log in logs for k in log}
    assert theirs_keys <= ours_keys, sorted(theirs_keys - ours_keys)  # TRL's metric names
    for key in sorted(theirs_keys - {"epoch", "step", "learning_rate", "grad_norm", "train_loss", *timings}):
        ours = [log[key] for log in logs if key in log]
        theirs = [log[key] for log in ref_logs if key in log]
        torch.testing.assert_close(
            torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-5, msg=key, equal_nan=True
        )
