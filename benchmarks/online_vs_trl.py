"""Speed and memory of an online trainer of trl_unified (RLOO, GRPO, online DPO, GMPO, A*-PO or SDPO) vs TRL's of the
same name, same workload, in one run. `benchmarks/{rloo,grpo,online_dpo,gmpo,a2po,sdpo}_vs_trl.py` call this with
their trainer (online DPO: the same completions per step, half as many prompts with 2 completions each, beta 0.1;
A*-PO: one completion per prompt, V* from 2 reference samples of each prompt the timed steps read, estimated before
them; SDPO: its defaults, no KL term, with `success_reward_threshold=0` so that every row has a successful sibling
and the EMA teacher reads every row's reprompt).

Model: Qwen2-style, 33.8M parameters, built locally (random weights, 8k word-level vocabulary); 32 new tokens, beta
0.05, gradient checkpointing off, fp32 on CPU, 10 steps. Workloads (`--workload`, default both):
- short: prompts of 8-16 words, batch 8, num_generations 4;
- long: prompts of ~200 words, batch 16, num_generations 8 (2 distinct prompts per step).
Each trainer runs in its own fresh subprocess (so peak RSS is its own), TRL then ours, `--repeats` times alternating.
Reported per workload: median seconds per step (first step excluded), generated tokens per second, peak RSS, where
the time goes (generation, reference forward, optimiser, the rest: policy forward+backward), and

    ratio workload=short step_time=X peak_rss=Y
    ratio workload=long step_time=X peak_rss=Y

(ours / TRL's); a run of one workload ends with `ratio step_time=X peak_rss=Y`.

`--vocab real` gives the model Qwen2.5's vocabulary size (151,665 tokens, tied embeddings: 105M parameters), where
the LM head and its log-softmax dominate.

Usage: python benchmarks/{rloo,grpo}_vs_trl.py [--workload both] [--vocab 8k|real] [--threads 2] [--steps 10]
    [--repeats 1] [--shared_prefix auto|false] [--lean_decoding true|false] [--chunked_lm_head true|false]
    [--padding_free true|false]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


WORKLOADS = {
    # prompts of 8-16 words, batch 8, G 4: the workload of the first measurements
    "short": {"prompt_words": 8, "batch_size": 8, "num_generations": 4},
    # prompts of ~200 words (196-204), batch 16, G 8: 2 distinct prompts per step, as in long-context RL
    "long": {"prompt_words": 196, "batch_size": 16, "num_generations": 8},
}


# Word-level vocabularies: "8k" (the synthetic workloads' first measurements) and "real", Qwen2.5's size (151,665
# tokens in its tokenizer; the 0.5B-3B checkpoints tie the input and output embeddings, as here).
VOCABULARIES = {"8k": 8180, "real": 151_658}
TRL_MODULES = {  # TRL's trainers outside `trl`
    "online_dpo": "trl.experimental.online_dpo",
    "gmpo": "trl.experimental.gmpo",
    "a2po": "trl.experimental.a2po",
    "sdpo": "trl.experimental.sdpo",
}  # TRL's trainers outside `trl`


def build_model(path: str, vocab: str = "8k") -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_unified.testing import build_tokenizer

    words = [f"w{i}" for i in range(VOCABULARIES[vocab])]
    tokenizer = build_tokenizer(words=words)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=9,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=vocab == "real",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    import torch

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, vocab {len(tokenizer)}")


def run_one(trainer: str, impl: str, model_path: str, steps: int, out: str, workload: dict) -> None:
    """Train `steps` steps of `trainer` ("rloo"/"grpo") with `impl` ("trl" or "ours"); timings to `out`."""
    import importlib

    import torch
    from datasets import Dataset
    from step_timer import PhaseTimer, StepTimer, peak_rss_kib
    from transformers import PreTrainedTokenizerFast

    library = importlib.import_module("trl_unified" if impl == "ours" else TRL_MODULES.get(trainer, "trl"))
    name = {"rloo": "RLOO", "grpo": "GRPO", "online_dpo": "OnlineDPO", "gmpo": "GMPO", "a2po": "A2PO", "sdpo": "SDPO"}
    name = name[trainer]
    config_class, trainer_class = getattr(library, f"{name}Config"), getattr(library, f"{name}Trainer")
    if trainer == "online_dpo":  # batch counts prompts (2 completions each), the length is max_new_tokens
        shape = dict(per_device_train_batch_size=workload["batch_size"] // 2, max_new_tokens=32, beta=0.1)
    elif trainer == "a2po":  # one completion per prompt; V* from 2 reference samples (before the timed steps)
        shape = dict(per_device_train_batch_size=workload["batch_size"], max_completion_length=32,
                     num_value_samples=2, filter_all_incorrect=False)  # fmt: skip
    elif trainer == "sdpo":  # no KL term; every row reprompted with a sibling (the teacher forward always runs)
        shape = dict(per_device_train_batch_size=workload["batch_size"], num_generations=workload["num_generations"],
                     max_completion_length=32, success_reward_threshold=0.0)  # fmt: skip
    else:
        shape = dict(per_device_train_batch_size=workload["batch_size"], num_generations=workload["num_generations"],
                     max_completion_length=32, beta=0.05)  # fmt: skip

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_path)
    words = workload["prompt_words"]  # prompt lengths vary from `words` to `words + 8` words
    prompts = [" ".join(f"w{(i * 37 + j * 11) % 8000}" for j in range(words + i % 9)) for i in range(256)]
    if trainer == "a2po":  # V* is estimated for every prompt first: only those the timed steps read
        prompts = prompts[: workload["batch_size"] * steps]

    def reward(completions, **kwargs):
        return [c.count("w1") / max(1, len(c.split())) for c in completions]

    timer, phases = StepTimer(), PhaseTimer()
    options = ("shared_prefix", "lean_decoding", "chunked_lm_head", "padding_free")  # trl_unified's, when given
    ours_only = {} if impl == "trl" else {k: workload[k] for k in options if workload[k] is not None}
    args = config_class(
        output_dir=tempfile.mkdtemp(),
        **shape,
        max_steps=steps,
        learning_rate=1e-6,
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        seed=0,
        temperature=1.0,
        **ours_only,
    )
    policy_trainer = trainer_class(
        model_path,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[timer, phases],
    )
    # generation: TRL's `_generate` (prompts -> completion ids) and ours `generate` (the same, via generate_batched)
    if impl == "ours":
        phases.watch("generation", policy_trainer, "generate")
    elif hasattr(policy_trainer, "_generate"):
        phases.watch("generation", policy_trainer, "_generate")
    else:  # TRL's A*-PO samples with the policy's `generate` inside `_prepare_inputs`
        phases.watch("generation", policy_trainer.model, "generate")
    if getattr(policy_trainer, "ref_model", None) is not None:
        phases.watch("reference", policy_trainer.ref_model)
    policy_trainer.train()
    history = policy_trainer.state.log_history
    lengths = [log["completions/mean_length"] for log in history if "completions/mean_length" in log]
    json.dump(
        {
            "times": timer.times,
            "phases": phases.phases,
            "mean_completion_length": statistics.mean(lengths) if lengths else 32.0,  # TRL's online DPO: not logged
            "peak_rss_mb": peak_rss_kib() / 1024,
            "threads": torch.get_num_threads(),
        },
        open(out, "w"),
    )


def main(trainer: str):
    parser = argparse.ArgumentParser(description=f"{trainer.upper()}: trl_unified vs TRL on the same workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1, help="alternate TRL/ours this many times; medians reported")
    parser.add_argument(
        "--workload", choices=["short", "long", "both"], default="both", help=f"{WORKLOADS} (default: both)"
    )
    parser.add_argument("--shared_prefix", choices=["auto", "false"], default=None, help="ours only (default: auto)")
    parser.add_argument("--lean_decoding", choices=["true", "false"], default=None, help="ours only (default: true)")
    parser.add_argument(
        "--vocab", choices=sorted(VOCABULARIES), default="8k", help="8k words, or real: Qwen2.5's size"
    )
    parser.add_argument("--chunked_lm_head", choices=["true", "false"], default=None, help="ours only (default: true)")
    parser.add_argument(
        "--padding_free", choices=["true", "false"], default=None, help="ours only (default: the config's)"
    )
    parser.add_argument("--child", nargs=4, metavar=("IMPL", "MODEL", "OUT", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        workload = {
            **WORKLOADS[args.child[3]],
            "shared_prefix": {None: None, "auto": "auto", "false": False}[args.shared_prefix],
            "lean_decoding": {None: None, "true": True, "false": False}[args.lean_decoding],
            "chunked_lm_head": {None: None, "true": True, "false": False}[args.chunked_lm_head],
            "padding_free": {None: None, "true": True, "false": False}[args.padding_free],
        }
        run_one(trainer, args.child[0], args.child[1], args.steps, args.child[2], workload)
        return

    workdir = tempfile.mkdtemp()
    model_path = os.path.join(workdir, "model")
    build_model(model_path, args.vocab)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    names = ["short", "long"] if args.workload == "both" else [args.workload]
    ratios = {name: compare(trainer, name, args, model_path, workdir, env) for name in names}
    for name, (step, rss) in ratios.items():
        print(f"ratio vocab={args.vocab} workload={name} step_time={step:.2f} peak_rss={rss:.2f}")
    if len(ratios) == 1:
        print(f"ratio step_time={step:.2f} peak_rss={rss:.2f}")


def compare(trainer, name, args, model_path, workdir, env):
    """TRL and ours alternating, each in a fresh subprocess, `args.repeats` times; returns the (step, RSS) ratios."""
    workload = WORKLOADS[name]
    results = {"trl": [], "ours": []}
    for _ in range(args.repeats):
        for impl in ("trl", "ours"):
            out = os.path.join(workdir, f"{impl}.json")
            cmd = [
                sys.executable,
                sys.argv[0],
                "--threads",
                str(args.threads),
                "--steps",
                str(args.steps),
                *(["--shared_prefix", args.shared_prefix] if args.shared_prefix else []),
                *(["--lean_decoding", args.lean_decoding] if args.lean_decoding else []),
                *(["--chunked_lm_head", args.chunked_lm_head] if args.chunked_lm_head else []),
                *(["--padding_free", args.padding_free] if args.padding_free else []),
                "--child",
                impl,
                model_path,
                out,
                name,
            ]
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[impl].append(json.load(open(out)))

    summary = {}
    for impl, runs in results.items():
        step = statistics.median(statistics.median(r["times"][1:]) for r in runs)
        tokens = workload["batch_size"] * statistics.median(r["mean_completion_length"] for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        summary[impl] = (step, tokens / step, rss)
        phases = {
            phase: statistics.median(statistics.median(r["phases"][phase][1:]) for r in runs)
            for phase in runs[0]["phases"]
        }
        split = ", ".join(f"{phase} {seconds:.3f}" for phase, seconds in phases.items())
        print(
            f"{impl:>5} [{name}]: {step:.3f} s/step (median, first step excluded), {tokens / step:.0f} generated "
            f"tokens/s, peak RSS {rss:.0f} MB  [{args.threads} threads, {args.steps} steps, {args.repeats} run(s)]\n"
            f"        where the time goes (s/step): {split}, policy forward+backward and the rest "
            f"{step - sum(phases.values()):.3f}"
        )
    return summary["ours"][0] / summary["trl"][0], summary["ours"][2] / summary["trl"][2]
