// cuBLASLt, loaded when a GPU stage first uses it, not when a process starts.
//
// libcublasLt is half a gigabyte: linking it made every `moevement` process (the head, every
// worker and spare, every CLI call) spend about 0.37 s of CPU loading and relocating it, CPU
// jobs included (measured on a 2-core machine: `moevement --version` 0.4 s, of which cuBLASLt
// ~0.37 s). These are the cuBLASLt functions models/cuda/kernels.cu calls, defined here with the
// header's own declarations: each opens the library on first use (dlopen of the soname of
// the toolkit we compiled against) and forwards. Without the library every call answers
// CUBLAS_STATUS_NOT_INITIALIZED, which the callers already report.
#include <cublasLt.h>
#include <dlfcn.h>

#include <string>

#include "models/cuda/device.hpp"

namespace {

struct opened {
  void* handle = nullptr;
  std::string error;  // dlerror() when it could not be opened
};

const opened& cublaslt() {
  static const opened once = [] {
    const std::string name = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
    opened o;
    o.handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (o.handle == nullptr) {
      const char* why = ::dlerror();
      o.error = why != nullptr ? why : name + ": cannot be opened";
    }
    return o;
  }();
  return once;
}

template <class Function>
Function* cublaslt_symbol(const char* name) {
  void* const handle = cublaslt().handle;
  return handle == nullptr ? nullptr : reinterpret_cast<Function*>(::dlsym(handle, name));
}

}  // namespace

namespace moevement::models::cuda {

std::string open_cublaslt() {
  return cublaslt().error;
}

}  // namespace moevement::models::cuda

// Defines `name` (declared by cublasLt.h) as a call of the library's own `name`.
#define MOEVEMENT_CUBLASLT(name, params, args)                          \
  cublasStatus_t CUBLASWINAPI name params {                             \
    static auto* const real = cublaslt_symbol<decltype(::name)>(#name); \
    return real == nullptr ? CUBLAS_STATUS_NOT_INITIALIZED : real args; \
  }

extern "C" {

MOEVEMENT_CUBLASLT(cublasLtCreate, (cublasLtHandle_t * handle), (handle))
MOEVEMENT_CUBLASLT(cublasLtDestroy, (cublasLtHandle_t handle), (handle))
MOEVEMENT_CUBLASLT(cublasLtMatmul,
                   (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                    const void* a, cublasLtMatrixLayout_t a_desc, const void* b,
                    cublasLtMatrixLayout_t b_desc, const void* beta, const void* c,
                    cublasLtMatrixLayout_t c_desc, void* d, cublasLtMatrixLayout_t d_desc,
                    const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream),
                   (handle, desc, alpha, a, a_desc, b, b_desc, beta, c, c_desc, d, d_desc, algo,
                    workspace, workspace_bytes, stream))
MOEVEMENT_CUBLASLT(cublasLtMatmulAlgoGetHeuristic,
                   (cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                    cublasLtMatrixLayout_t a_desc, cublasLtMatrixLayout_t b_desc,
                    cublasLtMatrixLayout_t c_desc, cublasLtMatrixLayout_t d_desc,
                    cublasLtMatmulPreference_t preference, int requested,
                    cublasLtMatmulHeuristicResult_t results[], int* returned),
                   (handle, desc, a_desc, b_desc, c_desc, d_desc, preference, requested, results,
                    returned))
MOEVEMENT_CUBLASLT(cublasLtMatmulDescCreate,
                   (cublasLtMatmulDesc_t * desc, cublasComputeType_t compute, cudaDataType_t scale),
                   (desc, compute, scale))
MOEVEMENT_CUBLASLT(cublasLtMatmulDescDestroy, (cublasLtMatmulDesc_t desc), (desc))
MOEVEMENT_CUBLASLT(cublasLtMatmulDescSetAttribute,
                   (cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const void* buf,
                    size_t bytes),
                   (desc, attr, buf, bytes))
MOEVEMENT_CUBLASLT(cublasLtMatmulPreferenceCreate, (cublasLtMatmulPreference_t * pref), (pref))
MOEVEMENT_CUBLASLT(cublasLtMatmulPreferenceDestroy, (cublasLtMatmulPreference_t pref), (pref))
MOEVEMENT_CUBLASLT(cublasLtMatmulPreferenceSetAttribute,
                   (cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                    const void* buf, size_t bytes),
                   (pref, attr, buf, bytes))
MOEVEMENT_CUBLASLT(cublasLtMatrixLayoutCreate,
                   (cublasLtMatrixLayout_t * layout, cudaDataType type, uint64_t rows,
                    uint64_t cols, int64_t ld),
                   (layout, type, rows, cols, ld))
MOEVEMENT_CUBLASLT(cublasLtMatrixLayoutDestroy, (cublasLtMatrixLayout_t layout), (layout))
MOEVEMENT_CUBLASLT(cublasLtMatrixLayoutSetAttribute,
                   (cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                    const void* buf, size_t bytes),
                   (layout, attr, buf, bytes))

}  // extern "C"
