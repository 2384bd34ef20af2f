"""trl_unified's PPOTrainer against TRL 1.12's `trl.experimental.ppo.PPOTrainer` (TRL removed it in 1.13; 1.12 and 1.16
cannot share an environment, so TRL 1.12 runs in its own venv, created here on first use).

1. Equivalence (`--check equivalence`, default on): generation fixed (a deterministic `generate`), 3 rollouts x 2
   PPO epochs on a tiny Llama with a separate value model and reward model: every optimiser step's gradients and the
   final parameters (policy and critic) are compared; prints the largest differences and `equivalence ok` when all
   are within rtol 1e-4 / atol 1e-5.
2. Speed (`--check timing`): real sampling on the online benchmarks' model size (Llama, hidden 512, 9 layers, an
   8k-word vocabulary: 36M parameters, with a value and a reward model of the same size), batch 8, 32 new tokens,
   4 PPO epochs, 4 rollouts, each implementation in a fresh subprocess, alternating, `--repeats` times; prints
   `ratio step_time=X peak_rss=Y training_rss=Z` (ours / TRL's, medians; seconds per rollout update incl. its
   optimiser steps; peak RSS; and the peak above the RSS of the imported libraries, which differ between the two
   environments: TRL 1.12 and 1.16 import different module sets).

Usage: python benchmarks/ppo_vs_trl.py [--check equivalence timing] [--repeats 2] [--trl-venv /tmp/trl112-venv]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def ensure_trl112(venv: str) -> str:
    python = os.path.join(venv, "bin", "python")
    probe = [python, "-c", "import bitsandbytes, trl, trl.experimental.ppo; assert trl.__version__ == '1.12.0'"]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    constraints = [line.split("#")[0].strip() for line in open(os.path.join(ROOT, ".ci", "constraints.txt"))]
    pins = [c for c in constraints if c and not c.startswith(("trl==", "torch=="))]
    # the same libraries as ours, so that both import the same set (transformers imports peft and bitsandbytes when
    # they are installed; they alone hold ~120 MB of RSS)
    keep = ("transformers", "accelerate", "datasets", "tokenizers", "safetensors", "huggingface_hub", "peft")
    keep += ("bitsandbytes", "deepspeed")
    subprocess.run([*pip, "trl==1.12.0", *[p for p in pins if p.split("==")[0] in keep]], check=True)
    return python


def build_models(folder: str, hidden: int, layers: int, vocab_words: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from trl_unified.testing import DEFAULT_WORDS, build_tokenizer

    tokenizer = build_tokenizer(words=DEFAULT_WORDS + [f"w{i}" for i in range(vocab_words)])
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    for name, cls, seed, extra in (
        ("policy", LlamaForCausalLM, 0, {}),
        ("value", LlamaForSequenceClassification, 1, {"num_labels": 1}),
        ("reward", LlamaForSequenceClassification, 2, {"num_labels": 1}),
    ):
        torch.manual_seed(seed)
        model = cls(LlamaConfig(**common, **extra))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(f"{folder}/{name}")
        tokenizer.save_pretrained(f"{folder}/{name}")
    letters = DEFAULT_WORDS[:26]
    prompts = [" ".join(letters[(i * 7 + j) % 26] for j in range(2 + i % 5)) for i in range(64)]
    json.dump(prompts, open(f"{folder}/prompts.json", "w"))


def run(python, impl, mode, models, out, **options):
    command = [python, os.path.join(HERE, "ppo_job.py"), "--impl", impl, "--mode", mode, "--models", models]
    command += ["--out", out, *[f"--{k}={v}" for k, v in options.items()]]
    env = {**os.environ, "OMP_NUM_THREADS": str(options.get("threads", 1)), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = ROOT if impl == "ours" else ""
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{impl} {mode} failed:\n{result.stderr[-4000:]}")
    import torch

    return torch.load(out, weights_only=False)


def check_equivalence(python, folder):
    import torch

    build_models(f"{folder}/tiny", hidden=32, layers=2)
    theirs = run(python, "trl", "equivalence", f"{folder}/tiny", f"{folder}/trl.pt")
    ours = run(sys.executable, "ours", "equivalence", f"{folder}/tiny", f"{folder}/ours.pt")
    assert len(ours["grads"]) == len(theirs["grads"]) > 0, (len(ours["grads"]), len(theirs["grads"]))
    worst = {"grad": 0.0, "param": 0.0}
    ok = True
    for g, ref in zip(ours["grads"], theirs["grads"]):
        assert g.keys() == ref.keys(), sorted(set(g) ^ set(ref))
        for name in g:
            worst["grad"] = max(worst["grad"], (g[name] - ref[name]).abs().max().item())
            ok &= torch.allclose(g[name], ref[name], rtol=1e-4, atol=1e-5)
    for name, value in ours["params"].items():
        worst["param"] = max(worst["param"], (value - theirs["params"][name]).abs().max().item())
        ok &= torch.allclose(value, theirs["params"][name], rtol=1e-4, atol=1e-5)
    print(f"equivalence: {len(ours['grads'])} optimiser steps, {len(ours['params'])} parameters (policy + value)")
    print(f"equivalence: max |grad diff| {worst['grad']:.2e}, max |param diff| {worst['param']:.2e}")
    for key in ("objective/kl", "objective/scores", "objective/rlhf_reward"):
        mine = [round(log[key], 6) for log in ours["logs"] if key in log]
        ref = [round(log[key], 6) for log in theirs["logs"] if key in log]
        print(f"equivalence: {key} ours {mine} trl {ref}")
    print("equivalence ok" if ok else "equivalence FAILED")
    return ok


def check_timing(python, folder, repeats, threads):
    build_models(f"{folder}/timing", hidden=512, layers=9, vocab_words=8100)
    options = dict(updates=4, batch=8, response_length=32, epochs=4, threads=threads)
    results = {"trl": [], "ours": []}
    for repeat in range(repeats):
        for impl, interpreter in (("trl", python), ("ours", sys.executable)):
            out = run(interpreter, impl, "timing", f"{folder}/timing", f"{folder}/{impl}-{repeat}.pt", **options)
            results[impl].append((out["seconds_per_update"], out["rss_mb"], out["rss_mb"] - out["imported_mb"]))
            above = out["rss_mb"] - out["imported_mb"]
            print(
                f"{impl} run {repeat}: {out['seconds_per_update']:.3f} s/update, {out['rss_mb']:.0f} MB peak RSS, "
                f"{above:.0f} MB above the imported libraries ({out['imported_mb']:.0f} MB)"
            )
    median = {impl: [statistics.median(v[i] for v in runs) for i in range(3)] for impl, runs in results.items()}
    ratios = [median["ours"][i] / median["trl"][i] for i in range(3)]
    print(f"ratio step_time={ratios[0]:.2f} peak_rss={ratios[1]:.2f} training_rss={ratios[2]:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", nargs="+", default=["equivalence", "timing"], choices=["equivalence", "timing"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-venv", default=os.path.join(tempfile.gettempdir(), "trl112-venv"))
    args = parser.parse_args()
    python = ensure_trl112(args.trl_venv)
    with tempfile.TemporaryDirectory() as folder:
        ok = check_equivalence(python, folder) if "equivalence" in args.check else True
        if "timing" in args.check:
            check_timing(python, folder, args.repeats, args.threads)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
