"""Each knob reaches Accelerate through its own kwargs handler / plugin (what Accelerate then does with it is
Accelerate's, tested there; a real 2-process run with a comm hook is in test_parity.py)."""

from datetime import timedelta

import pytest
from accelerate.utils import DDPCommunicationHookType

from accel_trainer import TrainingArguments
from accel_trainer.accel import build_accelerator


def test_kwargs_handlers_carry_the_arguments(tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        ddp_comm_hook="power_sgd",
        powersgd_rank=4,
        ddp_find_unused_parameters=True,
        ddp_timeout=77,
        torch_compile=True,
    )
    acc = build_accelerator(args)
    # the comm hook is Accelerate's to register on the DDP model, with the PowerSGD rank asked for
    assert acc.ddp_handler.comm_hook == DDPCommunicationHookType.POWER_SGD
    assert acc.ddp_handler.comm_state_option == {"matrix_approximation_rank": 4}
    assert acc.ddp_handler.find_unused_parameters is True
    assert acc.init_handler.timeout == timedelta(seconds=77)
    assert acc.state.dynamo_plugin.backend.value.lower() == "inductor"
    assert acc.step_scheduler_with_optimizer is False  # we step the scheduler once per update ourselves


def test_a_second_accelerator_does_not_inherit_the_first_ones_settings(tmp_path):
    build_accelerator(TrainingArguments(output_dir=str(tmp_path), torch_compile=True, mixed_precision="bf16"))
    acc = build_accelerator(TrainingArguments(output_dir=str(tmp_path)))
    assert acc.state.dynamo_plugin.backend.value.lower() == "no"
    assert acc.mixed_precision == "no"


def test_mixed_precision_unset_follows_the_launcher_and_set_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch` exports from its config
    assert build_accelerator(TrainingArguments(output_dir=str(tmp_path))).mixed_precision == "bf16"
    assert build_accelerator(TrainingArguments(output_dir=str(tmp_path), mixed_precision="no")).mixed_precision == "no"


@pytest.mark.slow
def test_console_script_train(tmp_path):
    import subprocess
    import sys

    from helpers import RECIPES, env

    out = tmp_path / "o"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accel_trainer.cli",
            "train",
            f"{RECIPES}/regression.py",
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--disable_tqdm",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "model.safetensors").exists()


class _Built(Exception):
    pass


def test_nccl_errors_surface_as_exceptions_so_the_dead_rank_is_named(tmp_path, monkeypatch):
    """torch's default NCCL error handling (3, SkipCleanUp) kills the process from the watchdog thread when a
    collective fails or times out, before the Trainer can name the rank that stopped answering. The Accelerator
    (and with it the process group, which reads the variable when it is created) is built with 2 (CleanUpOnly):
    the communicators are aborted and the failure reaches the main thread as an exception. The user's own value
    wins. (That NCCL then behaves so is not yet run on a GPU: docs/fault-tolerance.md.)"""
    import os

    from accel_trainer import accel

    seen = []

    def record(*a, **k):  # stands in for Accelerator(): the environment the process group would be created in
        seen.append(os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
        raise _Built

    monkeypatch.setattr(accel, "Accelerator", record)
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    for users in (None, "1"):
        if users:
            monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", users)
        try:
            build_accelerator(TrainingArguments(output_dir=str(tmp_path)))
        except _Built:
            pass
    assert seen == ["2", "1"]


def test_flight_recorder_is_on_before_the_process_group_unless_the_user_chose(tmp_path, monkeypatch):
    """torch's Flight Recorder (the last collectives each rank entered, named in a hang report) is read when the
    process group is created: the Accelerator is built with TORCH_FR_BUFFER_SIZE set; the user's own size (under
    either of torch's names, 0 switching it off) wins. That it records on gloo: test_fault_tolerance.py's hang test."""
    import os

    from accel_trainer import accel

    seen = []

    def record(*a, **k):
        seen.append((os.environ.get("TORCH_FR_BUFFER_SIZE"), os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE")))
        raise _Built

    monkeypatch.setattr(accel, "Accelerator", record)
    for name, users in ((None, None), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"), ("TORCH_FR_BUFFER_SIZE", "7")):
        for each in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
            monkeypatch.delenv(each, raising=False)
        if name:
            monkeypatch.setenv(name, users)
        try:
            build_accelerator(TrainingArguments(output_dir=str(tmp_path)))
        except _Built:
            pass
    assert seen == [("2000", None), (None, "0"), ("7", None)]


def test_compiling_on_a_cpu_turns_inductor_weight_prepacking_off_unless_the_user_chose(tmp_path, monkeypatch):
    # accel.inductor_on_cpu: the workaround for pytorch/pytorch#181618 (test_compile_cpu.py runs the crash itself).
    import torch._inductor.config as inductor

    from accel_trainer.accel import inductor_on_cpu

    monkeypatch.setattr(inductor.cpp, "weight_prepack", True)  # restored after the test
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WEIGHT_PREPACK", raising=False)
    assert inductor_on_cpu(build_accelerator(TrainingArguments(output_dir=str(tmp_path), use_cpu=True))) is None
    assert inductor.cpp.weight_prepack is True  # nothing compiles: nothing changed
    compiled = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, torch_compile=True)
    monkeypatch.setenv("TORCHINDUCTOR_CPP_WEIGHT_PREPACK", "1")  # the user's choice stands
    assert inductor_on_cpu(build_accelerator(compiled)) is None and inductor.cpp.weight_prepack is True
    monkeypatch.delenv("TORCHINDUCTOR_CPP_WEIGHT_PREPACK")
    assert inductor_on_cpu(build_accelerator(compiled)) == {"cpp.weight_prepack": False}
    assert inductor.cpp.weight_prepack is False
    # an accelerate config's dynamo backend compiles too (what `accelerate launch` exports from the config)
    monkeypatch.setattr(inductor.cpp, "weight_prepack", True)
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert inductor_on_cpu(build_accelerator(plain)) == {"cpp.weight_prepack": False}


@pytest.mark.slow
def test_importing_changes_nothing_and_a_run_records_what_it_changed_in_the_process(tmp_path):
    """A launched worker's SIGUSR1 handler is installed by the run's set-up (accel.configure_process), not by
    `import accel_trainer`; run_config.json's "process" lists every process-wide change the run made."""
    import json
    import subprocess
    import sys

    from helpers import RECIPES, env

    code = (
        "import signal, sys, json\n"
        "import accel_trainer\n"
        "print('after import:', signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL)\n"
        f"sys.argv = ['regression', '--output_dir', {str(tmp_path / 'o')!r}, '--max_steps', '1', '--save_steps', '0',"
        " '--disable_tqdm']\n"
        f"accel_trainer.run({f'{RECIPES}/regression.py'!r})\n"
        "print('after set-up:', signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL)\n"
    )
    child = env(ACCEL_TRAINER_LAUNCHED="1")
    for name in (
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_FR_BUFFER_SIZE",
    ):  # earlier tests
        child.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after import: True" in proc.stdout and "after set-up: False" in proc.stdout, proc.stdout
    with open(tmp_path / "o" / "run_config.json") as f:
        process = json.load(f)["process"]
    assert process["sigusr1_kept_during_setup"] is True
    assert process["accelerate_state_reset"] == ["AcceleratorState", "GradientState"]
    assert process["environ"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_FR_BUFFER_SIZE": "2000"}
    assert process["fsdp_in_partial_state"] is False and process["inductor"] is None
    assert process["cpu_allocator"]["tuned"] is True
