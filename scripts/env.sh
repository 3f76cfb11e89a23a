# Sourced by scripts/test and scripts/demo: the one place their shared settings live.
# CUDA is not a Debian package here; when present it lives under /usr/local/cuda.
if [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
# Keep UCX's shared-memory transports on under peer error handling (see docs/transport).
export UCX_POSIX_ERROR_HANDLING=${UCX_POSIX_ERROR_HANDLING:-y}
export UCX_SYSV_ERROR_HANDLING=${UCX_SYSV_ERROR_HANDLING:-y}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
