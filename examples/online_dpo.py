# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""Train a policy with online DPO: pairs of its own completions, ranked by a reward, learned from with DPO's loss.

With no arguments it runs an offline demo on CPU in about a minute: the tiny model and synthetic prompts of
`examples/rloo.py`, the reward "fraction of the word 'a' in the completion", 2 completions per prompt. It saves the
model, tokenizer, model card and reward_curve.png.

    accelerate launch examples/online_dpo.py

With arguments it is TRL's grpo script (`reward_funcs`, `reward_model_name_or_path`, datasets, LoRA) with
OnlineDPOTrainer (TRL 1.16 ships no online DPO script):

    accelerate launch examples/online_dpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/ultrafeedback-prompt --reward_model_name_or_path <reward-model> \\
        --per_device_train_batch_size 4 --max_new_tokens 64 --output_dir Qwen2.5-0.5B-Online-DPO
"""

from trl_unified.scripts.online_dpo import main  # the script behind `trl-unified online_dpo` too


if __name__ == "__main__":
    main()
