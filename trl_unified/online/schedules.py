"""Learning-rate schedules that move less often than the optimiser steps."""


class EveryNStepsScheduler:
    """Step the wrapped scheduler once every `every` calls: e.g. once per rollout when a rollout spans `every`
    optimiser steps (TRL's PPO moves the learning rate once per rollout, `transformers.Trainer` steps the scheduler
    after every optimiser step)."""

    def __init__(self, scheduler, every: int):
        self.scheduler, self.every, self.calls = scheduler, every, 0

    def step(self, *args, **kwargs):
        self.calls += 1
        if self.calls % self.every == 0:
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return {"scheduler": self.scheduler.state_dict(), "calls": self.calls}

    def load_state_dict(self, state):
        self.scheduler.load_state_dict(state["scheduler"])
        self.calls = state["calls"]

    def __getattr__(self, name):  # optimizer, base_lrs, ... of the wrapped scheduler
        return getattr(self.scheduler, name)
