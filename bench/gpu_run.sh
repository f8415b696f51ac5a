#!/usr/bin/env bash
# The whole GPU run in one command, within 10 minutes on one H100/H200, on a machine where the project is not
# installed (run from a checkout; the checkout goes on PYTHONPATH) and nothing can be downloaded:
#
#   bench/gpu_run.sh --data DIR --out DIR [--wheels DIR] [--budget S] [--dry-run] [-- bench/gpu.py flags...]
#
#   --data DIR     CIFAR-10 in the Hub parquet layout (plain_text/train-*.parquet, test-*.parquet), as
#                  shared/data/cifar10; copy it to local disk first where it sits on a slow mount
#   --out DIR      everything the run writes: gpu_run.log (this script's whole output), env.txt (versions,
#                  nvidia-smi), suite.json (the table as JSON), suite/logs/<row>.log, the runs, the decoded cache
#   --wheels DIR   wheels to install first, with pip --no-index --no-deps into OUT/site (put first on PYTHONPATH):
#                  what the machine lacks, e.g. datasets, evaluate and their pinned needs dill and multiprocess
#                  (docs/cifar.md, "The GPU run", has the download command); one version of each
#   --budget S     seconds bench/gpu.py may take (default 540): rows that do not fit are reported as skipped
#   --dry-run      on any machine, a CPU: the same steps with bench/gpu.py --cpu on its tiny generated CIFAR
#                  (--data is checked, not trained on), the wheels installed into OUT/site the same way
#
# Exit status: bench/gpu.py's (1 when a row failed), or 2 with one line naming the problem.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
DATA="" OUT="" WHEELS="" BUDGET=540 DRY=0
EXTRA=()

die() { echo "error: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --data) DATA="${2:-}"; shift 2 || die "--data needs a folder" ;;
    --out) OUT="${2:-}"; shift 2 || die "--out needs a folder" ;;
    --wheels) WHEELS="${2:-}"; shift 2 || die "--wheels needs a folder" ;;
    --budget) BUDGET="${2:-}"; shift 2 || die "--budget needs seconds" ;;
    --dry-run|--cpu) DRY=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1: see bench/gpu_run.sh --help" ;;
  esac
done
[ -n "$DATA" ] || die "no CIFAR-10 folder: pass --data DIR (the Hub parquet layout, e.g. shared/data/cifar10)"
[ -n "$OUT" ] || die "no output folder: pass --out DIR"
[ -d "$DATA" ] || die "--data $DATA is not a folder: pass the CIFAR-10 folder (plain_text/*.parquet in it)"
[[ "$BUDGET" =~ ^[0-9]+$ ]] || die "--budget $BUDGET: pass whole seconds, e.g. 540"
command -v "$PY" >/dev/null || die "no $PY on PATH: set PYTHON=/path/to/python"
ls "$DATA"/plain_text/train-*.parquet >/dev/null 2>&1 && ls "$DATA"/plain_text/test-*.parquet >/dev/null 2>&1 ||
  die "--data $DATA lacks plain_text/train-*.parquet or test-*.parquet: pass a folder in the Hub layout"

mkdir -p "$OUT" || die "cannot create --out $OUT"
OUT="$(cd "$OUT" && pwd)"
DATA="$(cd "$DATA" && pwd)"
exec > >(tee "$OUT/gpu_run.log") 2>&1  # everything below, also into the output folder
TEE=$!
trap 'exec 1>&- 2>&-; wait $TEE' EXIT  # the log complete when the script returns
START=$SECONDS
echo "bench/gpu_run.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) checkout $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)" \
  "data $DATA out $OUT$([ $DRY = 1 ] && echo ' (dry run, CPU)')"

# The wheels: into OUT/site, first on the path. --no-deps: nothing is resolved against an index (there is none),
# and the machine's torch is never replaced; a missing need shows in the import check below.
if [ -n "$WHEELS" ]; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || die "--wheels $WHEELS holds no .whl files"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$OUT/site" \
    "$WHEELS"/*.whl || die "pip could not install the wheels in $WHEELS (its output is above)"
  export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The checkout, not an installed copy: the GPU machine has none (and an installed one would be another version).
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

# What the run imports, with versions, before any row starts: one line per missing package.
"$PY" - "$DATA" "$DRY" > "$OUT/env.txt" <<'EOF' || { cat "$OUT/env.txt"; die "the environment cannot run the suite (above)"; }
import importlib, platform, sys

missing = []
print(f"python {platform.python_version()} {sys.executable}")
for name in ("torch", "accelerate", "transformers", "datasets", "evaluate", "safetensors", "tokenizers", "numpy",
             "pyarrow", "PIL", "yaml", "psutil", "tqdm"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} {getattr(module, '__file__', '')}")
    except Exception as e:  # noqa: BLE001 - any failure to import is the same answer: carry its wheel
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit("\n".join(f"error: missing {m}: carry its wheel (--wheels DIR)" for m in missing))
try:
    import accel_trainer  # the checkout's (PYTHONPATH)

    print(f"accel_trainer {accel_trainer.__file__}")
except Exception as e:  # noqa: BLE001
    missing.append(f"what accel_trainer imports ({type(e).__name__}: {e})")
import torch

if torch.cuda.is_available():
    cc = torch.cuda.get_device_capability()
    print(f"cuda {torch.version.cuda} device {torch.cuda.get_device_name()} capability {cc[0]}.{cc[1]}")
elif sys.argv[2] != "1":
    missing.append("a CUDA device (torch.cuda.is_available() is False; --dry-run runs on a CPU)")
import pyarrow.parquet as pq
from pathlib import Path

rows = {s: sum(pq.ParquetFile(f).metadata.num_rows for f in Path(sys.argv[1], "plain_text").glob(f"{s}-*.parquet"))
        for s in ("train", "test")}
print(f"data {sys.argv[1]}: {rows['train']} train, {rows['test']} test images")
if rows != {"train": 50000, "test": 10000}:
    print("note: not the full CIFAR-10 (50000 + 10000): the 94% goal means nothing on this data")
for m in missing:
    print(f"error: missing {m}: carry its wheel (--wheels DIR)")
sys.exit(1 if missing else 0)
EOF
cat "$OUT/env.txt"
if [ $DRY = 0 ] && command -v nvidia-smi >/dev/null; then nvidia-smi >> "$OUT/env.txt" 2>&1; fi

if [ $DRY = 1 ]; then  # the CPU reduced mode: its tiny CIFAR, no cold compile (minutes on a CPU)
  SUITE=("$ROOT/bench/gpu.py" --cpu --skip torch_compile)
else
  SUITE=("$ROOT/bench/gpu.py" --dataset "$DATA" --cache_dir "$OUT/cache")
fi
# A flag given twice takes its last value: what follows -- wins over these.
"$PY" "${SUITE[@]}" --out "$OUT/suite" --json "$OUT/suite.json" --budget "$BUDGET" --timeout 300 "${EXTRA[@]}"
rc=$?
echo "bench/gpu_run.sh: exit $rc after $((SECONDS - START)) s; JSON $OUT/suite.json, logs $OUT/suite/logs, $OUT/gpu_run.log"
exit $rc
