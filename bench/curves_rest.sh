#!/bin/sh
# Every curve of issue 43 parts 1c-1f at full quality, then the plots (bench/curves/*.json,
# bench/plots/*.png). Run from the repository root on a quiet machine:
#   sh bench/curves_rest.sh            (PYTHON=/path/to/python to pick the interpreter)
set -e
PY=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=1
start=$(date +%s)
$PY bench/curves_deepspeed.py --windows 16 --steps 8 --profile > /dev/null
$PY bench/curves_cp.py > /dev/null
$PY bench/curves_checkpoint.py --repeat 5 > /dev/null
$PY bench/curves_gather.py > /dev/null
$PY bench/plot_curves.py
echo "curves_rest.sh: $(( $(date +%s) - start )) s"
