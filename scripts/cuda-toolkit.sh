#!/usr/bin/env bash
# Assembles the CUDA 13.0 build toolkit that `--features cuda` needs from PyPI wheels, on a
# machine with no CUDA install and no GPU (docs/AUDITOR.md "On a GPU"), and prints the
# environment to build with. Idempotent: a second run only prints.
#
#   eval "$(scripts/cuda-toolkit.sh)"     # then: cargo build --release -p engy-audit --features cuda
#
# The CCCL wheel carries `nv/target` and the libcu++ headers the kernels include.
# Why these pins: candle 0.9's cuda backend (cudarc 0.19) knows CUDA 13.0 to 13.4 and asks
# `nvcc --version`; PTX made by an nvcc newer than the GPU's driver does not load (the H200
# here runs driver 580 = CUDA 13.0), so nvcc is 13.0.88. The wheels ship versioned library
# names only and no libcuda, so this adds the unversioned links the linker looks for and a
# libcuda.so stub (soname libcuda.so.1, every cu* entry point of cuda.h as an empty
# function); at run time the driver's own libcuda.so.1 is the one loaded.
#
# Env: ENGY_CUDA_VENV (default ~/.cache/engy/cuda-venv), PYTHON (default python3).
set -euo pipefail

venv="${ENGY_CUDA_VENV:-$HOME/.cache/engy/cuda-venv}"
py="${PYTHON:-python3}"
pins=(
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvrtc==13.0.88
  nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
)

if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv" >&2
fi
if ! "$venv/bin/python" -m pip show -q "${pins[@]%%==*}" >/dev/null 2>&1; then
  echo "cuda-toolkit: installing ${pins[*]} into $venv" >&2
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}" >&2
fi

root="$("$venv/bin/python" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')"
lib="$root/lib"
[ -x "$root/bin/nvcc" ] || { echo "cuda-toolkit: no nvcc under $root/bin" >&2; exit 1; }

# Unversioned names for the linker (-lcublas finds libcublas.so).
for l in cudart cublas cublasLt curand nvrtc; do
  v="$(cd "$lib" && ls "lib$l.so."* 2>/dev/null | grep -v builtins | head -n1 || true)"
  [ -n "$v" ] || { echo "cuda-toolkit: lib$l.so.* missing from $lib" >&2; exit 1; }
  ln -sfn "$v" "$lib/lib$l.so"
done
# cudarc searches lib64 as well as lib.
[ -e "$root/lib64" ] || ln -sfn lib "$root/lib64"

# The driver stub: an empty function for every cu* name cuda.h declares or #defines.
if [ ! -e "$lib/libcuda.so" ] || [ "$root/include/cuda.h" -nt "$lib/libcuda.so" ]; then
  tmp="$(mktemp -d)"
  grep -oE '\bcu[A-Z][A-Za-z0-9_]*\b' "$root/include/cuda.h" | sort -u \
    | sed 's/.*/void &(void) {}/' >"$tmp/stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$lib/libcuda.so" "$tmp/stub.c"
  rm -rf "$tmp"
  echo "cuda-toolkit: wrote the libcuda.so stub ($(wc -l <"$lib/libcuda.so" >/dev/null; nm -D "$lib/libcuda.so" | grep -c ' T ') symbols)" >&2
fi

cat <<ENV
export CUDA_ROOT="$root"
export CUDA_PATH="$root"
export PATH="$root/bin:\$PATH"
export LIBRARY_PATH="$lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
ENV
