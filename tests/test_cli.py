"""The `accel-trainer` console script: every subcommand is there, and one that cannot be imported is an error."""

import sys

import pytest

from accel_trainer import cli

SUBCOMMANDS = ("train", "config", "check", "launch", "report")


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out, f"accel-trainer --help does not list {name!r}:\n{out}"


@pytest.mark.parametrize("module", ["cluster.wizard", "cluster.check"])
def test_a_subcommand_module_that_fails_to_import_is_an_error_not_a_missing_command(monkeypatch, module):
    # None in sys.modules makes `import accel_trainer.<module>` raise ImportError, as a broken import inside
    # the module (a missing dependency, a typo) would. The CLI must not carry on without that subcommand.
    monkeypatch.setitem(sys.modules, f"accel_trainer.{module}", None)
    with pytest.raises(ImportError, match=module):
        cli.main(["--help"])
