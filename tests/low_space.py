"""`python tests/low_space.py RECIPE ARGS...`: run a recipe with the disk reporting 4 KiB free (shutil.disk_usage),
the state in which a write error could be taken for a full disk."""

import runpy
import shutil
import sys
from collections import namedtuple

Usage = namedtuple("Usage", "total used free")
shutil.disk_usage = lambda path: Usage(1 << 30, (1 << 30) - 4096, 4096)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
