// Batch-1 FP8 W8A8 GEMV on the tensor cores, in CUDA C (compiled by NVRTC, kernels/cuda_rtc.py;
// compute capability 8.9+ for the e4m3 mma). Includes common.cuh.
//
// y[n] = round(round(sum_k xq[k] * w[n, k] * x_scale * w_scale[n]) + bias[n]), for e4m3 weights
// w [N, K] (row stride in bytes), one fp32 scale per row, and the activation row already
// quantized per token (xq: e4m3 values held in bf16/fp16, x_scale: fp32 [1], as
// kernels/gemv_fp8.quantize_row_fp8 or the RMSNorm kernel's FP8 output make them), rounded as
// quant/fp8_linear.fp8_linear's reference (the product cast to x's dtype, then the bias).
//
// Shape of the work: a block owns 8 * RG output rows and WARPS warps split K between them. In
// each warp, lane (g = lane / 4, t = lane % 4) loads 16 bytes of row g at k = k0 + 16 t + 64 i
// for i < LOADS, for each of the RG row groups: all of them before the programmatic dependent
// launch wait (weights are read-only during a step), so the block's whole share of the matrix
// is in flight at once. Each 16-byte load feeds two mma.m16n8k32 (e4m3 x e4m3 -> f32): its
// bytes 0-3 / 4-7 are the B fragment of the first (k rows 4t..4t+3 and 16+4t..16+4t+3 of
// the mma's k space), bytes 8-11 / 12-15 of the second. The dot product does not care which
// actual k an mma-k stands for as long as A uses the same one, so lanes 0-3 (A's row 0, the
// one activation row; rows 1-15 are zero) put x at the same actual k into a0 / a2. Each
// mma starts from zero and its result is added in fp32 on the CUDA cores (Hopper's FP8 mma
// accumulates with fewer mantissa bits than fp32; 32 exact products per mma, then fp32). Row
// 0 of D comes out in lanes 0-3: d0, d1 for n = 2t, 2t + 1. The warps' partial sums meet in
// shared memory.
//
// Macros: WARPS, LOADS (16-byte loads per lane and row group: K = 64 * WARPS * LOADS), RG,
// X_BF16 (x, bias, y bf16; else fp16), HAS_BIAS, SILU_OUT (a [gate; up] layer, N = 2I: the
// block's 8 * RG rows interleave gate row j and up row j, and it writes silu(gate) * up).

#include "common.cuh"

#define THREADS (WARPS * 32)
#define ROWS (8 * RG)

// four e4m3 codes (held exactly as bf16/fp16 values, two per word) packed into one word,
// lowest k in the lowest byte
__device__ __forceinline__ u32 pack_e4m3(u32 w01, u32 w23) {
  const float f0 = act_to_float((u16)(w01 & 0xFFFFu)), f1 = act_to_float((u16)(w01 >> 16));
  const float f2 = act_to_float((u16)(w23 & 0xFFFFu)), f3 = act_to_float((u16)(w23 >> 16));
  u16 lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(f1), "f"(f0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(f3), "f"(f2));
  return (u32)lo | ((u32)hi << 16);
}

// D = A * B for one m16n8k32 e4m3 tile, C = 0: returns row 0's two outputs of this lane
__device__ __forceinline__ void mma_e4m3(u32 a0, u32 a2, u32 b0, u32 b1, float& d0, float& d1) {
  float d2, d3;  // rows 8-15 of D: zero, unused
  const u32 zero = 0u;
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};"
      : "=f"(d0), "=f"(d1), "=f"(d2), "=f"(d3)
      : "r"(a0), "r"(zero), "r"(a2), "r"(zero), "r"(b0), "r"(b1), "f"(0.f));
}

extern "C" __global__ void __launch_bounds__(THREADS)
gemv_fp8(const u16* __restrict__ Xq, const float* __restrict__ XScale,
         const u8* __restrict__ W, const float* __restrict__ WScale,
         const u16* __restrict__ Bias, u16* __restrict__ Y, int N, int K, long long stride_w,
         const void* __restrict__ Prefetch0, long long prefetch_bytes0,
         const void* __restrict__ Prefetch1, long long prefetch_bytes1, int prefetch_tail) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int k0 = warp * (64 * LOADS) + 16 * t;  // this lane's first k
  // 1. Weights and their scales: nothing another kernel writes.
  uint4 w[RG][LOADS];
  float ws[RG];
#pragma unroll
  for (int rg = 0; rg < RG; ++rg) {
    const long long row = block_row(8 * rg + g, N, ROWS, SILU_OUT);
    const u8* wp = W + row * stride_w + k0;
#pragma unroll
    for (int i = 0; i < LOADS; ++i) w[rg][i] = load_weights(wp + 64 * i);
    ws[rg] = __ldg(WScale + row);
  }
  // a later GEMV's weights and scales into L2 (common.cuh; none: 0 bytes)
  l2_prefetch_share(Prefetch0, prefetch_bytes0, prefetch_tail);
  l2_prefetch_share(Prefetch1, prefetch_bytes1, prefetch_tail);
  // 2. The activation row, written by the previous kernel: lanes 0-3 hold A's row 0, the
  // others' A is zero. 3. Two mma per 16-byte load, each added into fp32.
  pdl_wait();
  const float x_scale = __ldg(XScale);
  float acc[RG][2];
#pragma unroll
  for (int rg = 0; rg < RG; ++rg) acc[rg][0] = acc[rg][1] = 0.f;
#pragma unroll
  for (int i = 0; i < LOADS; ++i) {
    u32 a0 = 0u, a1 = 0u, a2 = 0u, a3 = 0u;
    if (lane < 4) {
      const uint4 lo = load_act16(Xq + k0 + 64 * i), hi = load_act16(Xq + k0 + 64 * i + 8);
      a0 = pack_e4m3(lo.x, lo.y);
      a1 = pack_e4m3(lo.z, lo.w);
      a2 = pack_e4m3(hi.x, hi.y);
      a3 = pack_e4m3(hi.z, hi.w);
    }
    if (i == 0) pdl_launch_dependents();
#pragma unroll
    for (int rg = 0; rg < RG; ++rg) {
      float d0, d1;
      mma_e4m3(a0, a1, w[rg][i].x, w[rg][i].y, d0, d1);
      acc[rg][0] += d0;
      acc[rg][1] += d1;
      mma_e4m3(a2, a3, w[rg][i].z, w[rg][i].w, d0, d1);
      acc[rg][0] += d0;
      acc[rg][1] += d1;
    }
  }
  // 4. Row r = 8 rg + n of the block: lane t < 4 of each warp holds n = 2t, 2t + 1.
  __shared__ float partial[WARPS][ROWS];
  if (lane < 4) {
#pragma unroll
    for (int rg = 0; rg < RG; ++rg) {
      partial[warp][8 * rg + 2 * t] = acc[rg][0];
      partial[warp][8 * rg + 2 * t + 1] = acc[rg][1];
    }
  }
  __syncthreads();
  // the row scale of row r: the lane with g = r % 8 loaded it
  __shared__ float scale_of[ROWS];
  if (t == 0) {
#pragma unroll
    for (int rg = 0; rg < RG; ++rg) scale_of[8 * rg + g] = ws[rg];
  }
  __syncthreads();
#if SILU_OUT
  const int j = blockIdx.x * (ROWS / 2) + threadIdx.x;
  if (threadIdx.x < ROWS / 2 && j < (N >> 1)) {
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      gs += partial[i][2 * threadIdx.x];
      us += partial[i][2 * threadIdx.x + 1];
    }
    float gv = round_act(gs * x_scale * scale_of[2 * threadIdx.x]);
    float uv = round_act(us * x_scale * scale_of[2 * threadIdx.x + 1]);
#if HAS_BIAS
    gv = round_act(gv + act_to_float(__ldg(Bias + j)));
    uv = round_act(uv + act_to_float(__ldg(Bias + j + (N >> 1))));
#endif
    Y[j] = float_to_act(silu_mul(gv, uv));
  }
#else
  const int row = blockIdx.x * ROWS + threadIdx.x;
  if (threadIdx.x < ROWS && row < N) {
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) s += partial[i][threadIdx.x];
    float y = round_act(s * x_scale * scale_of[threadIdx.x]);
#if HAS_BIAS
    y += act_to_float(__ldg(Bias + row));  // the bias after the cast, as fp8_linear
#endif
    Y[row] = float_to_act(y);
  }
#endif
}
