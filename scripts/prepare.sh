#!/usr/bin/env bash
# Download a Hugging Face checkpoint and convert it for redline.
#
#   scripts/prepare.sh ORG/NAME [converter args...]
#
# 1. python scripts/download.py --repo_id ORG/NAME --checkpoint_dir <repo>/checkpoints
# 2. python scripts/convert_hf_checkpoint.py --checkpoint_dir <repo>/checkpoints/ORG/NAME [converter args...]
#
# Python: $PYTHON if set, else <repo>/.venv/bin/python if present, else python3 (or python).
# Gated models: export HF_TOKEN=... (or run `hf auth login`; `huggingface-cli login` before huggingface_hub 1.0) first.
set -euo pipefail

usage() {
    echo "usage: scripts/prepare.sh ORG/NAME [converter args...]" >&2
    echo "  downloads ORG/NAME from the Hugging Face Hub into checkpoints/ORG/NAME and converts it" >&2
    echo "  (set HF_TOKEN for gated models, PYTHON to choose the interpreter)" >&2
}

if [[ $# -lt 1 || -z "${1:-}" ]]; then
    usage
    exit 2
fi
case "$1" in
    -h|--help) usage; exit 0 ;;
esac

REPO_ID="$1"
shift
if [[ ! "$REPO_ID" =~ ^[^/[:space:]]+/[^/[:space:]]+$ ]]; then
    echo "error: invalid repo id '$REPO_ID': expected ORG/NAME" >&2
    exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then
    PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PY="$ROOT/.venv/bin/python"
elif command -v python3 >/dev/null 2>&1; then
    PY=python3
else
    PY=python
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

CHECKPOINTS="$ROOT/checkpoints"
"$PY" "$ROOT/scripts/download.py" --repo_id "$REPO_ID" --checkpoint_dir "$CHECKPOINTS"
"$PY" "$ROOT/scripts/convert_hf_checkpoint.py" --checkpoint_dir "$CHECKPOINTS/$REPO_ID" "$@"
