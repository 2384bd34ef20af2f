# Copyright 2026 The trl_unified authors. Licensed under the Apache License, Version 2.0.
"""`trl-unified rloo` and `examples/rloo.py`: TRL's rloo script with trl_unified's classes
(`scripts/trl_scripts.py`), or with no model and no config the offline demo (`scripts/online.py`)."""

from trl_unified.scripts import online, trl_scripts


make_parser, main = trl_scripts.entry_points("rloo", online)


if __name__ == "__main__":
    main()
