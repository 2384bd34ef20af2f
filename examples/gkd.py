# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""Distil a teacher into a student with GKD (on-policy and off-policy rounds mixed by `lmbda`).

With no arguments it runs an offline demo on CPU in well under a minute: a tiny student and a larger, sharpened tiny
teacher are built locally (in a cache folder), the rows are synthetic conversations, and the held-out divergence is
printed before and after training.

    accelerate launch examples/gkd.py

With arguments it is TRL's distillation script (`trl distillation`: its flags and YAML keys; TRL 1.16 ships no GKD
script) with GKDTrainer and GKDConfig (`messages` rows, the last turn the completion):

    accelerate launch examples/gkd.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --teacher_model_name_or_path Qwen/Qwen2.5-1.5B-Instruct \\
        --dataset_name trl-lib/chatbot_arena_completions --lmbda 0.5 --beta 0.5 --max_new_tokens 256 \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 8 --output_dir Qwen2.5-0.5B-GKD
"""

from trl_unified.scripts.gkd import main  # the script behind `trl-unified gkd` too


if __name__ == "__main__":
    main()
