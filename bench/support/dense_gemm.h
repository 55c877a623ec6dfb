// The practical ceiling beside the benchmarks' grouped kernels: one cuBLAS bf16 GEMM (fp32
// accumulation) of the same total size. Header-only so that only the programs that link cuBLAS
// (bench_grouped_gemm, bench_fused) see it; the moe-engine tool does not depend on cuBLAS.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "moe/error.h"

#define MOE_CUBLAS_CHECK(call)                                                          \
  do {                                                                                  \
    cublasStatus_t st_ = (call);                                                        \
    MOE_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "cuBLAS error ", int(st_), " in ", #call); \
  } while (0)

namespace moe::bench {

// A non-blocking stream and a cuBLAS handle that runs on it, for a benchmark's lifetime.
struct CublasOnStream {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  CublasOnStream() {
    MOE_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "cannot create a CUDA stream");
    MOE_CUBLAS_CHECK(cublasCreate(&blas));
    MOE_CUBLAS_CHECK(cublasSetStream(blas, stream));
  }
  ~CublasOnStream() {
    cublasDestroy(blas);
    cudaStreamDestroy(stream);
  }
  CublasOnStream(const CublasOnStream&) = delete;
  CublasOnStream& operator=(const CublasOnStream&) = delete;
};

// Row-major C[m, n] = op(A) op(B) in bf16 through cuBLAS (column-major), computed as C^T = op(B)^T
// op(A)^T. a_is_km: A stored [k, m] (its transpose is used) rather than [m, k]; b_is_nk: B stored
// [n, k] rather than [k, n].
inline void dense_gemm(cublasHandle_t h, const void* A, const void* B, void* C, int64_t m, int64_t n, int64_t k,
                       bool a_is_km, bool b_is_nk) {
  const float one = 1.0f, zero = 0.0f;
  const cublasOperation_t opB = b_is_nk ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int64_t ldb = b_is_nk ? k : n;
  const cublasOperation_t opA = a_is_km ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int64_t lda = a_is_km ? m : k;
  MOE_CUBLAS_CHECK(cublasGemmEx(h, opB, opA, int(n), int(m), int(k), &one, B, CUDA_R_16BF, int(ldb), A, CUDA_R_16BF,
                                int(lda), &zero, C, CUDA_R_16BF, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace moe::bench
