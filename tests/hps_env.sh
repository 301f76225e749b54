#!/usr/bin/env bash
# Builds the optional environment of the rewards that need torchvision (.venv-hps: HPSv2 and the
# OCR reward), and runs tests/test_rewards_hps.py and tests/test_ocr.py in it.
#
# Why a separate environment: the HPSv2 reward runs hpsv2x's vendored open_clip and the OCR reward
# runs EasyOCR, which both import torchvision, and torchvision does not import beside the core
# torch==2.13.0 CPU wheel ("operator torchvision::nms does not exist"); the only pair that works is
# torch==2.14.1 + torchvision==0.29.1 (CUDA builds that also run on CPU, about 6 GB installed).
# hpsv2x also pins pytest==7.2.0 and protobuf<4, so it is installed with --no-deps and the few
# packages its scoring code imports come from requirements-hps.txt. The core environment stays
# light; there the HPS tests and the OCR engine tests skip.
#
#     bash tests/hps_env.sh               # build (or update) .venv-hps, then run the tests
#     HPS_VENV=/path/venv bash tests/hps_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${HPS_VENV:-.venv-hps}"
start=$SECONDS

if [ ! -x "$venv/bin/python" ]; then
    python -m venv "$venv"
fi
# The core requirements without their torch pin (requirements-hps.txt pins the torch that matches
# torchvision), then hpsv2x itself without its pins.
# (pip's notes about local index folders that lack a package are dropped from the log.)
pip_install() {
    "$venv/bin/python" -m pip install -q "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
}
grep -v -E '^torch([<>=~! ]|$)' requirements.txt > "$venv/requirements-core.txt"
pip_install -r "$venv/requirements-core.txt" -r requirements-hps.txt
pip_install --no-deps hpsv2x==1.2.0
echo "hps_env: $venv ready in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"

# HPS_TESTS_REQUIRED and OCR_TESTS_REQUIRED turn the test files'
# skip-when-missing into a failure: here the packages and the OCR weights must be there.
HPS_TESTS_REQUIRED=1 OCR_TESTS_REQUIRED=1 HF_HUB_OFFLINE=1 \
    "$venv/bin/python" -m pytest -q tests/test_rewards_hps.py tests/test_ocr.py
