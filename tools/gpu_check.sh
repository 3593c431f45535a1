#!/usr/bin/env bash
# The GPU worker's checks, for a machine with a CUDA device (PyTorch, Triton and
# transformers installed; no package registry needed): run from the repository root,
# within a few minutes. Writes its figures under docs/results/ (bench JSON, commit named).
#
#   tools/gpu_check.sh [OUT_DIR]
set -euo pipefail
out="${1:-docs/results}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
# the Triton kernels compiled for the device, against torch's path
python -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py -m "slow or not slow"
# the engine on the GPU: greedy tokens against transformers (float32 and bfloat16)
python -m pytest -q -p no:cacheprovider tests/worker/test_gpu_worker.py -m "slow or not slow"
# throughput on the device, the model built here with random weights
model="$(mktemp -d)/bench-100m"
python -m kvserve.cli bench make-model bench-100m --out "$model"
python -m kvserve.cli bench throughput --model "$model" --device cuda \
  --json "$out/throughput-100m-gpu.json"
