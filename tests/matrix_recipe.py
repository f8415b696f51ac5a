"""A shipped recipe, run unchanged, plus the faults of the combination matrix (tests/test_matrix.py). The faults
come from the environment, so the recipe's own flags stay exactly what a user passes:

    MATRIX_RECIPE=recipes/x.py   the recipe to run
    MATRIX_KILL_AT=N             every rank SIGKILLs itself right after update N: no clean-up, no handler runs
    MATRIX_EXIT_AT=N             rank 1 exits with status 3 after update N, on the first elastic attempt only

Nothing of this is in the Trainer: it attaches to the recipe's update_end event (none of the shipped recipes uses it).
"""

import dataclasses
import os
import signal
import sys

from accel_trainer import run
from accel_trainer.faults import restart_count
from accel_trainer.recipe import load_recipe


def on_update_end(trainer):
    step = trainer.global_step
    if str(step) == os.environ.get("MATRIX_KILL_AT"):
        os.kill(os.getpid(), signal.SIGKILL)
    if str(step) == os.environ.get("MATRIX_EXIT_AT") and trainer.accelerator.process_index == 1:
        if restart_count() == 0:
            print(f"[matrix fault] rank 1 exits with status 3 after step {step}", file=sys.stderr, flush=True)
            os._exit(3)


if __name__ == "__main__":
    recipe = load_recipe(os.environ["MATRIX_RECIPE"])
    assert "update_end" not in recipe.events, "the matrix's fault would replace the recipe's own update_end handler"
    run(dataclasses.replace(recipe, events={**recipe.events, "update_end": on_update_end}), sys.argv[1:])
