"""Features that need newer torch or Accelerate releases than the package's lower bounds (pyproject.toml), each with
the releases it needs and why (what the older releases were measured to do: .ci/versions, tests/test_versions.py).
A run that asks for one on older releases is refused at start-up in one line naming the releases it needs, rather
than run and be silently wrong."""

from __future__ import annotations

# feature: ({package: oldest release that works}, what goes wrong below it, the fix besides upgrading)
NEEDS = {
    "FSDP": (
        {"torch": (2, 11), "accelerate": (1, 14)},
        "older releases gave FSDP2 runs whose losses differ from 1 process and a resume after SIGKILL that is not "
        "bit-identical",
        "run without FSDP (DDP: a config without distributed_type FSDP)",
    ),
    # --save_async runs on torch 2.13 and 2.15 in CI (.ci/run, newest) and on 2.11 by `bash .ci/versions torch-2.11`,
    # and ran on 2.11 on an H100. 2.11's and 2.12's DefaultStager closes itself after each stage (read in their wheels; 2.9's, 2.10's,
    # 2.13's do not), so async_writer.py makes one per checkpoint. Not run on 2.9, 2.10 or 2.12.
    "--save_async": (
        {"torch": (2, 9)},
        "its copy of the state is staged by torch.distributed.checkpoint's DefaultStager, which torch 2.8 lacks; "
        "PyTorch documents it from 2.9, and 2.9 and 2.10 are not run here",
        "drop --save_async (checkpoints are then written while training waits)",
    ),
}


def release(package: str) -> tuple[int, ...]:
    """The installed release of `package` as numbers: "2.8.0+cu128" -> (2, 8, 0)."""
    from packaging.version import Version

    module = __import__(package)
    return Version(module.__version__).release


def _text(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def problem(feature: str) -> str | None:
    """One line saying `feature` needs newer releases than the installed ones, or None when they suffice."""
    needs, why, otherwise = NEEDS[feature]
    old = {p: release(p) for p, v in needs.items() if release(p) < v}
    if not old:
        return None
    have = " and ".join(f"{p} {_text(v)}" for p, v in old.items())
    want = " and ".join(f"{p} >= {_text(needs[p])}" for p in old)
    return f"{feature} on this {have} needs {want} ({why}): upgrade ({want}), or {otherwise}."
