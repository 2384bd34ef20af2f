# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""Train a policy with GRPO.

With no arguments it runs an offline demo on CPU in under a minute: a tiny Qwen2-style model and a word-level
tokenizer are built locally (in a cache folder, outside output_dir), prompts are synthetic, and the reward is the
fraction of the word "a" in the completion. It saves the model, tokenizer, model card and reward_curve.png.

    accelerate launch examples/grpo.py

With arguments it is TRL's grpo script (`trl grpo`: its flags and YAML keys) with GRPOTrainer:

    accelerate launch examples/grpo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/tldr \\
        --reward_model_name_or_path <reward-model-id> --num_generations 4 --max_completion_length 64 \\
        --use_peft --lora_r 16 --output_dir Qwen2.5-0.5B-GRPO --push_to_hub --loss_type dapo

    accelerate launch --config_file examples/accelerate_configs/deepspeed_zero3.yaml examples/grpo.py --config cfg.yaml
"""

from trl_unified.scripts.grpo import main  # the script behind `trl-unified grpo` too


if __name__ == "__main__":
    main()
