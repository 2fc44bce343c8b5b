// Batch-1 FP8 W8A8 GEMV on the CUDA cores, in CUDA C (compiled by NVRTC, kernels/cuda_rtc.py;
// compute capability 8.9+ for the e4m3 conversion). The same function and rounding as
// gemv_fp8.cu (the tensor-core version), laid out like gemv_w4.cu:
//
// y[n] = round(round(sum_k xq[k] * w[n, k] * x_scale * w_scale[n]) + bias[n]), for e4m3
// weights w [N, K] (row stride in bytes), one fp32 scale per row, and the activation row
// already quantized per token (xq: e4m3 values held in bf16/fp16, x_scale: fp32 [1]).
//
// Shape of the work: a block of THREADS = K/16 threads (rounded up to a warp) owns ROWS output
// rows; thread t handles the 16 codes k = 16t..16t+15 of every one of them (one 16-byte load
// per row), so a warp reads 512 contiguous bytes of a row per load and no thread loops over K.
// Every weight load (and the row scales) is issued before the programmatic-dependent-launch
// wait. A pair of codes becomes two fp16 values in one cvt (e4m3 is a subset of fp16), each
// then fp32; the products of two e4m3 values are exact in fp32 and add up in fp32, so the
// result is fp8_gemv_ref's up to summation order. The Hopper tensor-core path (gemv_fp8.cu)
// measured slower: ptxas lowers its e4m3 mma to fp16 HMMA on sm_90.
//
// Macros: THREADS, ROWS, X_BF16 (x, bias, y bf16; else fp16), HAS_BIAS, SILU_OUT (a [gate; up]
// layer, N = 2I: the block's rows interleave gate row j and up row j, ROWS even, and it writes
// silu(gate) * up).

#include "common.cuh"

#define NWARPS ((THREADS + 31) / 32)

// e4m3 codes c0 (low byte) and c1 of a 16-bit value as two floats
__device__ __forceinline__ void e4m3x2_to_float(u16 v, float& f0, float& f1) {
  u32 h;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f0) : "h"((u16)(h & 0xFFFFu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f1) : "h"((u16)(h >> 16)));
}

// sum over the 16 codes of one 16-byte load of code * x (x in k order)
__device__ __forceinline__ float dot16(uint4 w, const float* x) {
  const u32 words[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    float a, b, c, d;
    e4m3x2_to_float((u16)(words[q] & 0xFFFFu), a, b);
    e4m3x2_to_float((u16)(words[q] >> 16), c, d);
    s = fmaf(a, x[4 * q], s);
    s = fmaf(b, x[4 * q + 1], s);
    s = fmaf(c, x[4 * q + 2], s);
    s = fmaf(d, x[4 * q + 3], s);
  }
  return s;
}

extern "C" __global__ void __launch_bounds__(THREADS)
gemv_fp8_cc(const u16* __restrict__ Xq, const float* __restrict__ XScale,
            const u8* __restrict__ W, const float* __restrict__ WScale,
            const u16* __restrict__ Bias, u16* __restrict__ Y, int N, int K,
            long long stride_w,
            const void* __restrict__ Prefetch0, long long prefetch_bytes0,
            const void* __restrict__ Prefetch1, long long prefetch_bytes1, int prefetch_tail) {
  const int c = threadIdx.x;  // this thread's 16 codes: k = 16c..16c+15
  const bool ok = c < (K >> 4);
  // 1. Weights and their scales: nothing another kernel writes.
  uint4 w[ROWS];
  float ws[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const long long row = block_row(r, N, ROWS, SILU_OUT);
    w[r] = ok ? load_weights(W + row * stride_w + 16 * c) : make_uint4(0, 0, 0, 0);
    ws[r] = __ldg(WScale + row);
  }
  // 2. The activation row and its scale, written by the previous kernel.
  // a later GEMV's weights and scales into L2 (common.cuh; none: 0 bytes)
  l2_prefetch_share(Prefetch0, prefetch_bytes0, prefetch_tail);
  l2_prefetch_share(Prefetch1, prefetch_bytes1, prefetch_tail);
  pdl_wait();
  const float x_scale = __ldg(XScale);
  float xv[16];
  if (ok) {
    const uint4 v[2] = {load_act16(Xq + 16 * c), load_act16(Xq + 16 * c + 8)};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const u32 u[4] = {v[h].x, v[h].y, v[h].z, v[h].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        xv[8 * h + 2 * e] = act_to_float((u16)(u[e] & 0xFFFFu));
        xv[8 * h + 2 * e + 1] = act_to_float((u16)(u[e] >> 16));
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) xv[i] = 0.f;
  }
  pdl_launch_dependents();
  // 3. Products, then each row reduced over the block.
  __shared__ float partial[NWARPS][ROWS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float v = warp_sum(dot16(w[r], xv));
    if (lane == 0) partial[warp][r] = v;
  }
  __syncthreads();
  // the row scale of output row r, from registers every thread holds (no dynamic indexing)
#if SILU_OUT
  const int j = blockIdx.x * (ROWS / 2) + threadIdx.x;
  if (threadIdx.x < ROWS / 2 && j < (N >> 1)) {
    float gs = 0.f, us = 0.f, gsc = 0.f, usc = 0.f;
#pragma unroll
    for (int i = 0; i < NWARPS; ++i) {
      gs += partial[i][2 * threadIdx.x];
      us += partial[i][2 * threadIdx.x + 1];
    }
#pragma unroll
    for (int r = 0; r < ROWS; r += 2) {
      if (r == 2 * (int)threadIdx.x) {
        gsc = ws[r];
        usc = ws[r + 1];
      }
    }
    float gv = round_act(gs * x_scale * gsc);
    float uv = round_act(us * x_scale * usc);
#if HAS_BIAS
    gv = round_act(gv + act_to_float(__ldg(Bias + j)));
    uv = round_act(uv + act_to_float(__ldg(Bias + j + (N >> 1))));
#endif
    Y[j] = float_to_act(silu_mul(gv, uv));
  }
#else
  const int row = blockIdx.x * ROWS + threadIdx.x;
  if (threadIdx.x < ROWS && row < N) {
    float s = 0.f, sc = 0.f;
#pragma unroll
    for (int i = 0; i < NWARPS; ++i) s += partial[i][threadIdx.x];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (r == (int)threadIdx.x) sc = ws[r];
    float y = round_act(s * x_scale * sc);
#if HAS_BIAS
    y += act_to_float(__ldg(Bias + row));  // the bias after the cast, as fp8_linear
#endif
    Y[row] = float_to_act(y);
  }
#endif
}
