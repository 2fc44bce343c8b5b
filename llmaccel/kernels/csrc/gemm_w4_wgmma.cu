// W4A16 GEMM on Hopper's warpgroup MMA (wgmma), for prefill-sized row counts:
// y[m, n] = sum_k x[m, k] * round16((code[n, k] - zero[n, g]) * scale[n, g]) (+ bias[n]).
// Compiled at run time by NVRTC for sm_90a (kernels/gemm_w4_wgmma.py); includes common.cuh and
// wgmma_inst.cuh, which the host generates for the tile's wgmma width (BM).
//
// Why a second GEMM: mma.sync (csrc/gemm_w4.cu) tops out near 200-260 TFLOP/s at 128 rows because
// every m16n8k16 needs 6-10 other instructions (dequantization, fragment shuffles, addressing) and
// the SM can issue only a few per mma; cuBLAS on bf16 weights is twice as fast there. A wgmma
// m64nBMk16 does 64 x BM x 16 multiply-adds per instruction, so the same dequantization work is a
// small share of the issue slots and the tensor cores, not the issue, set the pace.
//
// Roles are swapped (as vLLM's Machete does): the weights are wgmma's A operand, dequantized into
// registers, and the activations its B operand, read from shared memory by the tensor cores;
// the warpgroup computes y^T for its 64 weight rows x the block's BM activation rows.
//
// Work: a block of WGS warpgroups owns BN = 64 WGS output columns (weight rows) x BM rows of x;
// warpgroup w takes weight rows 64w..64w+63 against the block's one x tile. K goes in stages of
// 64; STAGES of them in flight through cp.async (x, codes, and the words holding the stage's
// scales and zeros), the codes before the programmatic-dependent-launch wait, x after it.
//
// x in shared memory: per stage BM rows x BK values, in 64-k column blocks of BM x 128 bytes in
// the 128-byte swizzle wgmma reads K-major operands in (16-byte chunk c of row r at chunk
// c ^ (r & 7), 8-row atoms of 1024 bytes); the descriptor steps 32 bytes a k16 step.
//
// A fragments: the wgmma register layout is mma.sync's m16n8k16 A per warp: lane (g, t) of warp
// q holds rows 16q + g and 16q + g + 8 at k = 2t, 2t + 1 and 2t + 8, 2t + 9 of the k16 step. In
// the GPTQ word layout (int32 [N, K/8], word w holds k = 8w..8w+7, lowest nibble first) that
// pair is byte t of a word: low nibble k = 2t, high nibble k = 2t + 1. `pair` turns it into the
// reference's 16-bit weights ((code - zero) * scale rounded once, gemm.linear_ref), so only the
// fp32 summation order differs from the reference.
//
// Macros: BM (x rows a block, the wgmma N: a multiple of 8, at most 256), WGS (warpgroups a
// block), STAGES, KSTEPS (k16 steps a stage, 4, 8 or 16: BK = 64, 128 or 256), ACC
// (accumulator sets the k16 steps rotate over), SPLITK (K in that many parts, added by each
// tile's last block), X_BF16, SCALE_KIND (0 bf16, 1 fp16, 2 fp32), HAS_ZEROS (uint8 zeros
// [N, G]; else zero point 8), HAS_BIAS, GROUP_STAGES (group / BK; 0: one scale per row for the
// whole K), PROXY_FENCE, DIAG (timing experiments).
// Contract (gemm_w4_wgmma.supports): K % BK == 0, N % 8 == 0, 16-byte aligned rows.

#include "common.cuh"
#include "wgmma_inst.cuh"

#ifndef SPLITK
#define SPLITK 1
#endif
#ifndef ACC
#define ACC 1  // accumulator sets (1, 2 or 4)
#endif
#ifndef DIAG
#define DIAG 0  // timing experiments only, wrong results: 1 no dequantization, 2 no x loads
                // in the loop, 4 no wgmma, 8 no barrier
#endif
#ifndef PROXY_FENCE
#define PROXY_FENCE 1  // fence.proxy.async between the cp.async writes and the wgmma reads
#endif

#ifndef KSTEPS
#define KSTEPS 4  // k16 steps a stage: BK = 16 KSTEPS = 64, 128 or 256
#endif
#define BK (16 * KSTEPS)
#define ATOMS (KSTEPS / 4)  // 64-k column blocks of the x tile, BM x 128 bytes each
#define THREADS (128 * WGS)
#define BN (64 * WGS)
#define X_STAGE_BYTES (BM * 128 * ATOMS)  // a multiple of 1024: every x atom is aligned
#define W_STAGE_BYTES (BN * BK / 2)
#define S_STAGE_BYTES (GROUP_STAGES > 0 ? BN * 4 : 0)
#define Z_STAGE_BYTES (GROUP_STAGES > 0 && HAS_ZEROS ? BN * 4 : 0)
// rounded up to whole 1024-byte atoms, so every stage's x tile starts on one
#define STAGE_BYTES \
  ((X_STAGE_BYTES + W_STAGE_BYTES + S_STAGE_BYTES + Z_STAGE_BYTES + 1023) / 1024 * 1024)

#if SCALE_KIND == 2
#define S_ESZ 4
#else
#define S_ESZ 2
#endif
// the fast dequantization where the scales already are in the activation dtype
#define SCALE_NATIVE ((SCALE_KIND == 0 && X_BF16) || (SCALE_KIND == 1 && !X_BF16))
#ifndef SCALE_SPLIT
#define SCALE_SPLIT 1  // other scales: as a sum of two activation-dtype values (see `pair`)
#endif

#if X_BF16
#define MAGIC2 0x43004300u  // bf16 128.0 in both halves
#define ONE2 0x3F803F80u
#define MAGIC_F 128.f
#else
#define MAGIC2 0x64006400u  // fp16 1024.0
#define ONE2 0x3C003C00u
#define MAGIC_F 1024.f
#endif

// This thread's completed shared-memory writes, ordered before later async-proxy reads (wgmma)
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait1() {
  asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
}

__device__ __forceinline__ u32 mul2(u32 a, u32 b) {
  u32 d;
#if X_BF16
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#endif
  return d;
}

// -(magic + zero) in both halves: the FMA's addend
__device__ __forceinline__ u32 neg_offset2(float zero) {
  const u16 h = float_to_act(MAGIC_F + zero);
  return (((u32)h << 16) | h) ^ 0x80008000u;
}

// A weight row's dequantization inputs for one group. SCALE_NATIVE (scales in the activation
// dtype): the 16-bit -(magic + zero) and scale pairs. Otherwise (fp32 scales, or fp16 scales
// with bf16 activations): fp32 offsets 2^23 + zero and 2^23 + 16 zero and the scale, and the
// scale / 16 for the high nibble, which is read in place (16 x its code).
struct RowDeq {
#if SCALE_NATIVE
  u32 negoff, scale2;
#elif SCALE_SPLIT
  u32 negoff, hi2, lo2;
#else
  float off_lo, off_hi, s, s16;
#endif
};

__device__ __forceinline__ RowDeq row_deq(float scale, float zero) {
  RowDeq r;
#if SCALE_NATIVE
  r.negoff = neg_offset2(zero);
  const u32 bits = float_to_act(scale);  // exact: the scale is in the activation dtype
  r.scale2 = bits | (bits << 16);
#elif SCALE_SPLIT
  r.negoff = neg_offset2(zero);
  const u16 hi = float_to_act(scale), lo = float_to_act(scale - act_to_float(hi));
  r.hi2 = ((u32)hi << 16) | hi;
  r.lo2 = ((u32)lo << 16) | lo;
#else
  r.off_lo = 8388608.f + zero;
  r.off_hi = 8388608.f + 16.f * zero;
  r.s = scale;
  r.s16 = scale * 0.0625f;
#endif
  return r;
}

// The dequantized 16-bit pair (k = 2t, 2t + 1) from byte t of word w, rounded as the reference
// rounds its weight: sel_t moves byte t to the bottom with zeros above. SCALE_NATIVE: a multiply
// by 0x1001 copies the byte 12 bits up (the high nibble lands at bits 16-19), a LOP3 masks both
// nibbles into the mantissas of the 16-bit magic (in a register: a LOP3 takes one immediate),
// one packed FMA subtracts magic + zero exactly and one packed multiply applies the scale.
// SCALE_SPLIT (scales in fp32, or fp16 with bf16 activations): the scale as hi + lo, both in
// the activation dtype (exact for fp16 scales with bf16: 8 + 8 bits of mantissa hold fp16's
// 11), and the weight (code - zero) * hi + round16((code - zero) * lo) in one packed FMA after
// one packed multiply: the reference's weight except where rounding the small second product
// moves the sum across a rounding boundary (1 ulp, rarely). Otherwise (SCALE_SPLIT 0) each
// nibble becomes 2^23 + code (high: + 16 code) in fp32, minus the offset (exact), times the
// scale in fp32 (the reference's product), both rounded to 16 bits by one packing cvt: exact,
// two instructions a pair more.
__device__ __forceinline__ u32 pair(u32 w, u32 sel_t, u32 magic, const RowDeq& r) {
#if SCALE_NATIVE
  const u32 b = prmt(w, 0u, sel_t) * 0x1001u;
  const u32 q = (b & 0x000F000Fu) | magic;
  return mul2(fma2(q, ONE2, r.negoff), r.scale2);
#elif SCALE_SPLIT
  const u32 b = prmt(w, 0u, sel_t) * 0x1001u;
  const u32 d = fma2((b & 0x000F000Fu) | magic, ONE2, r.negoff);  // code - zero, exact
  return fma2(d, r.hi2, mul2(d, r.lo2));
#else
  (void)magic;
  const u32 b = prmt(w, 0u, sel_t);
  const float lo = (__uint_as_float((b & 0x0Fu) | 0x4B000000u) - r.off_lo) * r.s;
  const float hi = (__uint_as_float((b & 0xF0u) | 0x4B000000u) - r.off_hi) * r.s16;
  u32 d;
#if X_BF16
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
#endif
  return d;
#endif
}

// The 64-bit wgmma descriptor of a K-major operand in the 128-byte swizzle, at shared address
// addr (1024-aligned atoms of 8 rows x 128 bytes; consecutive 8-row atoms 1024 bytes apart).
__device__ __forceinline__ unsigned long long x_descriptor(u32 addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4)
         | ((unsigned long long)(16 >> 4) << 16)      // leading offset: unused in this layout
         | ((unsigned long long)(1024 >> 4) << 32)    // stride: 8-row atom to the next
         | (1ull << 62);                               // 128-byte swizzle
}

extern "C" __global__ void __launch_bounds__(THREADS)
gemm_w4_wgmma(const u16* __restrict__ X, const u32* __restrict__ W, const void* __restrict__ S,
              const u8* __restrict__ Z, const u16* __restrict__ Bias, u16* __restrict__ Y,
              int M, int N, int K, long long stride_x, long long stride_w, long long stride_s,
              long long stride_z, long long stride_y, int m_tiles, int group
#if SPLITK > 1
              , float* __restrict__ Partial, int* __restrict__ Arrivals
#endif
              ) {
  extern __shared__ __align__(1024) unsigned char smem[];
  // 1024-align the stages (the dynamic window's start is at least 16-aligned; the host adds
  // 1024 bytes of room)
  const u32 base_raw = smem_addr(smem);
  const u32 base = (base_raw + 1023u) & ~1023u;
  unsigned char* const sbase = smem + (base - base_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, q = warp & 3;  // warpgroup, warp within it
  const int g = lane >> 2, t = lane & 3;
#if SPLITK > 1
  const int ks = blockIdx.x % SPLITK, tile = blockIdx.x / SPLITK;
  const int stages = K / BK / SPLITK;
  const int sk0 = ks * stages;
#else
  const int tile = blockIdx.x;
  const int stages = K / BK;
  constexpr int sk0 = 0;
#endif
  // the m tiles of one n tile are neighbours: they read the same codes
  const int m0 = (tile % m_tiles) * BM, n0 = (tile / m_tiles) * BN;

  // Copy assignments, fixed per thread. x: XC chunks of 16 bytes a row (chunk c: atom c / 8,
  // chunk c % 8 of its 128-byte row), THREADS / XC rows a pass.
  constexpr int XC = 2 * KSTEPS;
  constexpr int X_RPP = THREADS / XC;
  constexpr int X_PASSES = (BM + X_RPP - 1) / X_RPP;
  const int xr0 = tid / XC, xc = tid % XC;
  // codes: KSTEPS / 2 chunks of 16 bytes a row (32 codes each), BN rows, W_PASSES a thread
  constexpr int WC = KSTEPS / 2;
  constexpr int W_PASSES = BN * WC / THREADS;
  const int wr = tid / WC, wc = tid % WC;
  const u32 w_dst = (u32)(X_STAGE_BYTES + wr * (BK / 2) + wc * 16);
#if GROUP_STAGES > 0
  // the 4-byte word holding (row, group) of scales (zeros), for rows tid < BN
  const long long s_elem0 = (long long)min(n0 + tid, N - 1) * stride_s;
#if HAS_ZEROS
  const long long z_elem0 = (long long)min(n0 + tid, N - 1) * stride_z;
#endif
#endif

  auto load_w = [&](int s) {
    const u32 st = base + (u32)((s % STAGES) * STAGE_BYTES);
#pragma unroll
    for (int p = 0; p < W_PASSES; ++p) {  // a pass moves THREADS / WC rows
      const int r = wr + p * (THREADS / WC);
      cp_async16(st + w_dst + p * (THREADS / WC) * (BK / 2),
                 W + (long long)min(n0 + r, N - 1) * stride_w + wc * 4
                   + (long long)(s + sk0) * (BK / 8), true);
    }
#if GROUP_STAGES > 0
    if (tid < BN) {
      const int grp = (s + sk0) / GROUP_STAGES;
      cp_async4(st + X_STAGE_BYTES + W_STAGE_BYTES + tid * 4,
                reinterpret_cast<const char*>(S) + (((s_elem0 + grp) * S_ESZ) & ~3LL));
#if HAS_ZEROS
      cp_async4(st + X_STAGE_BYTES + W_STAGE_BYTES + S_STAGE_BYTES + tid * 4,
                reinterpret_cast<const char*>(Z) + ((z_elem0 + grp) & ~3LL));
#endif
    }
#endif
  };
  auto load_x = [&](int s) {  // rows past M are zero-filled (from row 0, a valid address)
    const u32 st = base + (u32)((s % STAGES) * STAGE_BYTES);
#pragma unroll
    for (int p = 0; p < X_PASSES; ++p) {
      const int r = xr0 + p * X_RPP;
      if (BM % X_RPP == 0 || r < BM) {
        const bool ok = m0 + r < M;
        const u32 dst = (u32)((xc >> 3) * (BM * 128) + r * 128 + (((xc & 7) ^ (r & 7)) << 4));
        cp_async16(st + dst,
                   X + (ok ? (long long)(m0 + r) * stride_x : 0) + (s + sk0) * BK + xc * 8, ok);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < stages) load_w(s);
  pdl_wait();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < stages) load_x(s);
    cp_async_commit();
  }

  // This thread's two weight rows (of the block's BN) and their fixed dequantization inputs.
  const int row_a = 64 * wg + 16 * q + g, row_b = row_a + 8;
  const u32 sel_t = (u32)t | 0x4440u;  // prmt: byte t of the first operand, then zeros
  const u32 magic = MAGIC2;
  RowDeq deq_a, deq_b;
#if GROUP_STAGES == 0
  {
    const float sa = load_scale(S, (long long)min(n0 + row_a, N - 1) * stride_s);
    const float sb = load_scale(S, (long long)min(n0 + row_b, N - 1) * stride_s);
#if HAS_ZEROS
    deq_a = row_deq(sa, (float)Z[(long long)min(n0 + row_a, N - 1) * stride_z]);
    deq_b = row_deq(sb, (float)Z[(long long)min(n0 + row_b, N - 1) * stride_z]);
#else
    deq_a = row_deq(sa, 8.f);
    deq_b = row_deq(sb, 8.f);
#endif
  }
#endif

  // Stage s's A fragments (the two rows' 64 codes: words 2j, 2j + 1 hold k16 step j), from its
  // shared slot: scales (and zeros) of its group first.
  auto dequant = [&](int s, u32 (&a)[KSTEPS][4]) {
    const unsigned char* sp = sbase + (s % STAGES) * STAGE_BYTES;
#if GROUP_STAGES > 0
    const int grp = (s + sk0) / GROUP_STAGES;
    const u32* sw = reinterpret_cast<const u32*>(sp + X_STAGE_BYTES + W_STAGE_BYTES);
    const float sa = scale_in_word(
        sw[row_a], (int)(((long long)min(n0 + row_a, N - 1) * stride_s + grp) & 1));
    const float sb = scale_in_word(
        sw[row_b], (int)(((long long)min(n0 + row_b, N - 1) * stride_s + grp) & 1));
#if HAS_ZEROS
    const u32* zw = reinterpret_cast<const u32*>(sp + X_STAGE_BYTES + W_STAGE_BYTES
                                                 + S_STAGE_BYTES);
    const long long za = (long long)min(n0 + row_a, N - 1) * stride_z + grp;
    const long long zb = (long long)min(n0 + row_b, N - 1) * stride_z + grp;
    deq_a = row_deq(sa, (float)((zw[row_a] >> (8 * (int)(za & 3))) & 0xFFu));
    deq_b = row_deq(sb, (float)((zw[row_b] >> (8 * (int)(zb & 3))) & 0xFFu));
#else
    deq_a = row_deq(sa, 8.f);
    deq_b = row_deq(sb, 8.f);
#endif
#endif
    const uint4* wa = reinterpret_cast<const uint4*>(sp + X_STAGE_BYTES + row_a * (BK / 2));
    const uint4* wb = reinterpret_cast<const uint4*>(sp + X_STAGE_BYTES + row_b * (BK / 2));
    u32 wa8[2 * KSTEPS], wb8[2 * KSTEPS];
#pragma unroll
    for (int c = 0; c < KSTEPS / 2; ++c) {
      const uint4 va = wa[c], vb = wb[c];
      wa8[4 * c] = va.x, wa8[4 * c + 1] = va.y, wa8[4 * c + 2] = va.z, wa8[4 * c + 3] = va.w;
      wb8[4 * c] = vb.x, wb8[4 * c + 1] = vb.y, wb8[4 * c + 2] = vb.z, wb8[4 * c + 3] = vb.w;
    }
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j) {
      a[j][0] = pair(wa8[2 * j], sel_t, magic, deq_a);      // row g, k 2t..
      a[j][1] = pair(wb8[2 * j], sel_t, magic, deq_b);      // row g + 8
      a[j][2] = pair(wa8[2 * j + 1], sel_t, magic, deq_a);  // row g, k 2t + 8..
      a[j][3] = pair(wb8[2 * j + 1], sel_t, magic, deq_b);
    }
  };
  // Stage s landed (cp.async groups: one a stage, STAGES - 1 issued ahead of stage 0) and is
  // visible to every warpgroup and to the tensor cores' async proxy.
  auto arrive = [&]() {
#if PROXY_FENCE
    fence_proxy_async();
#endif
    __syncthreads();
  };

  // ACC accumulator sets, k16 step j of a stage into set j % ACC: consecutive wgmmas into one
  // accumulator form a dependency chain the tensor pipe cannot overlap; summed at the end.
  float d[BM / 2];
  float dacc[ACC > 1 ? ACC - 1 : 1][BM / 2];
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    d[i] = 0.f;
#pragma unroll
    for (int c = 0; c < ACC - 1; ++c) dacc[c][i] = 0.f;
  }

  // Software pipeline, two A register sets: stage s's wgmmas run while this warpgroup
  // dequantizes stage s + 1 (wgmma.wait_group 1 keeps one group in flight). A slot is refilled
  // only after every warpgroup's wait showed the wgmmas that read it complete (the barrier in
  // `arrive` comes after the wait).
  u32 a0[KSTEPS][4], a1[KSTEPS][4];
  cp_async_wait<STAGES - 2>();
  arrive();
  dequant(0, a0);
  auto step = [&](int s, u32 (&cur)[KSTEPS][4], u32 (&next)[KSTEPS][4]) {
    const unsigned long long desc = x_descriptor(base + (u32)((s % STAGES) * STAGE_BYTES));
    wgmma_fence();
#if !(DIAG & 4)
#pragma unroll
    for (int j = 0; j < KSTEPS; ++j)  // atom j / 4 (BM x 128 bytes on), +32 bytes a k16 step
      wgmma_m64k16(j % ACC == 0 ? d : dacc[j % ACC - 1], cur[j][0], cur[j][1], cur[j][2],
                   cur[j][3], desc + (unsigned long long)((j >> 2) * (BM * 8) + 2 * (j & 3)));
#endif
    wgmma_commit();
    wgmma_wait1();  // stage s - 1's wgmmas are done: `next` and its slot may be reused
    if (s + 1 < stages) {
      cp_async_wait<STAGES - 3>();  // stage s + 1 is in
#if !(DIAG & 8)
      arrive();
#endif
      if (s + STAGES - 1 < stages) {  // into stage s - 1's slot
        load_w(s + STAGES - 1);
#if !(DIAG & 2)
        load_x(s + STAGES - 1);
#endif
      }
      cp_async_commit();
#if !(DIAG & 1)
      dequant(s + 1, next);
#else
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) next[j][e] = cur[j][e] ^ (u32)s;
#endif
    }
  };
  for (int s = 0; s < stages; s += 2) {
    step(s, a0, a1);
    if (s + 1 < stages) step(s + 1, a1, a0);
  }
  wgmma_wait0();
#pragma unroll
  for (int c = 0; c < ACC - 1; ++c)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) d[i] += dacc[c][i];
  cp_async_wait<0>();
  pdl_launch_dependents();

  // d[i]: weight row 64 wg + 16 q + g + 8 ((i / 2) % 2), x row 8 (i / 4) + 2t + (i % 2)
#if SPLITK > 1
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    const int col = n0 + 64 * wg + 16 * q + g + 8 * ((i >> 1) & 1);
    const int row = m0 + 8 * (i >> 2) + 2 * t + (i & 1);
    if (row < M && col < N) Partial[((long long)ks * M + row) * N + col] = d[i];
  }
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (tid == 0) last = atomicAdd(Arrivals + tile, 1) == SPLITK - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    const int col = n0 + 64 * wg + 16 * q + g + 8 * ((i >> 1) & 1);
    const int row = m0 + 8 * (i >> 2) + 2 * t + (i & 1);
    if (row >= M || col >= N) continue;
    float sum = 0.f;
    for (int p = 0; p < SPLITK; ++p)  // through L2, in split order: other blocks wrote these
      sum += __ldcg(Partial + ((long long)p * M + row) * N + col);
    d[i] = sum;
  }
  if (tid == 0) Arrivals[tile] = 0;
#endif

  // Epilogue through shared memory (the pipeline's, now idle): the tile as y rows of BN
  // 16-bit values (+ 8 of padding against bank conflicts), then 16-byte row stores.
  __syncthreads();
  constexpr int YP = BN + 8;
  u16* ys = reinterpret_cast<u16*>(sbase);
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    const int c = 64 * wg + 16 * q + g + 8 * ((i >> 1) & 1);
    const int r = 8 * (i >> 2) + 2 * t + (i & 1);
    float v = d[i];
#if HAS_BIAS
    v += act_to_float(__ldg(Bias + min(n0 + c, N - 1)));
#endif
    ys[r * YP + c] = float_to_act(v);
  }
  __syncthreads();
  constexpr int CPR = BN / 8;  // 16-byte chunks a row
  for (int i = tid; i < BM * CPR; i += THREADS) {
    const int r = i / CPR, c = (i % CPR) * 8;
    if (m0 + r >= M || n0 + c >= N) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(ys + r * YP + c);
    *reinterpret_cast<uint4*>(Y + (long long)(m0 + r) * stride_y + n0 + c) = v;
  }
}
