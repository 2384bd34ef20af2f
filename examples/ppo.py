# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""Train a policy with PPO (a learned value model).

With no arguments it runs an offline demo on CPU in about a minute: the tiny model and synthetic prompts of
`examples/rloo.py`, a value model initialised from the policy's backbone (a fresh one-label score head), and the
reward "fraction of the word 'a' in the completion". It saves the policy, tokenizer, model card and reward_curve.png.

    accelerate launch examples/ppo.py

With arguments it is TRL 1.12's PPO script (script args + PPOConfig + ModelConfig): the policy from --sft_model_path
(or --model_name_or_path), the value and reward models from --reward_model_path, prompts from the dataset's
`prompt` column:

    accelerate launch examples/ppo.py --dataset_name trl-lib/tldr --dataset_train_split train \\
        --sft_model_path <sft-model> --reward_model_path <reward-model> --stop_token eos \\
        --per_device_train_batch_size 16 --total_episodes 10000 --output_dir ppo-tldr
"""

from trl_unified.scripts.ppo import main  # the script behind `trl-unified ppo` too


if __name__ == "__main__":
    main()
