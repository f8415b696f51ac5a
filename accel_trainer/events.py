"""Named events: the only way to hook into a run (Lightning Fabric's idea). No subclassing, no replacing methods.

    trainer.on("update_end", lambda trainer: ...)

| event              | fired                                              | handler                                   |
|--------------------|----------------------------------------------------|-------------------------------------------|
| fit_start          | fit() begins, before the first update              | (trainer)                                 |
| update_end         | after each optimizer update, before log/eval/save  | (trainer)                                 |
| checkpoint_staged  | a checkpoint's files are in its temporary folder,  | (trainer, folder)                         |
|                    | not yet committed (for fault-injection tests)      |                                           |
| checkpoint_written | a checkpoint folder is committed                   | (trainer, path)                           |
| evaluate_end       | after an evaluation                                | (trainer, metrics, final) -> dict | None  |
| fit_end            | after the final save                               | (trainer, metrics)                        |

Handlers run on every process, in the order they were added. An evaluate_end handler may return extra metrics
(e.g. test-time augmentation); they are logged with the evaluation. A recipe attaches by defining
`on_<event>` functions (recipe.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

EVENTS = ("fit_start", "update_end", "checkpoint_staged", "checkpoint_written", "evaluate_end", "fit_end")


class Events:
    def __init__(self):
        self._handlers: dict[str, list[Callable]] = defaultdict(list)

    def on(self, event: str, handler: Callable) -> Callable:
        if event not in EVENTS:
            raise ValueError(f"Unknown event {event!r}; the events are {', '.join(EVENTS)}.")
        self._handlers[event].append(handler)
        return handler

    def has(self, event: str) -> bool:
        return bool(self._handlers.get(event))

    def fire(self, event: str, *args) -> list:
        handlers = self._handlers.get(event)
        return [handler(*args) for handler in handlers] if handlers else []  # no comprehension when none: per update
