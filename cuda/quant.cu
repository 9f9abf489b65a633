// 4-bit asymmetric group quantisation (FlexGen's scheme): per group of `group` consecutive
// elements along one dim, x ~= code * scale + min with code in [0, 15], two codes per byte.
// The tensor is viewed as (outer, length, inner) and grouped along length, so any dim works
// without a transpose; a short last group is padded by repeating the last element.
#include <math.h>

#include "common.cuh"

namespace {

constexpr int kQuantThreads = 256;

__device__ __forceinline__ uint32_t code_of(float x, float mn, float step) {
  if (!(step > 0.f)) return 0;                      // a constant group: every code is 0
  return (uint32_t)fminf(fmaxf(rintf((x - mn) / step), 0.f), 15.f);
}

// One thread per (outer, group, inner) column: consecutive threads walk consecutive inner
// indices, so loads coalesce whenever inner > 1.
template <typename T>
__global__ void quantize_kernel(const T* x, int64_t outer, int64_t length, int64_t inner,
                                int64_t group, uint8_t* packed, T* mins, T* scales) {
  const int64_t groups = (length + group - 1) / group;
  const int64_t id = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (id >= outer * groups * inner) return;
  const int64_t o = id / (groups * inner), gi = id / inner % groups, in = id % inner;
  const T* col = x + o * length * inner + in;
  const int64_t l0 = gi * group, l1 = min(l0 + group, length);
  // NaN propagates, as in torch's amin/amax (fminf/fmaxf would skip it): a group holding a
  // NaN gets a NaN min and scale, and dequantizes to NaN, never to plausible numbers
  float mn = INFINITY, mx = -INFINITY;
  for (int64_t l = l0; l < l1; ++l) {
    const float val = fe::to_f(col[l * inner]);
    if (isnan(val)) {
      mn = mx = val;
      break;
    }
    mn = fminf(mn, val);
    mx = fmaxf(mx, val);
  }
  const T scale = fe::from_f<T>((mx - mn) / 15.f);
  const float step = fe::to_f(scale);
  mins[id] = fe::from_f<T>(mn);
  scales[id] = scale;
  const int64_t half = groups * group / 2;
  uint8_t* out = packed + o * half * inner + in;
  for (int64_t l = l0; l < l0 + group; l += 2) {
    const float lo = fe::to_f(col[min(l, length - 1) * inner]);
    const float hi = fe::to_f(col[min(l + 1, length - 1) * inner]);
    out[(l / 2) * inner] = (uint8_t)(code_of(lo, mn, step) | (code_of(hi, mn, step) << 4));
  }
}

// One thread per packed byte (two output elements).
template <typename T>
__global__ void dequantize_kernel(const uint8_t* packed, const T* mins, const T* scales,
                                  int64_t outer, int64_t length, int64_t inner, int64_t group,
                                  T* out) {
  const int64_t groups = (length + group - 1) / group, half = groups * group / 2;
  const int64_t id = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (id >= outer * half * inner) return;
  const int64_t o = id / (half * inner), l2 = id / inner % half, in = id % inner;
  const int64_t at = (o * groups + 2 * l2 / group) * inner + in;
  const float mn = fe::to_f(mins[at]), step = fe::to_f(scales[at]);
  const uint32_t byte = packed[id];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t l = 2 * l2 + h;
    const float code = (float)((byte >> (4 * h)) & 15u);
    // no fused multiply-add: the reference rounds the product before the sum
    if (l < length)
      out[(o * length + l) * inner + in] = fe::from_f<T>(__fadd_rn(__fmul_rn(code, step), mn));
  }
}

unsigned blocks_for(int64_t threads) {
  return (unsigned)((threads + kQuantThreads - 1) / kQuantThreads);
}

}  // namespace

extern "C" const char* fe_quantize_4bit(int dtype, const void* x, int64_t outer, int64_t length,
                                        int64_t inner, int64_t group, uint8_t* packed, void* mins,
                                        void* scales, cudaStream_t stream) {
  if (group < 2 || group % 2) return "flexevict: the quantisation group must be even";
  const int64_t columns = outer * ((length + group - 1) / group) * inner;
  if (columns == 0) return nullptr;
  FE_DISPATCH_DTYPE(dtype, T,
      quantize_kernel<T><<<blocks_for(columns), kQuantThreads, 0, stream>>>(
          static_cast<const T*>(x), outer, length, inner, group, packed, static_cast<T*>(mins),
          static_cast<T*>(scales)));
  return fe::launch_status();
}

extern "C" const char* fe_dequantize_4bit(int dtype, const uint8_t* packed, const void* mins,
                                          const void* scales, int64_t outer, int64_t length,
                                          int64_t inner, int64_t group, void* out,
                                          cudaStream_t stream) {
  if (group < 2 || group % 2) return "flexevict: the quantisation group must be even";
  const int64_t bytes = outer * ((length + group - 1) / group) * group / 2 * inner;
  if (bytes == 0) return nullptr;
  FE_DISPATCH_DTYPE(dtype, T,
      dequantize_kernel<T><<<blocks_for(bytes), kQuantThreads, 0, stream>>>(
          packed, static_cast<const T*>(mins), static_cast<const T*>(scales), outer, length,
          inner, group, static_cast<T*>(out)));
  return fe::launch_status();
}
