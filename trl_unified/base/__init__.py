"""Deprecated import paths: `trl_unified.base.<module>` until 0.1 (removed in 0.3).

The flat `base/` package was split into `core/`, `data/`, `generation/`, `online/`, `preference/`, `evaluation/` and
`hub/` (see docs/architecture.md). Importing an old path still works: it returns a module whose attributes are looked
up in the new modules, with one `DeprecationWarning` naming the new path.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings


# old module -> the new modules that hold its names (looked up in this order)
MOVED = {
    "agents": ["online.agents"],
    "answers": ["evaluation.answers"],
    "batch": ["core.batch"],
    "completion_log": ["online.completion_log"],
    "config": ["core.config"],
    "critic": ["online.critic"],
    "data": ["data.datasets", "online.sampler"],
    "decode": ["generation.lean"],
    "generation": ["generation", "generation.batched", "generation.prompts", "generation.unwrap"],
    "judge": ["evaluation.judge"],
    "logprobs": ["core.logprobs"],
    "model_card": ["hub.model_card"],
    "models": ["core.models"],
    "online": ["online.trainer"],
    "online_config": ["online.config"],
    "packed_weights": ["generation.packed_weights"],
    "papers": ["hub.papers"],
    "prefix": ["generation.sharing", "generation.fallbacks"],
    "preference": ["preference.trainer", "preference.config"],
    "preference_data": ["preference.data"],
    "reference": ["core.reference"],
    "rewards": ["online.rewards"],
    "rollout": ["online.rollout"],
    "schedules": ["online.critic"],
    "sft_data": ["data.sft"],
    "shutdown": ["core.shutdown"],
    "trainer": ["core.trainer"],
    "vision": ["data.vision"],
}


class _MovedModule(types.ModuleType):
    def __init__(self, name: str, targets: list[str]):
        super().__init__(name)
        self.__targets = targets

    def __getattr__(self, attr: str):
        for target in self.__targets:
            try:
                module = importlib.import_module(f"trl_unified.{target}")
            except ModuleNotFoundError:
                continue
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        prefix, _, leaf = fullname.rpartition(".")
        if prefix == __name__ and leaf in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        leaf = spec.name.rpartition(".")[2]
        new = ", ".join(f"trl_unified.{t}" for t in MOVED[leaf])
        warnings.warn(
            f"{spec.name} is deprecated and will be removed in trl_unified 0.3; import from {new} instead.",
            DeprecationWarning,
            stacklevel=2,
        )
        return _MovedModule(spec.name, MOVED[leaf])

    def exec_module(self, module):
        pass


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedFinder())
