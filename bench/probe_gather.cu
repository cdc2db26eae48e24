// The H200's random-row read rate: what SparseCore's loads can reach at best.
//
// SparseCore reads B x 2048 cache rows chosen at random from the pool (1152-byte bf16 rows,
// 656-byte fp8 rows). Its no-math probes (bench_sparse_core --probes no_math) read them at
// ~3.1 TB/s (bf16) and ~2.2 TB/s (fp8) whatever issues the copies (bulk copies, cp.async or
// both), so this probe asks the memory system alone: each warp reads whole rows with 16-byte
// loads (UNROLL rows in flight per warp) and folds them into one word, nothing else. Row
// pitch, row bytes and the number of rows read are arguments; the sequential case (ids in
// order) is the streaming ceiling to set beside it.
//
//   nvcc -O3 -arch=sm_90a -o /tmp/probe_gather bench/probe_gather.cu && /tmp/probe_gather
//
// Prints one line per case: row bytes, pitch, order, us per launch, TB/s of row bytes.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <random>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1); } } while (0)

template <int UNROLL>
__global__ void gather_rows(const uint8_t* __restrict__ pool, const int* __restrict__ ids, int rows,
                            int row_bytes, long pitch, unsigned* __restrict__ sink) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * blockDim.x / 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int chunks = row_bytes / 16;  // row_bytes is a multiple of 16
  unsigned acc = 0;
  for (int r0 = warp * UNROLL; r0 < rows; r0 += warps * UNROLL) {
    uint4 v[UNROLL][3];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int r = r0 + u;
      const uint8_t* row = pool + (r < rows ? ids[r] : 0) * pitch;
#pragma unroll
      for (int c = 0; c < 3; ++c) {
        const int k = lane + 32 * c;
        v[u][c] = (r < rows && k < chunks) ? __ldcs(reinterpret_cast<const uint4*>(row) + k) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int c = 0; c < 3; ++c) acc ^= v[u][c].x ^ v[u][c].y ^ v[u][c].z ^ v[u][c].w;
  }
  if (acc == 0x9e3779b9u) sink[warp] = acc;  // keeps the loads; almost never stores
}

int main() {
  const long pool_rows = 524288;  // bench_sparse_core's pool: 64 tokens x 8192 slots
  const int rows = 64 * 2048;     // B = 64, 2048 slots each
  const long max_pitch = 1152;
  uint8_t* pool;
  int* ids;
  unsigned* sink;
  CHECK(cudaMalloc(&pool, pool_rows * max_pitch));
  CHECK(cudaMemset(pool, 0x5a, pool_rows * max_pitch));
  CHECK(cudaMalloc(&ids, rows * sizeof(int)));
  CHECK(cudaMalloc(&sink, 1 << 20));
  const size_t flush_bytes = 256u << 20;  // written before each launch: L2 (60 MB) keeps none of the pool
  uint8_t* flush;
  CHECK(cudaMalloc(&flush, flush_bytes));
  std::mt19937 gen(5);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(pool_rows - 1));
  std::vector<int> random_ids(rows), seq_ids(rows);
  for (int i = 0; i < rows; ++i) { random_ids[i] = pick(gen); seq_ids[i] = i; }
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  struct Case { int bytes; long pitch; };
  const Case cases[] = {{1152, 1152}, {656, 656}, {640, 656}, {656, 768}, {512, 512}, {1024, 1024}};
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::printf("| row bytes | pitch | ids | rows in flight / SM | us (B=64 x 2048 rows) | TB/s |\n"
              "|---|---|---|---|---|---|\n");
  for (const Case& c : cases) {
    for (int variant = 0; variant < 3; ++variant) {
      const int order = variant == 2, unroll = variant == 0 ? 1 : 4;
      CHECK(cudaMemcpy(ids, order ? seq_ids.data() : random_ids.data(), rows * sizeof(int), cudaMemcpyHostToDevice));
      const int blocks = sms * 8, threads = 256;
      float best = 1e30f;
      for (int rep = 0; rep < 20; ++rep) {
        CHECK(cudaMemsetAsync(flush, rep, flush_bytes));
        CHECK(cudaEventRecord(t0));
        if (unroll == 1) gather_rows<1><<<blocks, threads>>>(pool, ids, rows, c.bytes, c.pitch, sink);
        else gather_rows<4><<<blocks, threads>>>(pool, ids, rows, c.bytes, c.pitch, sink);
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(t1));
        CHECK(cudaEventSynchronize(t1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (rep >= 3 && ms < best) best = ms;
      }
      const double us = best * 1e3, tbs = double(rows) * c.bytes / (us * 1e-6) / 1e12;
      std::printf("| %d | %ld | %s | %d | %.1f | %.2f |\n", c.bytes, c.pitch, order ? "in order" : "random",
                  blocks / sms * threads / 32 * unroll, us, tbs);
    }
  }
  return 0;
}
