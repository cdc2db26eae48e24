// How fast one launch can stream IndexQuery's 24 MiB of wq_b: the ceiling to set beside it.
//
// IndexQuery reads wq_b (64 x 128 rows of 1536 bf16, 24 MiB) once a step on 128 CTAs, one an
// SM, through a ring of 16 KB TMA stages (6 slots before its PDL wait, refilled after it): ~10-11
// us a launch on the H200 (cuBLAS's bare GEMM 9.1), 12.2-13.0 on an H100 (cuBLAS 11.3-11.7). Its
// no-math probe took as long (RESULTS session 23). This probe asks the memory system alone, with
// nothing but loads, what a launch of the same bytes costs by shape (session 45, H100: 8.2 us):
//   ld    G CTAs of 256 threads, 16-byte loads in a grid-stride loop (U in flight a thread);
//   bulk  G CTAs, one thread each streaming its contiguous share by 16 KB cp.async.bulk copies
//         into a ring of S slots, each refilled as it lands (no reader to wait for); "first S
//         before" issues the first S copies before griddepcontrol.wait (IndexQuery's order),
//         "after" all of them after it (cuBLAS's and DeepGEMM's).
//   ring  128 CTAs of 32 or 256 threads, in clusters of 1 or 2, 6 slots, IndexQuery's protocol:
//         every thread waits for each stage and releases it, and thread 0 refills a slot at the
//         top of the next iteration once all have released it (no math).
// Every launch is PDL-chained (launch_dependents first) in a CUDA graph of 20 launches that
// rotate over 5 copies of the weights (120 MiB > L2), as bench/ab_index_query.py times
// IndexQuery; the time is the graph's per launch, best of 10 replays.
//
//   nvcc -O3 -arch=sm_90a -o /tmp/probe_stream bench/probe_stream.cu && /tmp/probe_stream
//
// Prints one table row per case: kernel, CTAs, bytes in flight a CTA, order, us per launch, TB/s.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1); } } while (0)

constexpr size_t kBytes = size_t(64) * 128 * 1536 * 2;  // wq_b at TP 8: 24 MiB
constexpr int kChunk = 16384;                           // one ring stage
constexpr int kChunks = int(kBytes / kChunk);           // 1536
constexpr int kCopies = 5, kLaunches = 20;

__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

template <int U>
__global__ void stream_ld(const uint4* __restrict__ src, unsigned* __restrict__ sink) {
  pdl_trigger();
  pdl_wait();
  const size_t n = kBytes / 16, stride = size_t(gridDim.x) * blockDim.x;
  unsigned acc = 0;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * stride < n ? __ldcs(src + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;  // keeps the loads; almost never stores
}

__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "n"(kChunk) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "n"(kChunk), "r"(bar) : "memory");
}

__device__ __forceinline__ void wait_parity(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}" ::"r"(bar), "r"(parity) : "memory");
}

// This CTA's contiguous share of the chunks is [first_chunk(cta), first_chunk(cta + 1)).
__device__ __forceinline__ int first_chunk(unsigned cta) { return int(int64_t(cta) * kChunks / gridDim.x); }

// One thread a CTA streams chunks [first, last) through `slots` 16 KB slots.
__global__ void stream_bulk(const uint8_t* __restrict__ src, int slots, int pre, unsigned* __restrict__ sink) {
  extern __shared__ __align__(1024) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[16];
  pdl_trigger();
  if (threadIdx.x != 0) return;
  const int first = first_chunk(blockIdx.x), last = first_chunk(blockIdx.x + 1);
  const uint32_t ring_at = uint32_t(__cvta_generic_to_shared(ring));
  const uint32_t bar_at = uint32_t(__cvta_generic_to_shared(full));
  for (int s = 0; s < slots; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_at + 8 * s));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  if (!pre) pdl_wait();
  int issued = first;
  for (; issued < last && issued - first < slots; ++issued) {
    const int s = (issued - first) % slots;
    bulk_copy(ring_at + s * kChunk, src + size_t(issued) * kChunk, bar_at + 8 * s);
  }
  if (pre) pdl_wait();
  for (int c = first; c < last; ++c) {
    const int i = c - first, s = i % slots;
    wait_parity(bar_at + 8 * s, (i / slots) & 1);
    if (issued < last) {  // the slot just landed: refill it (no consumer to wait for)
      bulk_copy(ring_at + s * kChunk, src + size_t(issued) * kChunk, bar_at + 8 * s);
      ++issued;
    }
  }
  if (ring[threadIdx.x] == 0x5b && ring[kChunk - 1] == 0x5b) sink[blockIdx.x] = 1;  // the ring holds 0x5a bytes
}

// IndexQuery's ring protocol with no math: every thread waits for each stage and releases it
// (an empty mbarrier of blockDim.x arrivals); thread 0 refills stage i - 1's slot at the top of
// iteration i, once every thread has released it (so a slot waits for the slowest reader).
__global__ void stream_ring(const uint8_t* __restrict__ src, int slots, unsigned* __restrict__ sink) {
  extern __shared__ __align__(1024) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[16], empty[16];
  pdl_trigger();
  const int first = first_chunk(blockIdx.x), last = first_chunk(blockIdx.x + 1);
  const uint32_t ring_at = uint32_t(__cvta_generic_to_shared(ring));
  const uint32_t full_at = uint32_t(__cvta_generic_to_shared(full));
  const uint32_t empty_at = uint32_t(__cvta_generic_to_shared(empty));
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full_at + 8 * s));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty_at + 8 * s), "r"(blockDim.x));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int c = first; c < last && c - first < slots; ++c)
      bulk_copy(ring_at + (c - first) * kChunk, src + size_t(c) * kChunk, full_at + 8 * (c - first));
  pdl_wait();
  for (int c = first; c < last; ++c) {
    const int i = c - first, s = i % slots;
    if (threadIdx.x == 0 && i >= 1 && c - 1 + slots < last) {
      const int prev = (i - 1) % slots;
      wait_parity(empty_at + 8 * prev, ((i - 1) / slots) & 1);
      bulk_copy(ring_at + prev * kChunk, src + size_t(c - 1 + slots) * kChunk, full_at + 8 * prev);
    }
    wait_parity(full_at + 8 * s, (i / slots) & 1);
    if (c + slots < last) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(empty_at + 8 * s) : "memory");
  }
  __syncthreads();
  if (ring[threadIdx.x] == 0x5b && ring[kChunk - 1] == 0x5b) sink[blockIdx.x] = 1;
}

int main() {
  uint8_t* weights;
  unsigned* sink;
  CHECK(cudaMalloc(&weights, kBytes * kCopies));
  CHECK(cudaMemset(weights, 0x5a, kBytes * kCopies));
  CHECK(cudaMalloc(&sink, 1 << 16));
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaFuncSetAttribute(stream_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 13 * kChunk));
  CHECK(cudaFuncSetAttribute(stream_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, 13 * kChunk));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));

  // time(launch) captures kLaunches PDL-chained launches of copy i % kCopies and returns us a launch
  auto time = [&](auto launch) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kLaunches; ++i) launch(weights + size_t(i % kCopies) * kBytes, attr);
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    float best = 1e30f;
    for (int rep = 0; rep < 13; ++rep) {
      CHECK(cudaEventRecord(t0, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(t1, stream));
      CHECK(cudaEventSynchronize(t1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, t0, t1));
      if (rep >= 3 && ms < best) best = ms;
    }
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return best * 1e3 / kLaunches;
  };
  auto row = [&](const char* kernel, int ctas, int in_flight, const char* order, double us) {
    std::printf("| %s | %d | %d KB | %s | %.2f | %.2f |\n", kernel, ctas, in_flight / 1024, order, us,
                kBytes / (us * 1e-6) / 1e12);
  };

  std::printf("| kernel | CTAs | in flight a CTA | loads vs PDL wait | us a launch (24 MiB) | TB/s |\n"
              "|---|---|---|---|---|---|\n");
  for (int per_sm : {1, 2, 4, 8}) {
    for (int unroll : {4, 8}) {
      const int ctas = sms * per_sm;
      const double us = time([&](uint8_t* src, cudaLaunchAttribute attr) {
        cudaLaunchConfig_t cfg{dim3(ctas), dim3(256), 0, stream, &attr, 1};
        if (unroll == 4) CHECK(cudaLaunchKernelEx(&cfg, stream_ld<4>, reinterpret_cast<const uint4*>(src), sink));
        else CHECK(cudaLaunchKernelEx(&cfg, stream_ld<8>, reinterpret_cast<const uint4*>(src), sink));
      });
      row(unroll == 4 ? "ld U=4" : "ld U=8", ctas, 256 * 16 * unroll, "after", us);
    }
  }
  struct Bulk { int ctas, slots; };
  const Bulk bulks[] = {{128, 4}, {128, 6}, {128, 8}, {128, 12}, {132, 12}, {256, 6}, {264, 6}, {128, 13}};  // 4: the 64-token variant's ring
  for (const Bulk& b : bulks) {
    for (int pre : {1, 0}) {
      const double us = time([&](uint8_t* src, cudaLaunchAttribute attr) {
        cudaLaunchConfig_t cfg{dim3(b.ctas), dim3(32), size_t(b.slots) * kChunk, stream, &attr, 1};
        CHECK(cudaLaunchKernelEx(&cfg, stream_bulk, static_cast<const uint8_t*>(src), b.slots, pre, sink));
      });
      row("bulk 16 KB", b.ctas, b.slots * kChunk, pre ? "first S before" : "after", us);
    }
  }
  for (int cluster : {1, 2}) {
    for (int threads : {32, 256}) {
      const double us = time([&](uint8_t* src, cudaLaunchAttribute attr) {
        cudaLaunchAttribute attrs[2] = {attr, {}};
        attrs[1].id = cudaLaunchAttributeClusterDimension;
        attrs[1].val.clusterDim.x = cluster;
        attrs[1].val.clusterDim.y = 1;
        attrs[1].val.clusterDim.z = 1;
        cudaLaunchConfig_t cfg{dim3(128), dim3(threads), size_t(6) * kChunk, stream, attrs, 2};
        CHECK(cudaLaunchKernelEx(&cfg, stream_ring, static_cast<const uint8_t*>(src), 6, sink));
      });
      char name[64];
      std::snprintf(name, sizeof name, "ring, %d threads, cluster %d", threads, cluster);
      row(name, 128, 6 * kChunk, "first S before", us);
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
