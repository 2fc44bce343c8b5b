// Batch-1 W4A16 GEMV in CUDA C: y[n] = sum_k x[k] * (code[n, k] - zero[n, g]) * scale[n, g]
// (+ bias[n]). Compiled at run time by NVRTC (kernels/cuda_rtc.py); includes common.cuh.
//
// Weight layout of kernels/gemm.py BITS=4: int32 [N, K/8], word w of a row holds the codes of
// k = 8w..8w+7, lowest nibble first. A "chunk" is 16 bytes = 4 words = 32 consecutive codes.
//
// Shape of the work: a block of THREADS threads owns ROWS consecutive output rows; thread t
// handles chunks t, t + THREADS, ... (CHUNKS of them) of every one of those rows, so a
// warp reads 512 contiguous bytes of a row per load and no thread loops over K. Every weight
// load of the thread (ROWS x CHUNKS x 16 bytes, plus its scales and zeros) is issued first,
// before the programmatic-dependent-launch wait: weights are read-only during a decode step,
// so they stream in while the previous kernel finishes, and the whole matrix is in flight at
// once instead of in a chain of dependent K iterations. Then x (written by the previous
// kernel) is read, the dependent kernel released, the products summed, and the block reduces
// each row's partial sums (warp shuffles, then shared memory across warps).
//
// Dequantization costs a LOP3, an FADD and an FFMA per weight, as in kernels/gemv_w4.py: the
// nibble at bits 4p..4p+3 of a word OR-ed into the bit pattern of 2^(23-4p) is the float
// 2^(23-4p) + code; subtracting 2^(23-4p) + zero leaves code - zero exactly; nibbles 5..7 come
// from the word shifted right by 16. The 32 products of a chunk add up in fp32 and the
// group's scale multiplies their sum (a chunk lies in one group: group sizes are multiples of
// 32). Only the fp32 summation order differs from dequantize-then-matmul.
//
// Compile-time macros: THREADS (the block size; registers are budgeted for it), ROWS,
// CHUNKS, X_BF16 (1: x, bias and y are bf16; 0: fp16),
// SCALE_KIND (0 bf16, 1 fp16, 2 fp32), HAS_ZEROS (uint8 zeros [N, G]; else zero point 8),
// HAS_BIAS, MATH (0: magic-number dequantization; 1: codes as subnormals, below), and the
// fused decode variants of kernels/gemv_w4.py: PROLOGUE 1 (the input is RMSNorm(x) * NormW,
// with `eps`; the block's threads hold the whole row, so the mean square is one block sum),
// PROLOGUE 2 (x is [gate | up], 2K wide; the input is silu(gate) * up), RESIDUAL (Y holds
// the residual stream and gets the product added in place), SILU_OUT (a [gate; up] layer
// whose output is silu(gate) * up, N / 2 wide; ROWS even), and ROPE (a fused qkv layer of
// one decode token: rotary embedding and the paged K/V cache write in the epilogue, below).

#include "common.cuh"

#define NWARPS ((THREADS + 31) / 32)

// (nibble p of src) - zero, exact: magic[p] is the bit pattern of 2^(23-4p), off[p] is
// 2^(23-4p) + zero. The magic patterns come in as a kernel argument: as compile-time
// constants ptxas splits the AND-OR into two LOP3s (one immediate per LOP3).
__device__ __forceinline__ float nib(u32 src, int p, const u32* magic, const float* off) {
  return __uint_as_float((src & (0xFu << (4 * p))) | magic[p]) - off[p];
}

// sum over the word's 8 codes of x[i] * (code_i - zero)
__device__ __forceinline__ float word_dot(u32 w, const float* x, const u32* magic,
                                          const float* off) {
  const u32 hi = w >> 16;
  float s = nib(w, 0, magic, off) * x[0];
  s = fmaf(nib(w, 1, magic, off), x[1], s);
  s = fmaf(nib(w, 2, magic, off), x[2], s);
  s = fmaf(nib(w, 3, magic, off), x[3], s);
  s = fmaf(nib(w, 4, magic, off), x[4], s);
  s = fmaf(nib(hi, 1, magic, off), x[5], s);
  s = fmaf(nib(hi, 2, magic, off), x[6], s);
  s = fmaf(nib(hi, 3, magic, off), x[7], s);
  return s;
}

// 32 activations (64 bytes, 16-byte aligned) as floats
__device__ __forceinline__ void unpack_chunk(const uint4* v, float* out) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const u32 u[4] = {v[q].x, v[q].y, v[q].z, v[q].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      out[8 * q + 2 * e] = act_to_float((u16)(u[e] & 0xFFFFu));
      out[8 * q + 2 * e + 1] = act_to_float((u16)(u[e] >> 16));
    }
  }
}

// 32 activations written by an earlier kernel (common.cuh's load_act16)
__device__ __forceinline__ void load_chunk(const u16* p, float* out) {
  uint4 v[4];
  const uint4* vp = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int q = 0; q < 4; ++q) v[q] = load_act16(vp + q);
  unpack_chunk(v, out);
}

// The sum of v over the block, the same value in every thread (same order everywhere).
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float red[NWARPS];
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int i = 0; i < NWARPS; ++i) t += red[i];
  return t;
}

// MATH 1: a nibble masked in place (w & (0xF << 4p)) is, read as a float with a zero exponent
// field, the subnormal code * 2^(4p - 149), exact; multiplied by x * 2^(SUB_E - 4p) the FFMA's
// exact product is x * code * 2^(SUB_E - 149), the same scale for every nibble. So a weight
// costs a LOP3 (one immediate) and an FFMA; the zero point comes off once per chunk as
// zero * sum(x), with the cancellation of two fp32 sums of similar size (about 1e-7 relative,
// against bf16's 4e-3 rounding of the output). SUB_E = 96 keeps x * 2^96 finite for
// |x| < 2^32 and the products normal for |x * code| >= 2^-73.
#define SUB_E 96
#define SUB_UNSCALE 9007199254740992.f  // 2^(149 - SUB_E) = 2^53

__device__ __forceinline__ float sub_code(u32 src, int p) {
  return __uint_as_float(src & (0xFu << (4 * p)));
}

// sum over the word's 8 codes of xs[i] * code_i * 2^(4p - 149), xs pre-scaled
__device__ __forceinline__ float word_dot_sub(u32 w, const float* xs) {
  const u32 hi = w >> 16;
  float s = sub_code(w, 0) * xs[0];
  s = fmaf(sub_code(w, 1), xs[1], s);
  s = fmaf(sub_code(w, 2), xs[2], s);
  s = fmaf(sub_code(w, 3), xs[3], s);
  s = fmaf(sub_code(w, 4), xs[4], s);
  s = fmaf(sub_code(hi, 1), xs[5], s);
  s = fmaf(sub_code(hi, 2), xs[6], s);
  s = fmaf(sub_code(hi, 3), xs[7], s);
  return s;
}

// The weight row of the block's row r (common.cuh's block_row; SILU_OUT: gate row j, then up
// row j).
//
// ROPE: the layer is qkv, N = (num_q_heads + 2 num_kv_heads) * HEAD_DIM, and the block's rows
// pair element j of a head with element j + HEAD_DIM / 2 (the two halves rotate-half mixes),
// ROWS / 2 pairs a block, pair p = head * HEAD_DIM / 2 + j, so one thread rotates a pair.
__device__ __forceinline__ long long weight_row(int r, int N) {
#if ROPE
  const int p = min((int)blockIdx.x * (ROWS / 2) + r / 2, (N >> 1) - 1);
  const int h = p / (HEAD_DIM / 2), j = p - h * (HEAD_DIM / 2);
  return (long long)h * HEAD_DIM + j + (r & 1) * (HEAD_DIM / 2);
#else
  return block_row(r, N, ROWS, SILU_OUT);
#endif
}

// MIN_BLOCKS (0: none) asks ptxas for registers that let that many blocks share an SM: the
// grid's last wave is then fuller (or gone); every block loads all its weights at once, so
// a nearly empty last wave costs a whole load latency for a few rows.
#if MIN_BLOCKS > 0
#define GEMV_BOUNDS __launch_bounds__(THREADS, MIN_BLOCKS)
#else
#define GEMV_BOUNDS __launch_bounds__(THREADS)
#endif

extern "C" __global__ void GEMV_BOUNDS
gemv_w4(const u16* __restrict__ X, const uint4* __restrict__ W, const void* __restrict__ S,
        const u8* __restrict__ Z, const u16* __restrict__ Bias, u16* __restrict__ Y,
        int N, int K, int group, long long stride_w16, long long stride_s, long long stride_z,
        u32 magic0, const u16* __restrict__ NormW, float eps,
        const long long* __restrict__ Positions, const float* __restrict__ CosSin,
        long long stride_c, const long long* __restrict__ Slots, u16* __restrict__ KCache,
        u16* __restrict__ VCache, long long stride_cb, long long stride_cs,
        long long stride_ch, int block_size, int num_q_heads, int num_kv_heads,
        const void* __restrict__ Prefetch0, long long prefetch_bytes0,
        const void* __restrict__ Prefetch1, long long prefetch_bytes1, int prefetch_tail) {
  const int chunks = K >> 5;
  // magic0 = 0x4B000000, the bit pattern of 2^23
  const u32 magic[5] = {magic0, magic0 - (4u << 23), magic0 - (8u << 23), magic0 - (12u << 23),
                        magic0 - (16u << 23)};
  (void)magic;  // MATH 0 only
  const int row0 = blockIdx.x * ROWS;  // (SILU_OUT: row0 / 2 is the first output)
  uint4 w[ROWS][CHUNKS];
  float scale[ROWS][CHUNKS];
#if HAS_ZEROS
  float zero[ROWS][CHUNKS];
#endif
  // 1. Weights, scales, zeros: nothing another kernel writes.
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int c = threadIdx.x + j * THREADS;
    const bool ok = c < chunks;
    const int cc = ok ? c : 0;
    const int g = (cc << 5) / group;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const long long row = weight_row(r, N);
      w[r][j] = ok ? load_weights(W + row * stride_w16 + cc) : make_uint4(0, 0, 0, 0);
      scale[r][j] = load_scale(S, row * stride_s + g);
#if HAS_ZEROS
      zero[r][j] = (float)__ldg(Z + row * stride_z + g);
#endif
    }
  }
#if PROLOGUE == 1
  uint4 nw[CHUNKS][4];  // the RMSNorm weight of the thread's columns: read-only too
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int c = threadIdx.x + j * THREADS;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      nw[j][q] = c < chunks ? __ldg(reinterpret_cast<const uint4*>(NormW) + 4 * c + q)
                            : make_uint4(0, 0, 0, 0);
  }
#endif
  // A later GEMV's weights and scales into L2 (common.cuh; none: 0 bytes), after this
  // thread's own loads are issued, so they queue behind them.
  l2_prefetch_share(Prefetch0, prefetch_bytes0, prefetch_tail);
  l2_prefetch_share(Prefetch1, prefetch_bytes1, prefetch_tail);
#if ROPE
  // The epilogue's inputs, loaded before the wait too, so its rope and cache write add no
  // dependent global loads to the step's critical path: cos/sin (constant), bias, and the
  // token's position and slot. Those two are written before the step's first kernel (the
  // graph's input copy, or a kernel of an earlier step); within a step they are never
  // written after it starts, and every kernel here releases its dependent only after its
  // own wait, so whatever ran two launches back (the norm before this GEMV is one) is
  // complete and visible when this kernel starts.
  float rope_c = 0.f, rope_s = 0.f, bias_a = 0.f, bias_b = 0.f;
  (void)bias_a;
  (void)bias_b;
  long long rope_slot = -1;
  if (threadIdx.x < ROWS / 2) {
    const int p = min((int)blockIdx.x * (ROWS / 2) + (int)threadIdx.x, (N >> 1) - 1);
    const int h = p / (HEAD_DIM / 2), j = p - h * (HEAD_DIM / 2);
    const float* cs = CosSin + Positions[0] * stride_c;  // plain loads: not constant data
    rope_c = round_act(__ldg(cs + j));
    rope_s = round_act(__ldg(cs + HEAD_DIM / 2 + j));
    rope_slot = Slots[0];
#if HAS_BIAS
    bias_a = act_to_float(__ldg(Bias + h * HEAD_DIM + j));
    bias_b = act_to_float(__ldg(Bias + h * HEAD_DIM + j + HEAD_DIM / 2));
#endif
  }
#endif
  // 2. The input, written by the previous kernel.
  pdl_wait();
  float xv[CHUNKS][32];
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int c = threadIdx.x + j * THREADS;
    if (c < chunks) {
      load_chunk(X + 32 * c, xv[j]);
#if PROLOGUE == 2
      // x = [gate | up], 2K wide: the input is silu(gate) * up, rounded as silu_and_mul
      float up[32];
      load_chunk(X + K + 32 * c, up);
#pragma unroll
      for (int i = 0; i < 32; ++i) xv[j][i] = silu_mul(xv[j][i], up[i]);
#endif
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) xv[j][i] = 0.f;
    }
  }
#if PROLOGUE == 1
  {
    // RMSNorm over the whole row: the block's threads hold all of it between them
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j)
#pragma unroll
      for (int i = 0; i < 32; ++i) ss = fmaf(xv[j][i], xv[j][i], ss);
    const float rstd = rsqrtf(block_sum(ss) / (float)K + eps);
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      float wn[32];
      unpack_chunk(nw[j], wn);
#pragma unroll
      for (int i = 0; i < 32; ++i) xv[j][i] = round_act(wn[i] * round_act(xv[j][i] * rstd));
    }
  }
#endif
  pdl_launch_dependents();
  // 3. Products: each chunk's 32 weights are x-major within its 4 words.
  float acc[ROWS];
#if MATH == 1
  // Codes as subnormal floats (see the header): x pre-scaled per nibble position, the sum of
  // x per chunk for the zero point; both once per chunk, shared by the block's rows.
  float sx[CHUNKS];
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) t += xv[j][i];
    sx[j] = t;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int n = i & 7;  // nibble n of its word; n >= 5 is read from the word >> 16
      xv[j][i] *= __uint_as_float((u32)(127 + SUB_E - 4 * (n < 5 ? n : n - 4)) << 23);
    }
  }
#endif
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = 0.f;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
#if HAS_ZEROS
      const float z = zero[r][j];
#else
      const float z = 8.f;
#endif
#if MATH == 1
      const float s0 = word_dot_sub(w[r][j].x, &xv[j][0]);
      const float s1 = word_dot_sub(w[r][j].y, &xv[j][8]);
      const float s2 = word_dot_sub(w[r][j].z, &xv[j][16]);
      const float s3 = word_dot_sub(w[r][j].w, &xv[j][24]);
      // sum x * code = 2^(149 - SUB_E) * (s0 + ... + s3); minus zero * sum x
      const float d = fmaf((s0 + s1) + (s2 + s3), SUB_UNSCALE, -z * sx[j]);
      acc[r] = fmaf(d, scale[r][j], acc[r]);
#else
      const float off[5] = {8388608.f + z, 524288.f + z, 32768.f + z, 2048.f + z, 128.f + z};
      const float s0 = word_dot(w[r][j].x, &xv[j][0], magic, off);
      const float s1 = word_dot(w[r][j].y, &xv[j][8], magic, off);
      const float s2 = word_dot(w[r][j].z, &xv[j][16], magic, off);
      const float s3 = word_dot(w[r][j].w, &xv[j][24], magic, off);
      acc[r] = fmaf((s0 + s1) + (s2 + s3), scale[r][j], acc[r]);
#endif
    }
  }
  // 4. Reduce each row over the block.
  __shared__ float partial[NWARPS][ROWS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0) partial[warp][r] = v;
  }
  __syncthreads();
#if SILU_OUT
  // out[j] = silu(gate_j) * up_j, each product rounded as the layer's output would be stored
  const int j = blockIdx.x * (ROWS / 2) + threadIdx.x;
  if (threadIdx.x < ROWS / 2 && j < (N >> 1)) {
    float g = 0.f, u = 0.f;
#pragma unroll
    for (int i = 0; i < NWARPS; ++i) {
      g += partial[i][2 * threadIdx.x];
      u += partial[i][2 * threadIdx.x + 1];
    }
#if HAS_BIAS
    g += act_to_float(__ldg(Bias + j));
    u += act_to_float(__ldg(Bias + j + (N >> 1)));
#endif
    Y[j] = float_to_act(silu_mul(round_act(g), round_act(u)));
  }
}
#elif ROPE
  // Pair p of head h: q heads are rotated into Y (the attention's q, [num_q_heads *
  // HEAD_DIM]); k heads rotated and v heads as they are go to the paged cache at the token's
  // slot (-1: a padding row, nothing written). Rounded as the unfused layers round: the
  // product (+ bias) once, then kernels/rotary.py's rope (cos/sin in the activation dtype,
  // every product and each sum rounded), then the cache's dtype, which is the activations'.
  const int half = HEAD_DIM / 2;
  const int p = blockIdx.x * (ROWS / 2) + threadIdx.x;
  if (threadIdx.x < ROWS / 2 && p < (N >> 1)) {
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int i = 0; i < NWARPS; ++i) {
      a += partial[i][2 * threadIdx.x];
      b += partial[i][2 * threadIdx.x + 1];
    }
    const int h = p / half, j = p - h * half;
    const int row = h * HEAD_DIM + j;
#if HAS_BIAS
    a += bias_a;
    b += bias_b;
#endif
    a = round_act(a);
    b = round_act(b);
    if (h < num_q_heads + num_kv_heads) {  // q or k: rotate
      const float c = rope_c, s = rope_s;
      const float o1 = round_act(round_act(a * c) - round_act(b * s));
      b = round_act(round_act(b * c) + round_act(a * s));
      a = o1;
    }
    if (h < num_q_heads) {
      Y[row] = float_to_act(a);
      Y[row + half] = float_to_act(b);
    } else {
      const long long slot = rope_slot;
      if (slot >= 0) {
        const bool is_k = h < num_q_heads + num_kv_heads;
        const int kvh = h - num_q_heads - (is_k ? 0 : num_kv_heads);
        u16* dst = (is_k ? KCache : VCache) + (slot / block_size) * stride_cb
                   + (slot % block_size) * stride_cs + kvh * stride_ch + j;
        dst[0] = float_to_act(a);
        dst[half] = float_to_act(b);
      }
    }
  }
}
#else
  if (threadIdx.x < ROWS && row0 + (int)threadIdx.x < N) {
    float y = 0.f;
#pragma unroll
    for (int i = 0; i < NWARPS; ++i) y += partial[i][threadIdx.x];
#if HAS_BIAS
    y += act_to_float(__ldg(Bias + row0 + threadIdx.x));  // one rounding, as gemv_w4.py
#endif
#if RESIDUAL
    // Y holds the residual stream: Y += product, rounded as the unfused layers round
    y = round_act(y) + act_to_float(__ldcg(Y + row0 + threadIdx.x));
#endif
    Y[row0 + threadIdx.x] = float_to_act(y);
  }
}
#endif
