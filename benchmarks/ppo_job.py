"""One PPO run, TRL 1.12's `trl.experimental.ppo.PPOTrainer` (`--impl trl`, in a venv with trl==1.12.0) or
trl_unified's (`--impl ours`), on models saved by `benchmarks/ppo_vs_trl.py`. Standalone: it imports trl_unified
only for `--impl ours`.

`--mode equivalence`: generation is fixed (a deterministic `generate` that returns TRL's `scores` too), and the run
records every optimiser step's gradients, the final parameters and the logs to `--out`.
`--mode timing`: real sampling; records seconds per rollout update and the peak RSS.
"""

import argparse
import json
import os
import sys
import time


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["trl", "ours"], required=True)
    parser.add_argument("--mode", choices=["equivalence", "timing"], required=True)
    parser.add_argument("--models", required=True, help="folder with policy/, value/, reward/ (ppo_vs_trl.py)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--response_length", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def fake_generate(model, temperature):
    """Deterministic completions from each prompt's ids alone (row order cannot matter: TRL shuffles with its own
    dataloader); some end with EOS, the rest run to the limit. Returns
    what `generate` returns, and with `return_dict_in_generate` the processed scores TRL 1.12 reads its log-probs
    from (the model's logits over the sequence, divided by the temperature)."""
    import torch
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    def generate(input_ids, attention_mask=None, generation_config=None, return_dict_in_generate=False, **kwargs):
        eos, vocab = model.config.eos_token_id, model.config.vocab_size
        new = generation_config.max_new_tokens
        rows = []
        for i, prompt in enumerate(input_ids):
            seed = int((prompt * attention_mask[i]).sum())
            tokens = [(seed * 7 + 5 * j + j * j) % (vocab - 10) + 5 for j in range(new)]
            if seed % 3 != 2:  # an EOS, then padding
                stop = 1 + seed % 3
                pad = (
                    generation_config.pad_token_id
                    if generation_config.pad_token_id is not None
                    else model.config.pad_token_id
                )
                tokens = tokens[:stop] + [eos] + [pad] * (new - stop - 1)
            rows.append(tokens)
        sequences = torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], 1)
        if not return_dict_in_generate:
            return sequences
        pad = model.config.pad_token_id
        mask = torch.cat([attention_mask, (sequences[:, input_ids.size(1) :] != pad)], 1)
        positions = (mask.long().cumsum(1) - mask.long()).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits
        scores = logits[:, input_ids.size(1) - 1 : -1] / (temperature + 1e-7)
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=tuple(scores.unbind(1)))

    return generate


def main():
    args = parse()
    IMPL["name"] = args.impl
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedTokenizerFast

    if args.impl == "trl":
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    else:
        from trl_unified import PPOConfig, PPOTrainer
    from step_timer import peak_rss_kib

    imported_mb = peak_rss_kib() / 1024  # the libraries, before any model
    tokenizer = PreTrainedTokenizerFast.from_pretrained(f"{args.models}/policy", padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(f"{args.models}/policy", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(f"{args.models}/policy", dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(f"{args.models}/value", num_labels=1)
    reward = AutoModelForSequenceClassification.from_pretrained(f"{args.models}/reward", num_labels=1)
    prompts = json.load(open(f"{args.models}/prompts.json"))
    if args.mode == "equivalence":  # one batch of prompts: each rollout sees the same rows in both implementations
        prompts = prompts[: args.batch]
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})
    equivalence = args.mode == "equivalence"
    config = PPOConfig(
        output_dir=f"{args.out}.run",
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        num_ppo_epochs=args.epochs,
        total_episodes=args.updates * args.batch,
        response_length=args.response_length,
        stop_token="eos",
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        kl_coef=0.05,
        temperature=0.7,
        num_sample_generations=0,
        gradient_checkpointing=False,
        max_grad_norm=0.0,  # TRL 1.12 never clips (it does not run the Trainer loop)
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=5,
        local_rollout_forward_batch_size=args.batch,
    )
    if equivalence:
        policy.generate = fake_generate(policy, config.temperature)
    trainer = PPOTrainer(config, tokenizer, policy, ref, reward, dataset, value)
    grads = []
    model = trainer.model
    if equivalence:

        def record(optimizer, *_):
            named = dict(model.named_parameters())
            grads.append({_name(n): p.grad.detach().clone() for n, p in named.items() if p.grad is not None})

        optimizer = trainer.optimizer if args.impl == "trl" else None
        if optimizer is None:  # ours: created by train(); hook it at its creation
            create = trainer.create_optimizer

            def create_and_hook(*a, **k):
                created = create(*a, **k)
                created.register_step_pre_hook(record)
                return created

            trainer.create_optimizer = create_and_hook
        else:
            optimizer.optimizer.register_step_pre_hook(record)
    import numpy as np

    np.random.seed(5)
    torch.manual_seed(5)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    model = trainer.model
    params = {_name(n): p.detach().clone() for n, p in model.named_parameters()}
    logs = trainer.state.log_history
    rss = peak_rss_kib() / 1024
    torch.save(
        {
            "grads": grads,
            "params": params,
            "logs": logs,
            "seconds_per_update": seconds / args.updates,
            "rss_mb": rss,
            "imported_mb": imported_mb,
        },
        args.out,
    )
    print(f"{args.impl}: {seconds / args.updates:.3f} s/update, peak RSS {rss:.0f} MB", file=sys.stderr)


IMPL = {"name": "ours"}


def _name(name: str) -> str:
    """One parameter naming for both: TRL 1.12's wrapper has `policy.<p>` and `value_model.<p>`; ours is the policy
    with the critic attached as `value_model.<p>`."""
    if IMPL["name"] == "trl":
        return name[len("policy.") :] if name.startswith("policy.") else name
    return name


if __name__ == "__main__":
    main()
