#!/usr/bin/env bash
# Installs (GPU machine, no network) flash-attn-4 and its CuTe DSL runtime from wheels
# carried under .whl/ (the CuTe DSL library wheel arrives in pieces, the carry limit being smaller
# than it) into .whl/site. Source this file: it exports the PYTHONPATH that finds them
# (the CuTe DSL's .pth line, which a --target install does not run, is spelled out).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -d .whl/site/flash_attn ]; then
  cat .whl/fa4a/cu12p.* .whl/fa4b/cu12p.* .whl/fa4c/cu12p.* > .whl/nvidia_cutlass_dsl_libs_cu12-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  # Unzipped, not pip install --target: pip skips a folder that an earlier wheel made, and the
  # CuTe DSL's base and CUDA library wheels share theirs.
  for w in .whl/fa4a/*.whl .whl/fa4d/*.whl .whl/nvidia_cutlass_dsl_libs_cu12-*.whl; do python3 -m zipfile -e "$w" .whl/site; done
fi
export PYTHONPATH="$PWD:$PWD/.whl/site:$PWD/.whl/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import flash_attn.cute, cutlass; print('flash_attn.cute', flash_attn.cute.__file__)"
