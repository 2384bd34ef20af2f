# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""Train a policy with TPO.

With no arguments it runs an offline demo on CPU in well under a minute: a tiny Qwen2-style model and a word-level
tokenizer are built locally (in a cache folder), the preference rows are synthetic (chosen and gold reference
completions use the words a-m, rejected ones n-z), and held-out reward accuracy and margins are evaluated every 10
steps. It saves the model, tokenizer, model card and rewards.png.

    accelerate launch examples/tpo.py

With arguments it is TRL's dpo script (`trl dpo`: its flags and YAML keys; TRL ships no tpo script) with TPOTrainer:

    accelerate launch examples/tpo.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name <prompt/chosen/rejected/reference rows> \\
        --learning_rate 5e-7 --per_device_train_batch_size 4 --gradient_accumulation_steps 8 \\
        --use_peft --lora_r 16 --output_dir Qwen2.5-0.5B-TPO --push_to_hub
"""

from trl_unified.scripts.tpo import main  # the script behind `trl-unified tpo` too


if __name__ == "__main__":
    main()
