// A decode step's graph inputs in one launch (kernels/stage_inputs.py, engine/cuda_graph.py):
// the host-written rows in pinned memory are read by the kernel itself, through their mapped
// device addresses, and stored in the static device buffers the CUDA graph reads; the input
// ids of an async step (the previous step's argmax, on the device) are converted to int64 on
// the way. This replaces three host-to-device copies and a copy kernel, which ran one after
// another on the stream between two decode graphs (about 23 us of a 1.1 ms int4 step on an
// H100).
//
// Layout (as cuda_graph.py's buffers): inputs int64 [in_rows, n] (row stride n), seq_lens int32
// [n], block tables int32 [n, w]. The first bs columns of every input row, bs seq lens, and
// the first `cols` entries of bs table rows are copied (table entries past a row's length are
// never read). Ids: kind 0 none, 1 int64, 2 float64 (greedy_with_logprobs' output), 3 int32;
// inputs[0, :n_ids] = ids.
//
// Out: the previous step's greedy tokens and logprobs ([2, n_out] 8-byte values, row stride
// out_stride, on the device) written to pinned host memory (mapped), so the host reads them
// after this kernel's event without a device-to-host copy of their own (n_out 0: none).

typedef long long i64;

extern "C" __global__ void stage_inputs(const i64* __restrict__ HIn, const int* __restrict__ HSeq,
                                        const int* __restrict__ HTab, i64* __restrict__ DIn,
                                        int* __restrict__ DSeq, int* __restrict__ DTab, int n,
                                        int bs, int w, int cols, int in_rows,
                                        const void* __restrict__ Ids, int n_ids, int ids_kind,
                                        const i64* __restrict__ Out, long long out_stride,
                                        i64* __restrict__ HOut, int n_out) {
  const int total_in = in_rows * bs, total = total_in + bs + bs * cols;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < 2 * n_out; i += gridDim.x * blockDim.x) {
    const int r = i / n_out, c = i - r * n_out;
    HOut[i] = Out[r * out_stride + c];
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    if (i < total_in) {
      const int r = i / bs, c = i - r * bs;
      i64 v;
      if (r == 0 && c < n_ids) {
        if (ids_kind == 1) v = reinterpret_cast<const i64*>(Ids)[c];
        else if (ids_kind == 2) v = (i64)reinterpret_cast<const double*>(Ids)[c];
        else v = reinterpret_cast<const int*>(Ids)[c];
      } else {
        v = HIn[(i64)r * n + c];
      }
      DIn[(i64)r * n + c] = v;
    } else if (i < total_in + bs) {
      DSeq[i - total_in] = HSeq[i - total_in];
    } else {
      const int j = i - total_in - bs, r = j / cols, c = j - r * cols;
      DTab[(i64)r * w + c] = HTab[(i64)r * w + c];
    }
  }
}
