// Device helpers shared by the kernels: dtype conversion, warp reductions, launch checks.
// CUDA headers only (no torch), so every .cu compiles with a bare nvcc.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "flexevict_kernels.h"

namespace fe {

constexpr int kWarp = 32;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// x rounded to T and back: reproduces the reference's intermediate rounding (a matmul in T).
template <typename T> __device__ __forceinline__ float round_to(float x) {
  return to_f(from_f<T>(x));
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

__device__ __forceinline__ int warp_sum_int(int x) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) x += __shfl_xor_sync(kFull, x, o);
  return x;
}

// Exclusive prefix sum over the block of one int per thread (blockDim.x a multiple of 32,
// at most 1024); `total` receives the block sum. Uses 33 ints of shared scratch; all threads
// must call it.
__device__ __forceinline__ int block_exclusive_scan(int x, int* scratch, int* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  int incl = x;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    int y = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == kWarp - 1) scratch[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? scratch[lane] : 0;
    int wincl = w;
#pragma unroll
    for (int o = 1; o < kWarp; o <<= 1) {
      int y = __shfl_up_sync(kFull, wincl, o);
      if (lane >= o) wincl += y;
    }
    if (lane < warps) scratch[lane] = wincl - w;    // exclusive offset of each warp
    if (lane == warps - 1) scratch[kWarp] = wincl;
  }
  __syncthreads();
  int result = scratch[warp] + incl - x;
  *total = scratch[kWarp];
  __syncthreads();                                  // scratch may be reused right after
  return result;
}

inline const char* launch_status() {
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace fe

// Run `body` with T bound to the C++ type of a FeDtype code.
#define FE_DISPATCH_DTYPE(code, T, ...)                          \
  switch (code) {                                                \
    case FE_F32: { using T = float; __VA_ARGS__; break; }        \
    case FE_F16: { using T = __half; __VA_ARGS__; break; }       \
    case FE_BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; } \
    default: return "flexevict: unsupported dtype code";         \
  }
