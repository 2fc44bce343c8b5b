// Device helpers the CUDA C kernels share (kernels/csrc/*.cu include this; cuda_rtc hands it
// to NVRTC from memory). Activations are 16-bit: bf16 where the kernel defines X_BF16 1,
// else fp16. No system headers.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// a 16-bit float's bits as fp32: bf16 (BF16) or fp16
template <bool BF16>
__device__ __forceinline__ float bits16_to_float(u16 v) {
  if (BF16) return __uint_as_float(((u32)v) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
}

__device__ __forceinline__ float act_to_float(u16 v) { return bits16_to_float<X_BF16>(v); }

__device__ __forceinline__ u16 float_to_act(float f) {
  u16 h;
#if X_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
  return h;
}

// f rounded to the activation dtype, back as fp32 (where the unfused layers round)
__device__ __forceinline__ float round_act(float f) { return act_to_float(float_to_act(f)); }

#ifdef SCALE_KIND
// Quantization scales of the int4 kernels: SCALE_KIND 0 bf16, 1 fp16, 2 fp32.
// a 16-bit scale's bits as fp32
__device__ __forceinline__ float half_scale_to_float(u16 v) {
  return bits16_to_float<SCALE_KIND == 0>(v);
}

// scale i of S (read-only during a step: through the non-coherent cache)
__device__ __forceinline__ float load_scale(const void* S, long long i) {
#if SCALE_KIND == 2
  return __ldg(reinterpret_cast<const float*>(S) + i);
#else
  return half_scale_to_float(__ldg(reinterpret_cast<const u16*>(S) + i));
#endif
}

// element e (its index's parity, for 16-bit kinds) of a 4-byte word of scales, as fp32: the
// GEMMs copy a stage's scales as the words that hold them
__device__ __forceinline__ float scale_in_word(u32 w, int e) {
#if SCALE_KIND == 2
  (void)e;
  return __uint_as_float(w);
#else
  return half_scale_to_float((u16)(w >> (16 * (e & 1))));
#endif
}
#endif

// A 16-byte weight load that does not allocate in L1 (each weight is read once per step).
__device__ __forceinline__ uint4 load_weights(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// 16 bytes an earlier kernel wrote, read after the PDL wait (which makes its writes
// visible) with a plain weak ld.global, cached in L1 as Triton's loads are: every block reads
// the whole activation row, and from L2 alone its few hot lines serialized on their L2
// slices (5x slower).
__device__ __forceinline__ uint4 load_act16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Programmatic dependent launch (kernels/pdl.py's rule: wait before reading what another
// kernel of the step writes and before any write; release the dependent after the wait).
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// L2 prefetch of the weights a later kernel of the step reads (kernels/l2_prefetch.py):
// [base, base + bytes) split over the grid's last `tail` blocks (all of them where tail <= 0),
// one Hopper bulk prefetch per block, issued by one thread. Read-only data, so it may be
// issued before the PDL wait. The last blocks start when the kernel's own loads are mostly
// issued: their prefetch fills the kernel's tail and the kernels after it (a norm, the
// attention) with the next GEMV's weights instead of leaving HBM idle there. base 16-byte
// aligned, bytes a multiple of 16 (the caller's contract); a no-op before sm_90.
__device__ __forceinline__ void l2_prefetch_share(const void* base, long long bytes, int tail) {
#if __CUDA_ARCH__ >= 900
  if (bytes <= 0 || threadIdx.x != 0) return;
  const int nb = tail > 0 && tail < (int)gridDim.x ? tail : (int)gridDim.x;
  const int b = (int)blockIdx.x - ((int)gridDim.x - nb);
  if (b < 0) return;
  // slices of whole 256-byte lines per block, in block order
  const long long per = ((bytes + nb - 1) / nb + 255) & ~255LL;
  const long long start = (long long)b * per;
  if (start >= bytes) return;
  const long long n = bytes - start < per ? bytes - start : per;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
               :: "l"(reinterpret_cast<const char*>(base) + start), "r"((u32)n));
#endif
}

// v summed over the warp's 32 lanes, the same total in every lane (butterfly order)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// silu(gate) * up, rounded as silu_and_mul rounds (the SiLU, then the product)
__device__ __forceinline__ float silu_mul(float gate, float up) {
  return round_act(round_act(__fdividef(gate, 1.f + __expf(-gate))) * up);
}

#ifndef SILU_OUT
#define SILU_OUT 0  // a [gate; up] layer whose epilogue writes silu(gate) * up (block_row)
#endif

// The weight row a block's row r reads, for a block owning `rows` output rows: row
// blockIdx.x * rows + r; with `gate_up_pairs` (a [gate; up] layer, N = 2I, whose epilogue pairs
// them) gate row j then up row j for the block's rows / 2 outputs j. Rows past the end re-read
// the last valid one (their results are not stored).
__device__ __forceinline__ long long block_row(int r, int N, int rows, bool gate_up_pairs) {
  if (gate_up_pairs) {
    const int half = N >> 1;
    const int j = min((int)blockIdx.x * (rows / 2) + r / 2, half - 1);
    return (long long)j + (r & 1) * half;
  }
  return min((int)blockIdx.x * rows + r, N - 1);
}

// --- the tensor-core GEMMs' shared pieces (csrc/gemm_w4.cu, csrc/gemm_w4_wgmma.cu) ---

// a shared-memory pointer as the 32-bit address cp.async, ldmatrix and descriptors take
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// 16 bytes global -> shared, asynchronously; zeros where !valid (src is then not read)
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// at most N groups of this thread's copies still in flight (callers then __syncthreads, a
// compiler barrier too, before reading what the others copied)
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N));
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// a * b + c on two 16-bit values of the activation dtype at once
__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
  u32 d;
#if X_BF16
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
  return d;
}
