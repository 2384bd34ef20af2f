# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""Train a policy with CPO.

With no arguments it runs an offline demo on CPU in well under a minute: a tiny Qwen2-style model and a word-level
tokenizer are built locally (in a cache folder), the preference pairs are synthetic (chosen completions use the
words a-m, rejected ones n-z), and held-out reward accuracy and margins are evaluated every 10 steps. It saves the
model, tokenizer, model card and rewards.png.

    accelerate launch examples/cpo.py

With arguments it is TRL's dpo script (`trl dpo`: its flags and YAML keys; TRL ships no cpo script) with CPOTrainer:

    accelerate launch examples/cpo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/ultrafeedback_binarized \\
        --learning_rate 8e-6 --per_device_train_batch_size 4 --gradient_accumulation_steps 8 \\
        --use_peft --lora_r 16 --output_dir Qwen2.5-0.5B-CPO --push_to_hub
"""

from trl_unified.scripts.cpo import main  # the script behind `trl-unified cpo` too


if __name__ == "__main__":
    main()
