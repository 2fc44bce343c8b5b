// W4A16 GEMM on tensor cores for M > 1 rows (prefill and batched decode):
// y[m, n] = sum_k x[m, k] * (code[n, k] - zero[n, g]) * scale[n, g] (+ bias[n]), g = k / group.
// Compiled at run time by NVRTC (kernels/cuda_rtc.py); includes common.cuh.
//
// It reads the int4 codes directly (the layout of kernels/gemm.py BITS=4: int32 [N, K/8], word
// w of a row holds k = 8w..8w+7, lowest nibble first), so a prefill no longer writes and re-reads
// every weight in bf16 (dequantize + cuBLAS) and a batched decode step reads a quarter of the
// bytes of the bf16 GEMM.
//
// Work: a block of WM x WN warps owns BM = 16 MT WM rows and BN = 8 NTW WN columns; a warp owns
// MT m16 tiles x NTW n8 tiles and issues mma.sync m16n8k16 (fp32 accumulators). K is walked in
// stages of BK = 32 CPS; x and code tiles of STAGES stages are in flight in shared memory
// (cp.async, zero-filled past M and N). The codes of later stages are requested before the
// programmatic-dependent-launch wait (weights are read-only during a step), x after it.
//
// The k relabeling. An mma's thread (group g = lane / 4, t = lane % 4) holds B elements
// (k = 2t, 2t+1, 2t+8, 2t+9; n = g) and A elements (rows g and g + 8; the same k). The dot
// product does not care which actual k a slot stands for as long as A and B agree, so in each
// 32-k chunk thread t takes the chunk's word t of its B row, i.e. actual k = 8t..8t+7, for two
// mmas: a Marlin-style LOP3 turns the word into four 16-bit pairs (nibble i, nibble i + 4),
// P_i = (128 + code) with the bf16 magic 0x4300 (1024 + code, 0x6400, for fp16); one packed
// FMA subtracts 128 + zero, exactly. mma 1 takes B = (P0, P1), i.e. slots (2t, 2t+1) = actual
// (8t, 8t+4) and slots (2t+8, 2t+9) = actual (8t+1, 8t+5); mma 2 takes (P2, P3). The A
// registers are the same pairs of x, built with PRMT from one 16-byte load of x[row][8t..8t+7].
//
// Scales: the products of (code - zero) and x are exact in the fp32 accumulators, so each
// group's sum goes to a group accumulator and is scaled once, in fp32, when the group ends
// (GROUP_CHUNKS 32-k chunks; 0: per channel, scaled at the end). That is the rounding of the
// batch-1 GEMV (csrc/gemv_w4.cu): only the fp32 summation order differs from dequantizing in
// fp32 and multiplying; the reference (gemm.linear_ref) rounds the dequantized weight to bf16
// first, the test tolerance covers it.
//
// Macros: WM, WN, MT, NTW, CPS, STAGES, X_BF16, SCALE_KIND (0 bf16, 1 fp16, 2 fp32),
// HAS_ZEROS (uint8 zeros [N, G], else zero point 8), HAS_BIAS, GROUP_CHUNKS, LEAN (1:
// fragment addresses from per-thread offsets computed once and one x pointer walked over the
// copy passes, fewer integer instructions a stage: 4-20% faster on every 3B shape at 8-128
// rows, H100 run 6, so the default tiles use it), SPLITK (K in that many block-sized parts;
// measured level with the plain tiles, not a default).
// Contract (gemm_w4_cuda.supports): K % BK == 0, N % 8 == 0, rows 16-byte aligned.

#include "common.cuh"

#ifndef LEAN
#define LEAN 0
#endif
#ifndef SPLITK
#define SPLITK 1  // K splits a tile (the last block to finish adds them)
#endif

#define THREADS (32 * WM * WN)
#define BM (16 * MT * WM)
#define BN (8 * NTW * WN)
#define BK (32 * CPS)
#define PSPLIT (MT * NTW == 1 ? 4 : (MT * NTW <= 4 ? 2 : 1))
#define A_STAGE_BYTES (BM * BK * 2)
#define B_STAGE_BYTES (BN * BK / 2)
// Scales and zeros ride the stages too (a register load a group ahead stalled every stage for
// an L2 round trip): per stage, the 4-byte word holding each of the tile's rows' value of each
// group the stage touches (SPS of them; 0 per channel: loaded once at the start).
#if GROUP_CHUNKS > 0
#define SPS (GROUP_CHUNKS >= CPS ? 1 : CPS / GROUP_CHUNKS)
#else
#define SPS 0
#endif
#define S_STAGE_BYTES (BN * SPS * 4)
#define Z_STAGE_BYTES (HAS_ZEROS ? BN * SPS * 4 : 0)
#if SCALE_KIND == 2
#define S_ESZ 4
#else
#define S_ESZ 2
#endif

#if X_BF16
#define MAGIC2 0x43004300u  // bf16 128.0 in both halves
#define ONE2 0x3F803F80u    // bf16 1.0
#else
#define MAGIC2 0x64006400u  // fp16 1024.0
#define ONE2 0x3C003C00u    // fp16 1.0
#endif

// The x tile's 16-byte chunk c of row r sits at chunk c ^ x_swizzle(r): the eight threads of a
// 16-byte load phase (rows g, g + 1; chunks 4kc..4kc+3) then hit eight different bank groups.
__device__ __forceinline__ int x_swizzle(int r) { return CPS >= 2 ? ((r & 1) << 2) : 0; }
// The code tile's chunk kc (4 words) of row n sits at chunk kc ^ w_swizzle(n): a warp's word
// loads (rows g = 0..7, words t) then hit 32 different banks.
__device__ __forceinline__ int w_swizzle(int n) { return ((n * CPS) >> 3) & (CPS - 1); }

// (magic + zero) in both halves of a 16-bit pair, negated, as the FMA's addend
__device__ __forceinline__ u32 neg_offset2(float zero) {
  const u16 h = float_to_act((X_BF16 ? 128.f : 1024.f) + zero);
  return (((u32)h << 16) | h) ^ 0x80008000u;
}

// word -> P[i] = (nibble i, nibble i + 4) - zero as a 16-bit pair, exact
__device__ __forceinline__ void dequant_word(u32 w, u32 negoff, u32* P) {
#pragma unroll
  for (int i = 0; i < 4; ++i) P[i] = fma2(((w >> (4 * i)) & 0x000F000Fu) | MAGIC2, ONE2, negoff);
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if X_BF16
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#else
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#endif
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Accumulator element (i, j, e) summed over the PSPLIT sets, which restart at zero.
__device__ __forceinline__ float take_part(float (&part)[PSPLIT][MT][NTW][4], int i, int j,
                                           int e) {
  float sum = part[0][i][j][e];
  part[0][i][j][e] = 0.f;
#pragma unroll
  for (int q = 1; q < PSPLIT; ++q) {
    sum += part[q][i][j][e];
    part[q][i][j][e] = 0.f;
  }
  return sum;
}

extern "C" __global__ void __launch_bounds__(THREADS)
gemm_w4(const u16* __restrict__ X, const u32* __restrict__ W, const void* __restrict__ S,
        const u8* __restrict__ Z, const u16* __restrict__ Bias, u16* __restrict__ Y,
        int M, int N, int K, long long stride_x, long long stride_w, long long stride_s,
        long long stride_z, long long stride_y, int m_tiles, int early_release
#if SPLITK > 1
        , float* __restrict__ Partial, int* __restrict__ Arrivals
#endif
        ) {
  extern __shared__ __align__(16) unsigned char smem[];
  const u32 xs0 = smem_addr(smem);
  const u32 ws0 = xs0 + STAGES * A_STAGE_BYTES;
  const u32 ss0 = ws0 + STAGES * B_STAGE_BYTES;
  const u32 zs0 = ss0 + STAGES * S_STAGE_BYTES;
  (void)ss0;
  (void)zs0;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / WN, wn = warp % WN;
#if SPLITK > 1
  // block order: the K splits of a tile, then the m tiles of one n tile are neighbours
  // (they read the same codes). This block sums stages [sk0, sk0 + stages) of K (whole
  // groups: the host checks); the tile's last block to finish adds the splits (epilogue).
  const int ks = blockIdx.x % SPLITK, tile = blockIdx.x / SPLITK;
  const int m0 = (tile % m_tiles) * BM, n0 = (tile / m_tiles) * BN;
  const int stages = K / BK / SPLITK;
  const int sk0 = ks * stages;
#else
  // block order: the m tiles of one n tile are neighbours (they read the same codes)
  const int m0 = (blockIdx.x % m_tiles) * BM, n0 = (blockIdx.x / m_tiles) * BN;
  const int stages = K / BK;
  constexpr int sk0 = 0;
#endif

  // Copy assignments, fixed per thread: a thread always copies the same 16-byte column of
  // the x and code tiles, on rows a pass apart, so its global pointers and shared offsets
  // (swizzle included: a pass moves by an even number of rows, and the code swizzle repeats
  // every THREADS / CPS rows) are computed once and a stage only adds its k offset. (Loader
  // loops with per-copy index math cost ~500 instructions a stage, more than the stage's
  // mmas at small tiles.)
  constexpr int XC = CPS * 4;                  // 16-byte chunks in a stage's x row
  constexpr int X_RPP = THREADS / XC;          // x rows per pass
  constexpr int X_PASSES = (BM + X_RPP - 1) / X_RPP;
  constexpr int W_RPP = THREADS / CPS;         // code rows per pass
  constexpr int W_PASSES = (BN + W_RPP - 1) / W_RPP;
  const int xr0 = tid / XC, xc = tid % XC;
  const int wr0 = tid / CPS, wkc = tid % CPS;
  const u32 x_off = xs0 + (xr0 * XC + (xc ^ x_swizzle(xr0))) * 16;
  const u32 w_off = ws0 + (wr0 * CPS + (wkc ^ w_swizzle(wr0))) * 16;
  const u16* x_src = X + (long long)min(m0 + xr0, M - 1) * stride_x + xc * 8;
  const u32* w_src = W + (long long)min(n0 + wr0, N - 1) * stride_w + wkc * 4;
  int x_rows = 0;  // passes whose x row exists
#pragma unroll
  for (int p = 0; p < X_PASSES; ++p)
    x_rows += (xr0 + p * X_RPP < BM && m0 + xr0 + p * X_RPP < M) ? 1 : 0;
  int w_rows = 0;
#pragma unroll
  for (int p = 0; p < W_PASSES; ++p)
    w_rows += (wr0 + p * W_RPP < BN && n0 + wr0 + p * W_RPP < N) ? 1 : 0;
#if SPS > 0
  constexpr int S_PASSES = (BN * SPS + THREADS - 1) / THREADS;
  long long s_elem[S_PASSES];  // element (row, q) of the scale (zero) rows, group 0
  bool s_ok[S_PASSES];
  u32 s_off[S_PASSES];
#pragma unroll
  for (int p = 0; p < S_PASSES; ++p) {
    const int i = tid + p * THREADS;
    s_ok[p] = i < BN * SPS;
    const long long row = min(n0 + i / SPS, N - 1);
    s_elem[p] = row * stride_s + i % SPS;
    s_off[p] = i * 4;
  }
#if HAS_ZEROS
  long long z_elem[S_PASSES];
#pragma unroll
  for (int p = 0; p < S_PASSES; ++p) {
    const int i = tid + p * THREADS;
    z_elem[p] = (long long)min(n0 + i / SPS, N - 1) * stride_z + i % SPS;
  }
#endif
#endif

  auto load_w = [&](int s) {  // codes (and scale / zero words) of stage s into its slot
    const int slot = s % STAGES;
#pragma unroll
    for (int p = 0; p < W_PASSES; ++p)
      if (p < w_rows)  // rows past N: never read (their results are not stored)
        cp_async16(w_off + slot * B_STAGE_BYTES + p * (W_RPP * CPS * 16),
                   w_src + (long long)p * W_RPP * stride_w + (s + sk0) * (BK / 8), true);
#if SPS > 0
    // the word holding (row, group) of each row and group of the stage
    const int grp0 = ((s + sk0) * CPS) / GROUP_CHUNKS;
#pragma unroll
    for (int p = 0; p < S_PASSES; ++p) {
      if (!s_ok[p]) continue;
      cp_async4(ss0 + slot * S_STAGE_BYTES + s_off[p],
                reinterpret_cast<const char*>(S) + (((s_elem[p] + grp0) * S_ESZ) & ~3LL));
#if HAS_ZEROS
      cp_async4(zs0 + slot * Z_STAGE_BYTES + s_off[p],
                reinterpret_cast<const char*>(Z) + ((z_elem[p] + grp0) & ~3LL));
#endif
    }
#endif
  };
#if LEAN
  const long long x_pass = (long long)X_RPP * stride_x;  // elements from one pass to the next
#endif
  auto load_x = [&](int s) {  // x of stage s into its slot; rows past M are zero-filled
    const int slot = s % STAGES;
#if LEAN
    // one pointer walked over the passes (a 64-bit multiply a copy otherwise); rows past M
    // copy nothing from the thread's first row (a valid address)
    const u16* row0 = (x_rows > 0 ? x_src : X) + (s + sk0) * BK;
    const u16* src = row0;
#pragma unroll
    for (int p = 0; p < X_PASSES; ++p) {
      if (BM % X_RPP == 0 || xr0 + p * X_RPP < BM)
        cp_async16(x_off + slot * A_STAGE_BYTES + p * (X_RPP * XC * 16),
                   p < x_rows ? src : row0, p < x_rows);
      src += x_pass;
    }
#else
#pragma unroll
    for (int p = 0; p < X_PASSES; ++p)
      if (xr0 + p * X_RPP < BM)
        cp_async16(x_off + slot * A_STAGE_BYTES + p * (X_RPP * XC * 16),
                   p < x_rows ? x_src + (long long)p * X_RPP * stride_x + (s + sk0) * BK : X,
                   p < x_rows);
#endif
  };

  // Pipeline fill: the first stages' codes before the PDL wait, then their x, one commit
  // group per stage (group 0 also holds every early code load).
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < stages) load_w(s);
  pdl_wait();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < stages) load_x(s);
    cp_async_commit();
  }
  // The dependent kernel may start once every block has passed here: early (after the wait)
  // only where the grid is one wave (the host launches larger grids without PDL, see
  // gemm_w4_cuda.py); a dependent launched early would park its blocks on the SMs that a
  // later wave of this grid needs.
  if (early_release) pdl_launch_dependents();

  // This thread's output columns (C fragments: 2t, 2t + 1 of each n8 tile) and B rows (g).
  const int ncol0 = n0 + wn * (8 * NTW) + 2 * t;
  const int nrow0 = n0 + wn * (8 * NTW) + g;
  // Group sums in PSPLIT interleaved sets: with few tiles a warp's mmas would otherwise form
  // one dependent chain per tile (8 a stage of 128 k), each waiting out the mma latency.
  float acc[MT][NTW][4];
  float part[PSPLIT][MT][NTW][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NTW; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[i][j][e] = 0.f;
#pragma unroll
        for (int q = 0; q < PSPLIT; ++q) part[q][i][j][e] = 0.f;
      }

#if SPS == 0
  // per channel: one scale per column and one zero per row, for the whole K
  float sc[NTW][2];
  u32 negoff[NTW];
#pragma unroll
  for (int j = 0; j < NTW; ++j) {
    const int c = min(ncol0 + 8 * j, N - 2);
    sc[j][0] = load_scale(S, (long long)c * stride_s);
    sc[j][1] = load_scale(S, (long long)(c + 1) * stride_s);
#if HAS_ZEROS
    negoff[j] = neg_offset2((float)__ldg(Z + (long long)min(nrow0 + 8 * j, N - 1) * stride_z));
#else
    negoff[j] = neg_offset2(8.f);
#endif
  }
#elif !HAS_ZEROS
  u32 negoff[NTW];
#pragma unroll
  for (int j = 0; j < NTW; ++j) negoff[j] = neg_offset2(8.f);
#endif

#if LEAN
  // The fragment loads' shared offsets per chunk kc of a stage, for m tile 0 / n tile 0: the
  // swizzles XOR kc with a per-thread value, which the compiler cannot fold into immediates
  // (the loop spent ~2 IMADs an mma on them, cuobjdump); rows 16i and 8 further (x) and 8j
  // further (codes) have the same swizzle, so the other tiles add constants.
  u32 xo[CPS], wo[CPS];
#pragma unroll
  for (int kc = 0; kc < CPS; ++kc) {
    const int r = wm * (16 * MT) + g, n = wn * (8 * NTW) + g;
    xo[kc] = (r * CPS * 4 + ((kc * 4 + t) ^ x_swizzle(r))) * 16;
    wo[kc] = (n * CPS + (kc ^ w_swizzle(n))) * 16 + 4 * t;
  }
#endif

  for (int s = 0; s < stages; ++s) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage s is in; every warp is done with the slot refilled below
    if (s + STAGES - 1 < stages) {
      load_w(s + STAGES - 1);
      load_x(s + STAGES - 1);
    }
    cp_async_commit();
    const unsigned char* xs = smem + (s % STAGES) * A_STAGE_BYTES;
    const unsigned char* ws = smem + STAGES * A_STAGE_BYTES + (s % STAGES) * B_STAGE_BYTES;
#if SPS > 0
    const u32* sw = reinterpret_cast<const u32*>(smem + STAGES * (A_STAGE_BYTES + B_STAGE_BYTES)
                                                 + (s % STAGES) * S_STAGE_BYTES);
#if HAS_ZEROS
    const u32* zw = reinterpret_cast<const u32*>(smem + STAGES * (A_STAGE_BYTES + B_STAGE_BYTES
                                                                  + S_STAGE_BYTES)
                                                 + (s % STAGES) * Z_STAGE_BYTES);
#endif
#endif
#pragma unroll
    for (int kc = 0; kc < CPS; ++kc) {
      // B: word t of chunk kc of the warp's rows, to four (code - zero) pairs per n8 tile
#if SPS > 0
      const int grp = ((s + sk0) * CPS + kc) / GROUP_CHUNKS;  // the chunk's group
      const int q = GROUP_CHUNKS >= CPS ? 0 : kc / GROUP_CHUNKS;  // its index in the stage
#if HAS_ZEROS
      u32 negoff[NTW];
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        const u32 zword = zw[(wn * (8 * NTW) + 8 * j + g) * SPS + q];
        negoff[j] = neg_offset2((float)((zword >> (8 * (grp & 3))) & 0xFFu));
      }
#endif
#endif
      u32 b[NTW][4];
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
#if LEAN
        const u32 w = *reinterpret_cast<const u32*>(ws + wo[kc] + j * (8 * CPS * 16));
#else
        const int n = wn * (8 * NTW) + 8 * j + g;
        const u32 w = *reinterpret_cast<const u32*>(
            ws + (n * CPS + (kc ^ w_swizzle(n))) * 16 + 4 * t);
#endif
        dequant_word(w, negoff[j], b[j]);
      }
      u32 a[MT][8];  // per m16 tile: (l04, h04, l15, h15) for mma 1, (l26, h26, l37, h37) for 2
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#if LEAN
        const unsigned char* xr = xs + xo[kc] + i * (16 * CPS * 4 * 16);
        const uint4 lo = *reinterpret_cast<const uint4*>(xr);
        const uint4 hi = *reinterpret_cast<const uint4*>(xr + 8 * CPS * 4 * 16);
#else
        const int r = wm * (16 * MT) + 16 * i + g;
        const int c = (kc * 4 + t) ^ x_swizzle(r);  // rows r and r + 8: same swizzle
        const uint4 lo = *reinterpret_cast<const uint4*>(xs + (r * CPS * 4 + c) * 16);
        const uint4 hi = *reinterpret_cast<const uint4*>(xs + ((r + 8) * CPS * 4 + c) * 16);
#endif
        // pairs (p, p + 4) of x[row][8t + p]: lo.x = (0, 1), lo.y = (2, 3), lo.z = (4, 5) ...
        a[i][0] = prmt(lo.x, lo.z, 0x5410);
        a[i][1] = prmt(hi.x, hi.z, 0x5410);
        a[i][2] = prmt(lo.x, lo.z, 0x7632);
        a[i][3] = prmt(hi.x, hi.z, 0x7632);
        a[i][4] = prmt(lo.y, lo.w, 0x5410);
        a[i][5] = prmt(hi.y, hi.w, 0x5410);
        a[i][6] = prmt(lo.y, lo.w, 0x7632);
        a[i][7] = prmt(hi.y, hi.w, 0x7632);
      }
      // Independent accumulators back to back: the two mmas of one accumulator are a
      // dependency chain, so every tile's first mma is issued before any second one.
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int j = 0; j < NTW; ++j)
            mma(part[(2 * kc + h) % PSPLIT][i][j], a[i][4 * h], a[i][4 * h + 1], a[i][4 * h + 2], a[i][4 * h + 3],
                b[j][2 * h], b[j][2 * h + 1]);
#if SPS > 0
      if (((s + sk0) * CPS + kc + 1) % GROUP_CHUNKS == 0) {  // the group ends: scale its sums into acc
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
          const int c = wn * (8 * NTW) + 8 * j + 2 * t;
          const float s0 = scale_in_word(sw[c * SPS + q], grp * S_ESZ / 2);
          const float s1 = scale_in_word(sw[(c + 1) * SPS + q], grp * S_ESZ / 2);
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc[i][j][e] = fmaf(take_part(part, i, j, e), (e & 1) ? s1 : s0, acc[i][j][e]);
        }
      }
#endif
    }
  }
  cp_async_wait<0>();
  if (!early_release) pdl_launch_dependents();
#if SPS == 0
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NTW; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = take_part(part, i, j, e) * sc[j][e & 1];
#endif

#if SPLITK > 1
  // Each split writes its fp32 sums to Partial [SPLITK, M, N]; the tile's last block to
  // arrive (Arrivals[tile], reset by that block for the next launch) adds them in split
  // order, so the result does not depend on which block came last.
#pragma unroll
  for (int j = 0; j < NTW; ++j)
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm * (16 * MT) + 16 * i + g + 8 * h, col = ncol0 + 8 * j;
        if (row < M && col < N)
          *reinterpret_cast<float2*>(Partial + ((long long)ks * M + row) * N + col) =
              make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]);
      }
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (tid == 0) last = atomicAdd(Arrivals + tile, 1) == SPLITK - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int j = 0; j < NTW; ++j)
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm * (16 * MT) + 16 * i + g + 8 * h, col = ncol0 + 8 * j;
        if (row >= M || col >= N) continue;
        float2 sum = make_float2(0.f, 0.f);
        for (int q = 0; q < SPLITK; ++q) {  // through L2: other blocks wrote these
          const float2 v = __ldcg(reinterpret_cast<const float2*>(
              Partial + ((long long)q * M + row) * N + col));
          sum.x += v.x;
          sum.y += v.y;
        }
        acc[i][j][2 * h] = sum.x;
        acc[i][j][2 * h + 1] = sum.y;
      }
  if (tid == 0) Arrivals[tile] = 0;
#endif

  // Epilogue: rows g and g + 8 of each m16 tile, columns 2t and 2t + 1 of each n8 tile.
#pragma unroll
  for (int j = 0; j < NTW; ++j) {
    const int col = ncol0 + 8 * j;
    if (col >= N) continue;
    float b0 = 0.f, b1 = 0.f;
#if HAS_BIAS
    b0 = act_to_float(__ldg(Bias + col));
    b1 = act_to_float(__ldg(Bias + col + 1));
#endif
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + wm * (16 * MT) + 16 * i + g + 8 * h;
        if (row < M) {
          const u32 v = (u32)float_to_act(acc[i][j][2 * h] + b0)
                        | ((u32)float_to_act(acc[i][j][2 * h + 1] + b1) << 16);
          *reinterpret_cast<u32*>(Y + (long long)row * stride_y + col) = v;
        }
      }
  }
}
