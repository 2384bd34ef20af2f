# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified online_dpo` and `examples/online_dpo.py`: TRL's grpo script (prompts, `reward_funcs`) with the online
DPO classes (`scripts/trl_scripts.py`; TRL 1.16 ships no online DPO script), or with no model and no config the
offline demo (`scripts/online.py`)."""

from trl_unified.scripts import online, trl_scripts


make_parser, main = trl_scripts.entry_points("online_dpo", online)


if __name__ == "__main__":
    main()
