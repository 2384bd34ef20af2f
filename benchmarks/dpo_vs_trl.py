"""Speed and memory of trl_unified's DPOTrainer (or KTOTrainer, ORPOTrainer, CPOTrainer, TPOTrainer) vs TRL's (for
ORPO, CPO and TPO: TRL 1.16's `trl.experimental` trainers), same workload, in one run.

Model: the Qwen2-style 33.8M-parameter model of `online_vs_trl.py` (random weights, 8k word-level vocabulary), fp32
on CPU, gradient checkpointing off. Data, 256 pairs (KTO: the same pairs as 512 unpaired rows):

- **default**: prompts of 48-56 words, chosen and rejected completions of 24-40 words;
- **long**: prompts of ~400 words (396-404), completions of 32-48 words.

Batch 8 pairs (KTO: 16 rows; TPO: 8 rows of three completions, the gold one a third completion of the chosen
rows' length), beta 0.1, each trainer's default loss (DPO, CPO, TPO: sigmoid; KTO: `kto`; ORPO's), 10 steps, for
DPO and KTO a frozen copy of the policy as reference (ORPO, CPO and TPO have none). Each
trainer runs in its own fresh subprocess (so peak RSS is its own), TRL then ours, `--repeats` times alternating.
Printed per implementation: median seconds per step (first step excluded), peak RSS, and where the step goes
(reference forwards, optimiser, and the rest: the policy's forward and backward); then per workload

    ratio vocab=8k workload=default step_time=X peak_rss=Y        (ours / TRL's)

`--vocab real`: the model with Qwen2.5's vocabulary size (151,665 tokens, tied embeddings; see `online_vs_trl.py`).

Usage: python benchmarks/dpo_vs_trl.py [--trainer dpo|kto|orpo|cpo|tpo] [--workload default|long|both]
    [--vocab 8k|real] [--threads 2] [--steps 10] [--repeats 1] [--precompute_ref_log_probs]
    [--shared_prefix auto|false] [--chunked_lm_head true|false] [--padding_free true|false]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


WORKLOADS = {"default": ((48, 9), (24, 17)), "long": ((396, 9), (32, 17))}  # (min words, spread) of prompt, completion


def run_one(trainer, impl, model_path, steps, out, precompute, workload, shared_prefix, chunked_lm_head, padding_free):
    import importlib

    from datasets import Dataset
    from step_timer import PhaseTimer, StepTimer, peak_rss_kib
    from transformers import PreTrainedTokenizerFast

    name = trainer.upper()
    module = "trl" if trainer in ("dpo", "kto") else f"trl.experimental.{trainer}"  # TRL's experimental trainers
    library = importlib.import_module(module if impl == "trl" else "trl_unified")
    config_class, trainer_class = getattr(library, f"{name}Config"), getattr(library, f"{name}Trainer")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)

    def words(i, n, salt):
        return " ".join(f"w{(i * salt + j * 13) % 8000}" for j in range(n))

    (prompt, spread_p), (completion, spread_c) = WORKLOADS[workload]
    rows = {
        "prompt": [words(i, prompt + i % spread_p, 37) for i in range(256)],
        "chosen": [" " + words(i, completion + i % spread_c, 41) for i in range(256)],
        "rejected": [" " + words(i, completion + (i * 7) % spread_c, 43) for i in range(256)],
    }
    if trainer == "tpo":
        rows["reference"] = [" " + words(i, completion + i % spread_c, 47) for i in range(256)]
    if trainer == "kto":
        from trl import unpair_preference_dataset

        rows = unpair_preference_dataset(Dataset.from_dict(rows)).to_dict()

    timer, phases = StepTimer(), PhaseTimer()
    extra = {} if impl == "trl" else {"shared_prefix": {"auto": None, "false": False}[shared_prefix]}
    if impl != "trl" and chunked_lm_head is not None:
        extra["chunked_lm_head"] = chunked_lm_head == "true"
    if impl != "trl" and padding_free is not None:
        extra["padding_free"] = padding_free == "true"
    args = config_class(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=8 if trainer == "dpo" else 16,  # KTO: 16 unpaired rows = 8 pairs
        max_steps=steps,
        learning_rate=1e-6,
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
        max_length=1024,
        **({"precompute_ref_log_probs": precompute} if trainer in ("dpo", "kto") else {}),
        **extra,
    )
    trainer = trainer_class(
        model_path,
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
        callbacks=[timer, phases],
    )
    reference = getattr(trainer, "ref_model", None)  # ORPO, CPO, TPO: no reference model
    if reference is not None:
        phases.watch("reference", reference)
    trainer.train()
    peak = peak_rss_kib() / 1024
    json.dump({"times": timer.times, "phases": phases.phases, "peak_rss_mb": peak}, open(out, "w"))


def main():
    parser = argparse.ArgumentParser(description="Preference trainers: trl_unified vs TRL on the same workload")
    parser.add_argument("--trainer", choices=["dpo", "kto", "orpo", "cpo", "tpo"], default="dpo")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--precompute_ref_log_probs", action="store_true")
    parser.add_argument("--workload", choices=["default", "long", "both"], default="both")
    parser.add_argument("--shared_prefix", choices=["auto", "false"], default="auto", help="ours only")
    parser.add_argument("--vocab", choices=["8k", "real"], default="8k", help="8k words, or real: Qwen2.5's size")
    parser.add_argument("--chunked_lm_head", choices=["true", "false"], default=None, help="ours only (default: true)")
    parser.add_argument(
        "--padding_free", choices=["true", "false"], default=None, help="ours only (default: the config's)"
    )
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "MODEL", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        impl, model, out = args.child
        options = (args.precompute_ref_log_probs, args.workload, args.shared_prefix, args.chunked_lm_head)
        options += (args.padding_free,)
        run_one(args.trainer, impl, model, args.steps, out, *options)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from online_vs_trl import build_model

    workdir = tempfile.mkdtemp()
    model_path = os.path.join(workdir, "model")
    build_model(model_path, args.vocab)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for workload in ("default", "long") if args.workload == "both" else (args.workload,):
        compare(args, workload, model_path, workdir, env)


def compare(args, workload, model_path, workdir, env):
    results = {"trl": [], "ours": []}
    for _ in range(args.repeats):
        for impl in ("trl", "ours"):
            out = os.path.join(workdir, f"{impl}.json")
            options = ["--trainer", args.trainer, "--threads", str(args.threads), "--steps", str(args.steps)]
            options += ["--workload", workload, "--shared_prefix", args.shared_prefix]
            options += ["--precompute_ref_log_probs"] if args.precompute_ref_log_probs else []
            options += ["--chunked_lm_head", args.chunked_lm_head] if args.chunked_lm_head else []
            options += ["--padding_free", args.padding_free] if args.padding_free else []
            cmd = [sys.executable, __file__, *options, "--child", impl, model_path, out]
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[impl].append(json.load(open(out)))
    summary = {}
    for impl, runs in results.items():
        step = statistics.median(statistics.median(r["times"][1:]) for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        summary[impl] = (step, rss)
        phases = {
            name: statistics.median(statistics.median(r["phases"][name][1:]) for r in runs)
            for name in runs[0]["phases"]
        }
        split = ", ".join(f"{name} {seconds:.3f}" for name, seconds in phases.items())
        rest = step - sum(phases.values())
        print(
            f"{impl:>5} [{args.trainer}, {workload}]: {step:.3f} s/step (median, first step excluded), peak RSS "
            f"{rss:.0f} MB; per step: {split}, policy forward+backward and the rest {rest:.3f} "
            f"[{args.threads} threads, {args.steps} steps, {args.repeats} run(s)]"
        )
    ours, trl = summary["ours"], summary["trl"]
    step, rss = ours[0] / trl[0], ours[1] / trl[1]
    print(f"ratio vocab={args.vocab} workload={workload} step_time={step:.2f} peak_rss={rss:.2f}")


if __name__ == "__main__":
    main()
