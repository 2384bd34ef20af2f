"""ORPO, CPO (SimPO, AlphaPO) and TPO: the reference-free preference trainers on the preference core. TRL's configs and
constructors; losses, per-step gradients, final parameters and metrics equal TRL 1.16's experimental trainers (1e-5)
for every loss type, on decoder-only and encoder-decoder (T5) policies; the loss helpers against hand computations;
no reference model built; rows with three completions; bad input; learning."""

import dataclasses
import gc
import inspect
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForSeq2SeqLM, PreTrainedModel, PreTrainedTokenizerFast

import trl_unified
from tests.helpers import tiny_run_args
from tests.trainers.test_preference_equivalence import GradRecorder, assert_same_training, paired_rows
from trl_unified import CPOConfig, CPOTrainer, ORPOConfig, ORPOTrainer, PairedCollator, TPOConfig, TPOTrainer
from trl_unified.preference.losses import (
    alphapo_rewards,
    log1mexp,
    log_odds_ratio,
    margin_losses,
    nll,
    sequence_logps,
)
from trl_unified.testing import build_causal_lm


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def trl_module(name: str):
    import importlib

    return importlib.import_module(f"trl.experimental.{name.lower()}")


def triple_rows(n=8, **kwargs):
    rows = paired_rows(n, **kwargs)
    rows["reference"] = list(rows["chosen"])  # TRL's tests synthesise the gold response the same way
    return rows


# ------------------------------------------------------------------ TRL's surface
@pytest.mark.parametrize("name", ["ORPO", "CPO", "TPO"])
def test_config_has_every_trl_field_with_the_same_default(name):
    ours = {f.name: f for f in dataclasses.fields(getattr(trl_unified, f"{name}Config"))}
    for f in dataclasses.fields(getattr(trl_module(name), f"{name}Config")):
        assert f.name in ours, f.name
        if f.default is not dataclasses.MISSING:
            assert ours[f.name].default == f.default, (f.name, ours[f.name].default, f.default)


@pytest.mark.parametrize("name", ["ORPO", "CPO", "TPO"])
def test_constructor_takes_trl_arguments_in_trl_order(name):
    """TRL's arguments in TRL's order; then `quantization_config` (the policy's, as DPO's), so TRL's dpo script runs
    these trainers too."""
    theirs = list(inspect.signature(getattr(trl_module(name), f"{name}Trainer").__init__).parameters)
    ours = list(inspect.signature(getattr(trl_unified, f"{name}Trainer").__init__).parameters)
    assert ours == [*theirs, "quantization_config"]


def test_alphapo_shorthand_is_simpo_without_nll(tmp_path):
    config = CPOConfig(output_dir=str(tmp_path), loss_type="alphapo", alpha=0.25)
    assert (config.loss_type, config.cpo_alpha, config.alpha) == ("simpo", 0.0, 0.25)


# ------------------------------------------------------------------ the loss helpers, by hand
def test_log1mexp_is_stable_and_exact():
    from decimal import Decimal, getcontext

    getcontext().prec = 60  # the oracle: log(1 - e^x) in 60 significant digits
    values = [-1e-9, -1e-3, -0.5, -math.log(2), -3.0, -60.0]
    exact = torch.tensor([float((1 - Decimal(v).exp()).ln()) for v in values], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(torch.tensor(values, dtype=torch.float64)), exact, rtol=1e-12, atol=0)
    # float32: log(1 - exp(x)) rounds 1 - e^-1e-9 to 0 (-inf); log1mexp keeps log(1e-9)
    assert log1mexp(torch.tensor(-1e-9)).item() == pytest.approx(math.log(1e-9), rel=1e-4)


def test_log_odds_ratio_by_hand():
    # P_w = 1/2, P_l = 1/4: odds 1 and 1/3, log OR = log 3
    out = log_odds_ratio(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]))
    assert out.item() == pytest.approx(math.log(3), abs=1e-6)


def test_margin_losses_by_hand():
    margin, beta = torch.tensor([1.0]), 0.5
    sigmoid = -math.log(1 / (1 + math.exp(-0.5)))
    flipped = -math.log(1 / (1 + math.exp(0.5)))
    assert margin_losses("sigmoid", margin, beta).item() == pytest.approx(sigmoid, abs=1e-6)
    assert margin_losses("sigmoid", margin, beta, 0.1).item() == pytest.approx(0.9 * sigmoid + 0.1 * flipped, abs=1e-6)
    assert margin_losses("hinge", margin, beta).item() == pytest.approx(0.5, abs=1e-6)  # max(0, 1 - 0.5)
    assert margin_losses("ipo", margin, beta).item() == pytest.approx(0.0, abs=1e-6)  # (1 - 1/(2*0.5))^2
    # simpo: the sigmoid loss of Δ - γ/β = 1 - 0.25/0.5 = 0.5
    simpo = -math.log(1 / (1 + math.exp(-0.25)))
    assert margin_losses("simpo", margin, beta, gamma=0.25).item() == pytest.approx(simpo, abs=1e-6)
    with pytest.raises(ValueError, match="Unknown loss type"):
        margin_losses("dpo", margin, beta)


def test_sequence_logps_nll_and_alphapo_by_hand():
    per_token = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(sequence_logps(per_token, mask), torch.tensor([-3.0, -4.0]))
    torch.testing.assert_close(sequence_logps(per_token, mask, average=True), torch.tensor([-1.5, -4.0]))
    assert nll(per_token, mask).item() == pytest.approx(7.0 / 3)  # (1 + 2 + 4) / 3 tokens
    # p = 1/2, α = 1: (1 - 2) / 1 = -1; α → 0 approaches log p
    assert alphapo_rewards(torch.tensor(math.log(0.5)), 1.0).item() == pytest.approx(-1.0, abs=1e-6)
    limit = alphapo_rewards(torch.tensor(math.log(0.5), dtype=torch.float64), 1e-4)
    assert limit.item() == pytest.approx(math.log(0.5), abs=1e-4)


# ------------------------------------------------------------------ equal to TRL's trainers
def run(module, name, model, tokenizer, tmp_path, rows, peft=False, **overrides):
    kwargs = dict(per_device_train_batch_size=4, max_steps=3, learning_rate=1e-3, seed=3, max_length=12)
    args = tiny_run_args(getattr(module, f"{name}Config"), tmp_path / module.__name__, **{**kwargs, **overrides})
    recorder = GradRecorder()
    trainer = getattr(module, f"{name}Trainer")(
        model,
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
        callbacks=[recorder],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None,
    )
    trainer.train()
    history = trainer.state.log_history
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return [log["loss"] for log in history if "loss" in log], recorder.grads, params, history


PAIR_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"]  # fmt: skip
METRICS = {
    "ORPO": [*PAIR_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"],
    "CPO": [*PAIR_METRICS, "nll_loss"],
    "TPO": [*PAIR_METRICS, "entropy", "num_tokens", "logits/chosen", "logits/rejected", "mean_token_accuracy"],
}
CASES = {  # (trainer, options); the first case of each trainer runs in the default suite
    "orpo": ("ORPO", {}),
    "orpo_grad_accumulation": ("ORPO", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)),
    "orpo_peft": ("ORPO", dict(peft=True)),
    "orpo_conversational": ("ORPO", dict(conversational=True, max_length=64)),
    "cpo_sigmoid_smoothed": ("CPO", dict(label_smoothing=0.1)),
    "cpo_hinge": ("CPO", dict(loss_type="hinge")),
    "cpo_ipo": ("CPO", dict(loss_type="ipo")),
    "cpo_simpo": ("CPO", dict(loss_type="simpo", simpo_gamma=0.3, label_smoothing=0.1)),
    "cpo_alphapo": ("CPO", dict(loss_type="alphapo", alpha=0.3)),
    "cpo_sigmoid_alpha_without_nll": ("CPO", dict(alpha=-0.2, cpo_alpha=0.0)),
    "tpo_sigmoid": ("TPO", dict(label_smoothing=0.2)),
    "tpo_hinge": ("TPO", dict(loss_type="hinge")),
    "tpo_ipo": ("TPO", dict(loss_type="ipo")),
    "tpo_l": ("TPO", dict(loss_type="tpo-l", tpo_l_gamma=0.3)),
    "tpo_without_nll": ("TPO", dict(tpo_alpha=0.0)),
    "tpo_grad_accumulation_implicit_prompt": (
        "TPO",
        dict(implicit=True, per_device_train_batch_size=2, gradient_accumulation_steps=2),
    ),  # fmt: skip
}
DEFAULT_SUITE = {"orpo", "cpo_simpo", "tpo_sigmoid"}


@pytest.mark.parametrize("case", [c if c in DEFAULT_SUITE else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_matches_trl(case, qwen2_path, tmp_path):
    name, options = CASES[case]
    options = dict(options)
    rows = triple_rows(conversational=options.pop("conversational", False))
    if options.pop("implicit", False):
        rows = {key: [p + c for p, c in zip(rows["prompt"], rows[key])] for key in ("chosen", "rejected", "reference")}
    if name != "TPO":
        rows.pop("reference")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(qwen2_path)
    theirs = run(trl_module(name), name, qwen2_path, tokenizer, tmp_path, rows, **options)
    ours = run(trl_unified, name, qwen2_path, tokenizer, tmp_path, rows, **options)
    assert_same_training(ours, theirs, METRICS[name], steps=3)


@pytest.mark.parametrize("name, options", [("ORPO", {}), ("CPO", {"loss_type": "simpo"})])
def test_encoder_decoder_matches_trl(name, options, t5_path, tmp_path):
    """A T5 policy: the prompt to the encoder, each completion the decoder's target (TRL's ORPO and CPO)."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(t5_path)
    rows = paired_rows()
    runs = [
        run(module, name, AutoModelForSeq2SeqLM.from_pretrained(t5_path), tokenizer, tmp_path, rows,
            max_completion_length=5, **options)
        for module in (trl_module(name), trl_unified)
    ]  # fmt: skip
    assert_same_training(runs[1], runs[0], METRICS[name], steps=3)


# ------------------------------------------------------------------ the preference core without a reference
@pytest.mark.parametrize("cls, config, rows", [(ORPOTrainer, ORPOConfig, paired_rows), (CPOTrainer, CPOConfig,
                         paired_rows), (TPOTrainer, TPOConfig, triple_rows)])  # fmt: skip
def test_no_reference_model_is_built(cls, config, rows, tokenizer, tmp_path, monkeypatch):
    """A reference-free config builds, loads and prepares no second model: one model object in the trainer, none
    copied or loaded for a reference."""
    import trl_unified.core.reference as reference

    made = []
    monkeypatch.setattr(reference, "load_model", lambda *a, **k: made.append("load"))
    monkeypatch.setattr(reference, "copy", types.SimpleNamespace(deepcopy=lambda *a, **k: made.append("copy")))
    policy = build_causal_lm(tokenizer, "qwen2")
    trainer = cls(policy, args=tiny_run_args(config, tmp_path), train_dataset=Dataset.from_dict(rows(4)),
                  processing_class=tokenizer)  # fmt: skip
    assert made == [] and trainer.reference_model.kind == "none" and trainer.reference_model.model is None
    modules = {id(v) for v in vars(trainer).values() if isinstance(v, torch.nn.Module)}
    assert modules == {id(policy)}
    gc.collect()
    own = {id(m) for m in policy.modules()}  # the policy and its submodules (Qwen2Model shares its config)
    assert not [o for o in gc.get_objects() if isinstance(o, PreTrainedModel) and id(o) not in own
                and o.config is policy.config]  # fmt: skip
    trainer.train()


@pytest.mark.slow
def test_reference_free_peak_memory_is_below_dpo(tmp_path):
    """The same workload (a 12M-parameter policy, 2 steps): ORPO's process peaks lower than DPO's, which holds a
    frozen copy of the policy as its reference."""
    job = os.path.join(os.path.dirname(__file__), "..", "jobs", "preference_peak_rss.py")
    peaks = {}
    for name in ("DPO", "ORPO"):
        out = subprocess.run([sys.executable, job, name, str(tmp_path / name)], capture_output=True, text=True,
                             check=True, timeout=600)  # fmt: skip
        peaks[name] = int(out.stdout.strip().splitlines()[-1])
    model_mb = 12e6 * 4 / 2**20
    assert peaks["ORPO"] < peaks["DPO"] - 0.5 * model_mb * 2**10, peaks  # KiB; at least half a model copy less


def test_rows_with_three_completions_stack_in_blocks_and_select_together():
    rows = [
        {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5], "reference_ids": [6]},
        {"prompt_ids": [7], "chosen_ids": [8, 9], "rejected_ids": [10], "reference_ids": [11, 12]},
    ]
    batch = PairedCollator(pad_token_id=0, completions=("chosen", "rejected", "reference"))(rows)
    assert batch.sequences.input_ids.tolist() == [
        [1, 2, 3, 0], [7, 8, 9, 0], [1, 2, 4, 5], [7, 10, 0, 0], [1, 2, 6, 0], [7, 11, 12, 0]
    ]  # fmt: skip
    assert len(batch) == 2 and batch.block("reference") == slice(4, 6)
    second = batch.select(torch.tensor([1]))
    assert second.sequences.input_ids[:, :3].tolist() == [[7, 8, 9], [7, 10, 0], [7, 11, 12]]
    assert PairedCollator(pad_token_id=0).include_reference is False


def test_tpo_collates_the_reference_only_when_its_nll_counts(tokenizer, tmp_path):
    """TRL's `tpo_alpha=0.0` test, without its check of TRL's private collator class."""
    for alpha, rows in ((1.0, 6), (0.0, 4)):
        args = tiny_run_args(TPOConfig, tmp_path, tpo_alpha=alpha)
        trainer = TPOTrainer(build_causal_lm(tokenizer, "qwen2"), args=args,
                             train_dataset=Dataset.from_dict(triple_rows(4)), processing_class=tokenizer)  # fmt: skip
        assert trainer.data_collator.include_reference is (alpha != 0.0)
        assert trainer.data_collator(list(trainer.train_dataset.select(range(2))))["input_ids"].shape[0] == rows


def test_orpo_and_cpo_keep_trls_tokenised_columns(tokenizer, t5_path, tmp_path):
    trainer = ORPOTrainer(build_causal_lm(tokenizer, "qwen2"), args=tiny_run_args(ORPOConfig, tmp_path),
                          train_dataset=Dataset.from_dict(paired_rows(2)), processing_class=tokenizer)  # fmt: skip
    row = trainer.train_dataset[0]
    prompt = row["prompt_input_ids"]
    assert row["chosen_input_ids"][: len(prompt)] == prompt and row["chosen_labels"][: len(prompt)] == [-100] * len(
        prompt
    )
    assert row["chosen_input_ids"][-1] == tokenizer.eos_token_id
    t5 = CPOTrainer(t5_path, args=tiny_run_args(CPOConfig, tmp_path, max_completion_length=2),
                    train_dataset=Dataset.from_dict(paired_rows(2)))  # fmt: skip
    assert t5.is_encoder_decoder and "chosen_input_ids" not in t5.train_dataset.column_names
    assert all(len(labels) <= 2 for labels in t5.train_dataset["chosen_labels"])  # max_completion_length


# ------------------------------------------------------------------ bad input, before training
def test_bad_input_is_refused_before_training(tokenizer, t5_path, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2")
    with pytest.raises(ValueError, match="reference"):
        TPOTrainer(model, args=tiny_run_args(TPOConfig, tmp_path), train_dataset=Dataset.from_dict(paired_rows(2)),
                   processing_class=tokenizer)  # fmt: skip
    implicit = {"chosen": ["a b c", "d e"], "rejected": ["a b d", "d f"], "reference": ["x y", "d g"]}
    with pytest.raises(ValueError, match="implicit prompt"):
        TPOTrainer(model, args=tiny_run_args(TPOConfig, tmp_path), train_dataset=Dataset.from_dict(implicit),
                   processing_class=tokenizer)  # fmt: skip
    with pytest.raises(NotImplementedError, match="model_init"):
        ORPOTrainer(model, args=tiny_run_args(ORPOConfig, tmp_path), train_dataset=Dataset.from_dict(paired_rows(2)),
                    model_init=lambda: model)  # fmt: skip
    with pytest.raises(ValueError, match="is_encoder_decoder=True, but the model is not"):
        ORPOTrainer(model, args=tiny_run_args(ORPOConfig, tmp_path, is_encoder_decoder=True),
                    train_dataset=Dataset.from_dict(paired_rows(2)), processing_class=tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match="generate_during_eval=True` requires Weights and Biases"):
        CPOTrainer(model, args=tiny_run_args(CPOConfig, tmp_path, generate_during_eval=True),
                   train_dataset=Dataset.from_dict(paired_rows(2)), processing_class=tokenizer)  # fmt: skip
    for config, loss_type in ((CPOConfig, "kto_pair"), (TPOConfig, "simpo")):
        with pytest.raises(ValueError, match="loss_type"):
            config(output_dir=str(tmp_path), loss_type=loss_type)
    with pytest.raises(ValueError, match="sync_ref_model"):
        ORPOConfig(output_dir=str(tmp_path), sync_ref_model=True)


# ------------------------------------------------------------------ training and learning
@pytest.mark.parametrize("cls, config, rows", [(ORPOTrainer, ORPOConfig, paired_rows), (CPOTrainer, CPOConfig,
                         paired_rows), (TPOTrainer, TPOConfig, triple_rows)])  # fmt: skip
def test_training_changes_every_parameter_and_logs_trl_metrics(cls, config, rows, tokenizer, tmp_path):
    model = build_causal_lm(tokenizer, "qwen2")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = cls(model, args=tiny_run_args(config, tmp_path, gradient_checkpointing=True),
                  train_dataset=Dataset.from_dict(rows(8)), eval_dataset=Dataset.from_dict(rows(4)),
                  processing_class=tokenizer)  # fmt: skip
    trainer.train()
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(p.detach(), before[n])]
    assert unchanged == []
    logged = {key for log in trainer.state.log_history for key in log}
    assert set(METRICS[cls._name]) <= logged
    metrics = trainer.evaluate()
    assert {f"eval_{key}" for key in PAIR_METRICS} <= set(metrics) and math.isfinite(metrics["eval_loss"])
    trainer.save_model(str(tmp_path / "saved"))
    card = open(tmp_path / "saved" / "README.md").read()
    assert cls._paper["id"] in card and cls._name.lower() in card.lower()


def held_out_accuracy(trainer, rows) -> float:
    """How often the policy's length-normalised log-prob of the chosen completion beats the rejected one's."""
    dataset = trainer.prepare_dataset(Dataset.from_dict(rows), "probe")
    batch = trainer.data_collator([dataset[i] for i in range(len(dataset))]).to(trainer.args.device)
    with torch.no_grad():
        per_token = trainer.completion_logps(trainer.model.eval(), batch.sequences)
    logps = sequence_logps(per_token, batch.sequences.token_mask(), average=True)
    return (logps[batch.block("chosen")] > logps[batch.block("rejected")]).float().mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ORPO", "CPO", "TPO"])
def test_policy_learns_held_out_preferences(name, tokenizer, tmp_path):
    """The toy preference task of the demos (chosen completions use the words a-m, rejected ones n-z): held-out
    accuracy from about chance to > 0.9, and the chosen reward margin rises."""
    from trl_unified.scripts.preference import toy_preferences

    def rows(n, seed):
        data = toy_preferences(n, seed).to_dict()
        data["reference"] = data["chosen"]
        return data if name == "TPO" else {k: v for k, v in data.items() if k != "reference"}

    args = tiny_run_args(getattr(trl_unified, f"{name}Config"), tmp_path, per_device_train_batch_size=8, max_steps=40,
                         learning_rate=3e-3, logging_steps=5, beta=0.1)  # fmt: skip
    trainer = getattr(trl_unified, f"{name}Trainer")(
        build_causal_lm(tokenizer, "qwen2"), args=args, train_dataset=Dataset.from_dict(rows(256, 0)),
        processing_class=tokenizer,
    )  # fmt: skip
    before = held_out_accuracy(trainer, rows(64, 1))
    trainer.train()
    after = held_out_accuracy(trainer, rows(64, 1))
    margins = [log["rewards/margins"] for log in trainer.state.log_history if "rewards/margins" in log]
    print(f"{name}: held-out accuracy {before:.2f} -> {after:.2f}, margins {margins[0]:.3f} -> {margins[-1]:.3f}")
    assert 0.2 < before < 0.8 and after > 0.9, (before, after)
    assert margins[-1] > margins[0], margins


@pytest.mark.parametrize("cls, config, rows", [(ORPOTrainer, ORPOConfig, paired_rows), (TPOTrainer, TPOConfig,
                         triple_rows)])  # fmt: skip
def test_each_prompt_is_encoded_once(cls, config, rows, tokenizer, tmp_path, monkeypatch):
    """The rows of a preference row share its prompt pass, also for ORPO, whose NLL reads the prompt's tokens (scored
    from the prompt pass): the prompt passes encode one row per distinct prompt."""
    import trl_unified.core.logprobs as logprobs

    encoded = []
    original = logprobs.encode_prefix

    def counting(model, input_ids, attention_mask, length, groups, *args, **kwargs):
        encoded.append((len(groups[0]), input_ids.size(0)))
        return original(model, input_ids, attention_mask, length, groups, *args, **kwargs)

    monkeypatch.setattr(logprobs, "encode_prefix", counting)
    trainer = cls(build_causal_lm(tokenizer, "qwen2"), args=tiny_run_args(config, tmp_path, max_steps=1),
                  train_dataset=Dataset.from_dict(rows(4)), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    k = len(trainer.collated_completions())
    assert encoded == [(4, 4 * k)], encoded  # 4 prompts, k rows each, in one forward
