"""2 processes (accelerate, gloo), each with its own colocated vLLM engine: GRPO trains 2 steps, then every process
checks vLLM's greedy completions against transformers' `generate` on the trained policy (tests/vllm)."""

import json
import os
import sys

import torch


def main(out_dir):
    from accelerate import PartialState

    from tests.helpers import prompt_dataset, tiny_run_args, varied_reward
    from trl_unified import GRPOConfig, GRPOTrainer
    from trl_unified.generation import generate_batched
    from trl_unified.testing import build_causal_lm, build_tokenizer

    tok = build_tokenizer()
    model = build_causal_lm(tok, "qwen2", hidden_size=128)
    before = {n: p.clone() for n, p in model.named_parameters()}
    args = tiny_run_args(
        GRPOConfig, os.path.join(out_dir, "grpo"), num_generations=4, max_completion_length=8, use_vllm=True,
        per_device_train_batch_size=4,
    )  # fmt: skip
    trainer = GRPOTrainer(model, varied_reward, args=args, train_dataset=prompt_dataset(16), processing_class=tok)
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    prompts = list(prompt_dataset(6)["prompt"])[PartialState().process_index :: 2]
    config = trainer.make_generation_config(do_sample=False)
    engine = trainer._synced_vllm_engine()
    ours = generate_batched(policy, tok, prompts, generation_config=config, lean_decoding=False).completion_ids_list
    theirs = generate_batched(policy, tok, prompts, generation_config=config, vllm=engine).completion_ids_list
    changed = sum(not torch.equal(p, policy.get_parameter(n)) for n, p in before.items())
    result = {"equal": ours == theirs, "changed": changed, "total": len(before), "ours": ours, "theirs": theirs}
    result["logs"] = trainer.state.log_history
    with open(os.path.join(out_dir, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(sys.argv[1])
