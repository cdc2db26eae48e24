// Does compute-sanitizer flag a named barrier that two warp roles reach at two instructions?
//
// SparseCore's 64-row consumers (kernels/sparse_core_wgmma.py) meet at a named barrier from
// two role branches: the scorer and the values warpgroup each reach it at an instruction of
// their own, as warp-specialized kernels do. With `bar.sync 1, 256` there (before session 27)
// synccheck reported "Divergent thread(s) in block" (sparse_core_wgmma.py:523) and racecheck
// hazards on the row sums that barrier orders (:248 / :256). By the PTX spec's letter only the
// non-aligned form (`barrier.sync`) may be reached from role branches. Both forms assemble to
// the same BAR.SYNC instruction words. This probe asks the tool about the pattern alone: warp 0
// writes 32 shared words per block and meets warp 1 at the barrier; warp 1 then reads them.
// The role is warp-uniform (a shuffle from lane 0), as in SparseCore:
//   split      bar.sync 1, 64 in each role branch (two instructions)
//   unaligned  barrier.sync 1, 64 in each role branch (the spec-legal form of split)
//   joined     one bar.sync 1, 64 after the branches (both roles at one instruction)
// Each block writes its own 32 output words; a wrong one would be a real race.
//
// With a second argument `idle` a third warp, outside the barrier (as SparseCore's producer
// warpgroup is outside its consumers' barrier), runs beside them (96 threads, barrier count 64).
// Measured (H100, session 28): synccheck flags split only (4224 "Divergent thread(s)"), not
// unaligned or joined: the cubin lists a non-aligned barrier among its member-mask
// instructions (EIATTR 0x28) and synccheck reads that list. racecheck: 0 for every form, and for
// unaligned and joined with the idle warp.
//
//   nvcc -O3 -arch=sm_90a -lineinfo -o /tmp/probe_role_barrier bench/probe_role_barrier.cu
//   for f in split unaligned joined; do compute-sanitizer --tool synccheck /tmp/probe_role_barrier $f [idle]; done
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); std::exit(1); } } while (0)

enum Form { SPLIT = 0, UNALIGNED = 1, JOINED = 2 };

template <int FORM>
__global__ void role_barrier(const int* __restrict__ in, int* __restrict__ out) {
  __shared__ int words[32];
  // the role, warp-uniform as ptxas can see (SparseCore's roles come from the warp index alike)
  const int lane = threadIdx.x % 32, warp = __shfl_sync(0xffffffffu, threadIdx.x / 32, 0);
  __shared__ int own[32];
  if (warp == 2) {  // a third role outside the barrier (SparseCore's producer), launched with "idle"
    own[lane] = in[lane] + 5;
    __syncwarp();
    if (own[31 - lane] == 0x7fffffff) out[0] = 0;  // never: keeps the work
    return;
  }
  int seen = 0;
  if (warp == 0) {  // the writing role
    words[lane] = in[lane] * 3 + 1;
    if (FORM == SPLIT) asm volatile("bar.sync 1, 64;" ::: "memory");
    if (FORM == UNALIGNED) asm volatile("barrier.sync 1, 64;" ::: "memory");
  } else {  // the reading role
    seen = in[32 + lane] ^ 0x5a5a;
    if (FORM == SPLIT) asm volatile("bar.sync 1, 64;" ::: "memory");
    if (FORM == UNALIGNED) asm volatile("barrier.sync 1, 64;" ::: "memory");
  }
  if (FORM == JOINED) asm volatile("bar.sync 1, 64;" ::: "memory");
  if (warp == 1) out[blockIdx.x * 32 + lane] = words[31 - lane] + (seen ^ 0x5a5a) - in[32 + lane];
}

int main(int argc, char** argv) {
  const char* name = argc > 1 ? argv[1] : "split";
  const int threads = argc > 2 && !std::strcmp(argv[2], "idle") ? 96 : 64;  // + a warp not at the barrier
  int form = !std::strcmp(name, "split") ? SPLIT : !std::strcmp(name, "unaligned") ? UNALIGNED
           : !std::strcmp(name, "joined") ? JOINED : -1;
  if (form < 0) { std::fprintf(stderr, "usage: probe_role_barrier split|unaligned|joined [idle]\n"); return 2; }
  constexpr int kBlocks = 132;
  static int host_out[kBlocks * 32];
  int host_in[64];
  for (int i = 0; i < 64; ++i) host_in[i] = 7 * i + 11;
  int *in, *out;
  CHECK(cudaMalloc(&in, sizeof host_in));
  CHECK(cudaMalloc(&out, sizeof host_out));
  CHECK(cudaMemcpy(in, host_in, sizeof host_in, cudaMemcpyHostToDevice));
  int wrong = 0;
  for (int launch = 0; launch < 16; ++launch) {
    CHECK(cudaMemset(out, 0xff, sizeof host_out));  // poisoned: every word must be written
    if (form == SPLIT) role_barrier<SPLIT><<<kBlocks, threads>>>(in, out);
    if (form == UNALIGNED) role_barrier<UNALIGNED><<<kBlocks, threads>>>(in, out);
    if (form == JOINED) role_barrier<JOINED><<<kBlocks, threads>>>(in, out);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(host_out, out, sizeof host_out, cudaMemcpyDeviceToHost));
    for (int i = 0; i < kBlocks * 32; ++i) wrong += host_out[i] != host_in[31 - i % 32] * 3 + 1;
  }
  std::printf("%s%s: %d of %d words wrong\n", name, threads == 96 ? " idle" : "", wrong, 16 * kBlocks * 32);
  return wrong != 0;
}
