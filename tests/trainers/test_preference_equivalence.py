"""Drop-in proof: trl_unified's DPOTrainer and KTOTrainer give trl's losses, per-step gradients, final parameters and
metrics (1e-5) on the same tiny model and data, for every loss type, with and without precomputed reference
log-probs, with a full reference copy and with a PEFT policy (adapter-disabled reference), and with gradient
accumulation."""

import pytest
import torch
import trl
from datasets import Dataset
from peft import LoraConfig
from transformers import PreTrainedTokenizerFast, TrainerCallback

import trl_unified
from trl_unified.testing import build_image, build_vision_language_model
from trl_unified.trainers.dpo import LOSS_TYPES


WORDS = "a b c d e f g h i j k l m n o p q r s t u v w x y z".split()


def paired_rows(n=8, conversational=False):
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(n):
        prompt = " ".join(WORDS[(i * 3 + j) % 26] for j in range(1 + i % 4))
        chosen = " " + " ".join(WORDS[(i * 5 + 2 * j) % 26] for j in range(2 + i % 3))
        rejected = " " + " ".join(WORDS[(i * 7 + j) % 26] for j in range(1 + (i + 1) % 4))
        if conversational:
            prompt = [{"role": "user", "content": prompt}]
            chosen = [{"role": "assistant", "content": chosen.strip()}]
            rejected = [{"role": "assistant", "content": rejected.strip()}]
        rows["prompt"].append(prompt)
        rows["chosen"].append(chosen)
        rows["rejected"].append(rejected)
    return rows


def unpaired_rows(n=8):
    paired = paired_rows(n)
    return {
        "prompt": paired["prompt"],
        "completion": [c if i % 3 else r for i, (c, r) in enumerate(zip(paired["chosen"], paired["rejected"]))],
        "label": [bool(i % 3) for i in range(n)],
    }


class GradRecorder(TrainerCallback):
    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def run(module, trainer, model, processing_class, tmp_path, rows, peft=False, ref_model=None, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / module.__name__),
        per_device_train_batch_size=4,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        seed=3,
        max_length=12,
    )
    kwargs.update(overrides)
    recorder = GradRecorder()
    policy_trainer = getattr(module, f"{trainer}Trainer")(
        model,
        ref_model=ref_model,
        args=getattr(module, f"{trainer}Config")(**kwargs),
        train_dataset=rows if isinstance(rows, Dataset) else Dataset.from_dict(rows),
        processing_class=processing_class,
        callbacks=[recorder],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None,
    )
    policy_trainer.train()
    history = policy_trainer.state.log_history
    params = {n: p.detach().clone() for n, p in policy_trainer.model.named_parameters() if p.requires_grad}
    return [log["loss"] for log in history if "loss" in log], recorder.grads, params, history


def compare(trainer, model_path, tmp_path, rows, metrics, **overrides):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    theirs = run(trl, trainer, model_path, tokenizer, tmp_path, rows, **overrides)
    ours = run(trl_unified, trainer, model_path, tokenizer, tmp_path, rows, **overrides)
    assert_same_training(ours, theirs, metrics, steps=3)


def assert_same_training(ours, theirs, metrics, steps):
    """Losses, every optimiser step's gradients, final parameters and `metrics` of two `run`s, to 1e-5."""
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(theirs[0]), rtol=1e-6, atol=1e-5)
    assert len(ours[1]) == len(theirs[1]) == steps
    for step, (g, ref_g) in enumerate(zip(ours[1], theirs[1])):
        assert g.keys() == ref_g.keys()
        assert any(v.abs().sum() > 0 for v in g.values()), f"no gradient at step {step}"
        for name in g:
            torch.testing.assert_close(g[name], ref_g[name], rtol=1e-4, atol=1e-5, msg=f"step {step} {name}")
    # Final parameters after 3 Adam steps: Adam's normalised step turns float noise in a near-zero gradient into up
    # to ~lr of update, so they get a slightly wider band than the gradients (seen: 1.5e-5 on a LoRA B of magnitude
    # 2e-3, KTO with PEFT, on an AMD EPYC without AVX-512; the gradients above agree to 1e-5 at every step).
    for name, value in ours[2].items():
        torch.testing.assert_close(value, theirs[2][name], rtol=1e-4, atol=3e-5, msg=name)
    for key in metrics:
        mine = [log[key] for log in ours[3] if key in log and "loss" in log]
        ref = [log[key] for log in theirs[3] if key in log and "loss" in log]
        assert len(mine) == len(ref) > 0, key  # a step whose rows are all of one label has no rewards/<other>
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(ref), rtol=1e-4, atol=1e-5, msg=key)


DPO_METRICS = [
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
    "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens",
]  # fmt: skip
KTO_METRICS = ["kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected", "entropy", "num_tokens"]  # fmt: skip


def loss_case(loss_type):
    return {"loss_type": [loss_type], **({"label_smoothing": 1e-3} if loss_type == "exo_pair" else {})}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dpo_loss_types_match_trl(loss_type, qwen2_path, tmp_path):
    compare("DPO", qwen2_path, tmp_path, paired_rows(), DPO_METRICS, **loss_case(loss_type))


DPO_CASES = {
    "precompute": dict(precompute_ref_log_probs=True),
    "peft": dict(peft=True),
    "peft_precompute": dict(peft=True, precompute_ref_log_probs=True),
    "grad_accumulation": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "combined_weighted": dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    "f_divergence_js": dict(f_divergence_type="js_divergence", beta=0.5),
    "f_divergence_alpha": dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
    "f_divergence_forward": dict(f_divergence_type="forward_kl"),
    "robust_smoothing": dict(loss_type=["robust"], label_smoothing=0.1),
    "wpo_weighting": dict(use_weighting=True),
    "ld_alpha": dict(ld_alpha=0.5),
    "truncation": dict(max_length=6),
    "conversational": dict(conversational=True, max_length=64),
    "implicit_prompt": dict(implicit=True),
}


@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_options_match_trl(case, qwen2_path, tmp_path):
    overrides = dict(DPO_CASES[case])
    rows = paired_rows(conversational=overrides.pop("conversational", False))
    if overrides.pop("implicit", False):
        rows = {"chosen": [p + c for p, c in zip(rows["prompt"], rows["chosen"])],
                "rejected": [p + r for p, r in zip(rows["prompt"], rows["rejected"])]}  # fmt: skip
    compare("DPO", qwen2_path, tmp_path, rows, DPO_METRICS, **overrides)


KTO_CASES = {
    "kto": dict(),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired"),
    "weights": dict(desirable_weight=1.3, undesirable_weight=0.7),
    "precompute": dict(precompute_ref_log_probs=True),
    "peft": dict(peft=True),
    "grad_accumulation": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "paired_rows": dict(paired=True, per_device_train_batch_size=8),  # 4 pairs: 4 desirable + 4 undesirable rows
}


@pytest.mark.parametrize("case", list(KTO_CASES))
def test_kto_matches_trl(case, qwen2_path, tmp_path):
    overrides = dict(KTO_CASES[case])
    rows = paired_rows(4) if overrides.pop("paired", False) else unpaired_rows()
    compare("KTO", qwen2_path, tmp_path, rows, KTO_METRICS, **overrides)


def image_rows(n=8):
    """Conversational pairs with one image each (TRL's vision preference format)."""
    rows = paired_rows(n, conversational=True)
    rows["images"] = [[build_image(i)] for i in range(n)]
    return rows


def run_vlm(module, trainer, tmp_path, rows, precompute=False, peft=False):
    model, processor = build_vision_language_model()
    # TRL needs a ref_model for an unnamed model (a PEFT policy disables its adapter; precompute uses the policy)
    ref_model = None if precompute or peft else build_vision_language_model()[0]
    dataset = Dataset.from_dict(rows)
    if trainer == "KTO":  # both labels in every batch of 4
        dataset = Dataset.from_dict(
            {
                "prompt": rows["prompt"],
                "completion": [c if i % 3 else r for i, (c, r) in enumerate(zip(rows["chosen"], rows["rejected"]))],
                "label": [bool(i % 3) for i in range(len(rows["prompt"]))],
                "images": rows["images"],
            }
        )
    overrides = dict(max_steps=2, max_length=None, precompute_ref_log_probs=precompute)
    return run(module, trainer, model, processor, tmp_path / "vlm", dataset, peft, ref_model, **overrides)


@pytest.mark.parametrize(
    "trainer, case",
    [("DPO", "plain"), ("DPO", "peft"), ("DPO", "precompute"), ("KTO", "plain"), ("KTO", "precompute")],
)
def test_image_rows_match_trl(trainer, case, tmp_path):
    """A tiny Qwen2-VL on image preference rows: TRL's numbers. TRL refuses `precompute_ref_log_probs` for images;
    ours precomputes them (the policy is the reference), compared with TRL's on-the-fly reference."""
    theirs = run_vlm(trl, trainer, tmp_path, image_rows(), peft=case == "peft")
    ours = run_vlm(trl_unified, trainer, tmp_path, image_rows(), precompute=case == "precompute", peft=case == "peft")
    assert_same_training(ours, theirs, DPO_METRICS if trainer == "DPO" else KTO_METRICS, steps=2)
    if case != "peft":  # the vision tower learns from the images
        assert all(any("visual" in name and v.abs().sum() > 0 for name, v in g.items()) for g in ours[1])
