"""--report_to: transformers' values as one canonical string, and whether each tracker it names can log here."""

from __future__ import annotations

from .errors import ArgumentError


def canonical_report_to(value) -> str:
    """transformers' `report_to` values (None, [], ["a", "b"], "a,b", "all", "none") as one string: "none", "all"
    or names joined by commas. The same run then records the same value from the command line and from Python."""
    if value is None:
        return "none"
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ArgumentError(f"--report_to: {value!r} is not a tracker name, a list of names, 'all' or 'none'.")
    names = [v.strip() for v in value if v.strip()]
    if len(names) > 1 and ("none" in names or "all" in names):
        raise ArgumentError(f"--report_to: 'none' and 'all' stand alone, got {','.join(names)}.")
    return ",".join(names) or "none"


# What `pip install` needs for each of Accelerate's trackers (its LoggerType names).
TRACKER_PACKAGES = {"tensorboard": "tensorboard (or tensorboardX)", "comet_ml": "comet_ml"}


def tracker_problem(trackers) -> str | None:
    """The one line refusing --report_to (TrainingArguments.trackers) when a tracker it names cannot log here, or
    None. Accelerate drops a tracker whose package is missing with a warning and the run logs nothing to it, and
    raises a ValueError traceback for an unknown name. "all" takes whatever is installed, as Accelerate does."""
    if not trackers or trackers == "all":
        return None
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    known = sorted(t.value for t in LoggerType if t.value != "all")
    available = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    for name in trackers:
        if name not in known:
            return f"--report_to {name}: not a tracker Accelerate knows; use {', '.join(known)}, 'all' or 'none'."
        if name not in available:
            return (
                f"--report_to {name}: its package is not installed here, so nothing would be logged there. "
                f"Install it (pip install {TRACKER_PACKAGES.get(name, name)}) or drop {name} from --report_to "
                "(metrics.jsonl is always written)."
            )
    return None
