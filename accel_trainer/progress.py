"""How far a run is: the Trainer's Progress, a component with its own state (steps done, skipped, the best
evaluation, evaluations without improvement), saved in every checkpoint's trainer_state.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Progress:
    """How far the run is; saved in every checkpoint (trainer_state.json). Where it is in the data (epoch, batch in
    the epoch) is the data position's (loaders.MapPosition, streaming.Stream). Written only by its methods below,
    which only the Trainer calls (an update, a new best evaluation, a resume)."""

    global_step: int = 0  # optimizer updates done (attempted, including fp16- and NaN-skipped ones)
    skipped_steps: int = 0  # fp16 overflow skips + non-finite skips
    best_metric: float | None = None  # --metric_for_best_model: the best evaluation so far
    best_step: int | None = None
    evals_without_improvement: int = 0  # --early_stopping_patience counts them
    # a notebook's train_step/overfit_batch updates since fit() last undid them: they move neither the data position
    # nor, with the schedule held, the scheduler (checkpointing/counters.py derives both from the step)
    debug_steps: int = 0

    def updated(self):
        self.global_step += 1

    def debugged(self):
        """The update just counted was a notebook's debugging update (Trainer.train_step)."""
        self.debug_steps += 1

    def skipped(self):
        """An update found skipped (update.Updater.on_skipped: when it ran, or when its outcome was read)."""
        self.skipped_steps += 1

    def new_best(self, value: float | None):
        """An evaluation's outcome: its value when it improved on the best (None: it did not)."""
        if value is None:
            self.evals_without_improvement += 1
        else:
            self.best_metric, self.best_step, self.evals_without_improvement = value, self.global_step, 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict):
        """A checkpoint's values; a field it lacks (an older checkpoint) keeps its default."""
        for name, default in asdict(Progress()).items():
            setattr(self, name, state.get(name, default))
        if type(self.evals_without_improvement) is not int:  # not checked by checkpointing.verify: none resumed
            self.evals_without_improvement = 0
