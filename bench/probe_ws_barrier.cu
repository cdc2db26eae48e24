// Which part of SparseCore's warp-specialized shape makes racecheck report its row sums?
//
// racecheck reports the TP 1 SparseCore partial (kernels/sparse_core_wgmma.py, 64-row CTAs with
// the producer and the crossover) at its end: the scorer warpgroup's reads of the row sums
// (:256) against the values warpgroup's stores of its zero sums (:248), though in the SASS each
// role stores, then passes the consumers' barrier (barrier 1, 256 threads), then reads
// (bench/RESULTS.md session 28). bench/probe_role_barrier.cu's two warps, with or without an
// idle third, are clean. This probe builds the kernel's shape piece by piece, 384 threads:
//   warpgroup 2  the producer: fills a ring of blocks in shared memory (plain stores) and
//                signals each on its `full` mbarrier; takes a slot back on its `empty` one
//   warpgroup 0  the scorer: per block waits `full`, sums the block, waits barrier 3 (P_FREE)
//                but at the first, writes P (shared) and arrives on barrier 2 (P_READY,
//                barrier.arrive); keeps a row sum
//   warpgroup 1  the values: per block waits barrier 2, reads P, releases the ring slot
//                (`empty`) and arrives on barrier 3 but after the last block
//   start        both consumer warpgroups meet at barrier 1 after warpgroup 0 stages a tile
//   finish       warpgroup 0 stores its row sums, warpgroup 1 zeros, both meet at barrier 1,
//                each reads both halves and writes its outputs
// One ordering is through mbarriers alone, as in SparseCore: the scorer's reads of a ring slot
// come before the producer rewrites it only via barrier 2 (the values wait on the scorer) and
// the values' arrival on `empty`; racecheck may report that pair (the ring's lines) too.
// and adds, by the second argument's letters:
//   c  a cluster of 2 CTAs: a cluster barrier at the start (every thread), and the crossover's
//      closing one around the finish (arrive before, wait after)
//   r  setmaxnreg: the consumers take 232 registers, the producer gives back to 40
//   (none) the plain shape.  Outputs per block are checked (a wrong one would be a real race).
//
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -lineinfo -o /tmp/probe_ws_barrier bench/probe_ws_barrier.cu
//   for v in - c r cr; do compute-sanitizer --tool racecheck /tmp/probe_ws_barrier $v; done
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1); } } while (0)

constexpr int kThreads = 384, kConsumers = 256, kRows = 64, kBlockWords = 512, kSlots = 2, kBlocks = 6;

__device__ __forceinline__ void named_sync(int id) { asm volatile("barrier.sync %0, 256;" :: "r"(id) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) { asm volatile("barrier.arrive %0, 256;" :: "r"(id) : "memory"); }

__device__ __forceinline__ unsigned smem(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" :: "r"(smem(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n\tWAIT:\n\t"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT;\n\t}" :: "r"(smem(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

template <bool CLUSTER, bool MAXNREG>
__global__ void __launch_bounds__(kThreads, 1) ws_finish(const int* __restrict__ in, int* __restrict__ out) {
  __shared__ int ring[kSlots][kBlockWords];
  __shared__ int p_tile[kRows];
  __shared__ int tile[kRows];
  __shared__ int sums[2 * kRows];
  __shared__ unsigned long long full[kSlots], empty[kSlots];
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), t = tid % 128;
  if (tid == 0) {
    for (int s = 0; s < kSlots; ++s) { mbar_init(&full[s], 128); mbar_init(&empty[s], 128); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (CLUSTER) { cluster_arrive(); cluster_wait(); } else { __syncthreads(); }
  int result = 0;
  if (wg == 2) {  // the producer
    if (MAXNREG) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    for (int b = 0; b < kBlocks; ++b) {
      const int s = b % kSlots;
      if (b >= kSlots) mbar_wait(&empty[s], ((b / kSlots) - 1) & 1);
      for (int i = t; i < kBlockWords; i += 128) ring[s][i] = in[(blockIdx.x * kBlocks + b) * kBlockWords % 4096 + i % 64] + b;
      mbar_arrive(&full[s]);
    }
  } else {
    if (MAXNREG) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    if (wg == 0) {  // the scorer
      if (t < kRows) tile[t] = in[t] * 7 + blockIdx.x;
      named_sync(1);  // start
      int row_sum = 0;
      for (int b = 0; b < kBlocks; ++b) {
        const int s = b % kSlots;
        mbar_wait(&full[s], (b / kSlots) & 1);
        int part = 0;
        for (int i = 0; i < kBlockWords / kRows; ++i) part += ring[s][(t % kRows) * (kBlockWords / kRows) + i];
        if (b > 0) named_sync(3);  // P_FREE: the values have read the last block's P
        if (t < kRows) p_tile[t] = part + tile[t];
        row_sum += part;
        named_arrive(2);  // P_READY
      }
      if (CLUSTER) cluster_arrive();  // the crossover's closing barrier, arrived before the finish
      if (t % 2 == 0) sums[t / 2] = row_sum;
      named_sync(1);  // finish
      result = sums[t / 2] + sums[kRows + t / 2];
      if (CLUSTER) cluster_wait();
    } else {  // the values
      named_sync(1);  // start
      int acc = 0;
      for (int b = 0; b < kBlocks; ++b) {
        const int s = b % kSlots;
        named_sync(2);  // P_READY
        acc += p_tile[t % kRows] + tile[t % kRows];
        mbar_arrive(&empty[s]);
        if (b + 1 < kBlocks) named_arrive(3);  // P_FREE, but after the last block (nothing waits)
      }
      if (CLUSTER) cluster_arrive();
      if (t % 2 == 0) sums[kRows + t / 2] = 0;  // the values hold no row sums
      named_sync(1);  // finish
      result = acc + sums[t / 2] + sums[kRows + t / 2];  // both halves, as SparseCore's finish reads them
      if (CLUSTER) cluster_wait();
    }
    out[blockIdx.x * kConsumers + tid] = result;
  }
  if (CLUSTER && wg == 2) { cluster_arrive(); cluster_wait(); }
}

int part_of(const int* in, int block, int b, int row) {  // a block's sum over one row's words
  int part = 0;
  for (int i = 0; i < kBlockWords / kRows; ++i)
    part += in[(block * kBlocks + b) * kBlockWords % 4096 + (row * (kBlockWords / kRows) + i) % 64] + b;
  return part;
}

int expected(const int* in, int block, int tid) {  // a consumer thread's output, as the kernel defines it
  const int t = tid % 128;
  if (tid < 128) {  // the scorer: the row sum thread 2 (t / 2) stored, plus the values' zero
    int row_sum = 0;
    for (int b = 0; b < kBlocks; ++b) row_sum += part_of(in, block, b, (2 * (t / 2)) % kRows);
    return row_sum;
  }
  const int row = t % kRows, tile = in[row] * 7 + block;
  int acc = 0, row_sum = 0;  // the values: their sum of P, plus the scorer's stored row sum
  for (int b = 0; b < kBlocks; ++b) {
    acc += part_of(in, block, b, row) + 2 * tile;
    row_sum += part_of(in, block, b, (2 * (t / 2)) % kRows);
  }
  return acc + row_sum;
}

int main(int argc, char** argv) {
  const char* flags = argc > 1 ? argv[1] : "-";
  const bool cluster = std::strchr(flags, 'c') != nullptr, maxnreg = std::strchr(flags, 'r') != nullptr;
  constexpr int kCtas = 132;
  static int host_in[4096], host_out[kCtas * kConsumers];
  for (int i = 0; i < 4096; ++i) host_in[i] = (i * 37) % 101 - 50;
  int *in, *out;
  CHECK(cudaMalloc(&in, sizeof host_in));
  CHECK(cudaMalloc(&out, sizeof host_out));
  CHECK(cudaMemcpy(in, host_in, sizeof host_in, cudaMemcpyHostToDevice));
  void (*kernel)(const int*, int*) = cluster ? (maxnreg ? ws_finish<true, true> : ws_finish<true, false>)
                                             : (maxnreg ? ws_finish<false, true> : ws_finish<false, false>);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(kCtas);
  config.blockDim = dim3(kThreads);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cluster ? 2 : 1;
  attribute[0].val.clusterDim.y = attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  int wrong = 0;
  for (int launch = 0; launch < 4; ++launch) {
    CHECK(cudaMemset(out, 0xff, sizeof host_out));  // poisoned: every word must be written
    CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<const int*>(in), out));
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(host_out, out, sizeof host_out, cudaMemcpyDeviceToHost));
    for (int c = 0; c < kCtas; ++c)
      for (int tid = 0; tid < kConsumers; ++tid) wrong += host_out[c * kConsumers + tid] != expected(host_in, c, tid);
  }
  std::printf("%s: %d of %d words wrong\n", flags, wrong, 4 * kCtas * kConsumers);
  return wrong != 0;
}
