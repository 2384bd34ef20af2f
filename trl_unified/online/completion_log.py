"""`CompletionLog`: the last generation batch's samples (TRL's `trainer._logs`), printed and sent to W&B at logging
steps when `log_completions` is on."""

from collections import defaultdict, deque

import torch
from accelerate.utils import gather_object


class CompletionLog:
    """Prompts, completions, rewards per function, advantages, extra columns (from reward functions' `log_extra`) and
    images of the last `size` completions, gathered from every process; `columns` is TRL's `trainer._logs` layout."""

    def __init__(self, size: int):
        new = lambda: deque(maxlen=size)
        self.columns = dict(images=new(), prompt=new(), completion=new(), rewards=defaultdict(new), advantages=new())
        self.columns["extra"] = defaultdict(new)
        self._rewards = new()  # each completion's combined reward (NaN: unscored)
        self._pending_extra: dict[str, list] = defaultdict(list)
        self._rounds = self._printed = 0

    def log_extra(self, column: str, values: list) -> None:
        """`log_extra` for reward functions: one value per completion of this process, shown as a column."""
        self._pending_extra[column].extend(values)

    def add_round(
        self, prompts, completions, images, rewards, rewards_per_func, reward_names, advantages, log_images=True
    ):
        """Add one generation round. `prompts`/`completions`/`images`: this process's rows (gathered here, so every
        process must call it); `rewards` `(N_global,)` (the trainer's weighting, or None when nothing is scored),
        `rewards_per_func` `(N_global, F)` and `advantages` `(N_global,)` are already global."""
        logs = self.columns
        logs["prompt"].extend(gather_object(prompts))
        logs["completion"].extend(gather_object(completions))
        self._rewards.extend(rewards.tolist() if rewards is not None else [float("nan")] * len(completions))
        for i, name in enumerate(reward_names):
            logs["rewards"][name].extend(rewards_per_func[:, i].tolist())
        if advantages is not None:
            self.add_advantages(advantages)
        # Every process must join each gather: agree on the column names first (a column may be logged on one rank).
        for name in sorted(set(gather_object(list(self._pending_extra)))):
            logs["extra"][name].extend(gather_object(self._pending_extra.get(name, [None] * len(prompts))))
        self._pending_extra.clear()
        if images is not None and log_images:
            logs["images"].extend(gather_object(images))
        self._rounds += 1

    def add_advantages(self, advantages: torch.Tensor) -> None:
        """Advantages of a round, `(N_global,)`, when they are known only in the loss (RLOO's deferred KL shaping)."""
        self.columns["advantages"].extend(advantages.tolist())

    def rows(self, unique_prompts: bool = False, limit: int | None = None) -> list[tuple]:
        """`(prompt, completion, reward, {column: value})` per logged completion."""
        logs = self.columns
        columns = dict(logs["extra"])
        if logs["advantages"]:
            columns["advantage"] = logs["advantages"]
        rows = [
            (prompt, completion, reward, {k: v[i] for k, v in columns.items() if i < len(v)})
            for i, (prompt, completion, reward) in enumerate(zip(logs["prompt"], logs["completion"], self._rewards))
        ]
        if unique_prompts:
            rows = list({str(row[0]): row for row in rows}.values())
        return rows[: limit or len(rows)]

    def report(self, step: int, args) -> None:
        """Print the rounds added since the last report (once each), and log them to W&B when it is enabled."""
        if self._printed >= self._rounds:
            return
        self._printed = self._rounds
        rows = self.rows(args.log_unique_prompts, args.num_completions_to_print)
        for prompt, completion, reward, extra in rows:
            values = "".join(f"\n  {k}: {v}" for k, v in extra.items())
            print(f"[step {step}] reward={reward:.3f}\n  prompt: {prompt}\n  completion: {completion}{values}")
        if "wandb" in (args.report_to or []):
            import wandb

            if wandb.run is not None:
                columns = sorted({k for *_, extra in rows for k in extra})
                names = ["step", "prompt", "completion", "reward", *columns]
                data = [[step, str(p), str(c), r, *[e.get(k) for k in columns]] for p, c, r, e in rows]
                wandb.log({"completions": wandb.Table(columns=names, data=data)})


def sample_generations(trainer, sampling: bool = False) -> list[dict]:
    """TRL's sample generations: near-greedy completions (temperature 0.01) for the eval prompts (only the first
    `per_device_eval_batch_size` rows when `sampling`) with their combined reward; the first rows are printed on
    the main process; every row is returned as `{"query", "model response", "score"}`."""
    if trainer.eval_dataset is None or isinstance(trainer.eval_dataset, dict):
        return []
    rows = list(trainer.eval_dataset)
    rows = rows[: trainer.args.per_device_eval_batch_size] if sampling else rows
    rows = rows[trainer.accelerator.process_index :: trainer.accelerator.num_processes]
    prompts, _, environments = trainer._rollout_prompts(rows)
    temperature, trainer.args.temperature = trainer.args.temperature, 0.01
    try:
        out = trainer.generate(prompts)
    finally:
        trainer.args.temperature = temperature
    scores = trainer.rewards.combine(trainer._score(rows, prompts, out.texts, out, environments)).tolist()
    trainer._release_environments(environments)
    pairs = zip(gather_object(prompts), gather_object(out.texts), scores, strict=True)
    table = [{"query": query, "model response": text, "score": score} for query, text, score in pairs]
    if trainer.accelerator.is_main_process:
        for row in table[:5]:
            print(row)
    return table
