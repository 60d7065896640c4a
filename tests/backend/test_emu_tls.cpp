// The thread-locals of an emulated kernel module: threadIdx, blockIdx, ... and every __shared__
// variable live in the TLS segment of a dlopen'ed shared object, so glibc gives each OS thread
// that runs the module a dynamic TLS block of its own (malloc'ed on the thread's first access).
// The module asks for 64-byte alignment (cuda_emu.hpp): a block starting 16 bytes into a page is
// taken by the sanitizer runtime's __tls_get_addr interceptor (GCC 12) for a glibc 2.19 block,
// and LeakSanitizer then scans a bogus range and crashes (docs/hardening.md, "Sanitizers").
// These tests run a module on fresh worker threads and look at the blocks it got, from inside
// the kernel; under AddressSanitizer they also run a leak check while those threads are alive.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "backend/emu/emu_runtime.hpp"
#include "backend/emu/host_jit.hpp"
#include "support/test_util.hpp"
#include "util/thread_pool.hpp"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace fs = std::filesystem;

namespace {

// The two threads of each block swap their indices through a __shared__ pair (so the
// thread-locals are really per-block storage), and thread 0 reports where the calling OS thread's
// instance of the module's TLS segment begins, the segment's alignment and whether the pair lies
// inside it. The kernel keeps its thread-locals small on purpose (48 bytes without the alignment
// anchor): up to 48 bytes ASan's allocator puts its 16-byte chunk header right before the block,
// and a fresh thread's first block of that size starts 16 bytes into a page, which is the case
// the interceptor misreads.
const char* kProbeSource = R"(
#include <link.h>

struct TlsProbe {
  const void* var;
  unsigned long long begin, align, inside;
};

static int kg_test_find_tls(struct dl_phdr_info* info, size_t, void* data) {
  TlsProbe* p = (TlsProbe*)data;
  if (info->dlpi_tls_data == nullptr) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& h = info->dlpi_phdr[i];
    if (h.p_type != PT_TLS) continue;
    const char* b = (const char*)info->dlpi_tls_data;
    if ((const char*)p->var < b || (const char*)p->var >= b + h.p_memsz) continue;
    p->begin = (unsigned long long)(uintptr_t)b;
    p->align = h.p_align;
    p->inside = 1;
    return 1;
  }
  return 0;
}

extern "C" __global__ void tls_probe(int* out, unsigned long long* probe) {
  __shared__ int pair[2];
  pair[threadIdx.x] = blockIdx.x * 2 + threadIdx.x;
  __syncthreads();
  out[blockIdx.x * 2 + threadIdx.x] = pair[1 - threadIdx.x];
  if (threadIdx.x == 0) {
    TlsProbe p = {&pair[0], 0, 0, 0};
    dl_iterate_phdr(&kg_test_find_tls, &p);
    probe[3 * blockIdx.x] = p.begin;
    probe[3 * blockIdx.x + 1] = p.align;
    probe[3 * blockIdx.x + 2] = p.inside;
  }
}
)";

}  // namespace

TEST(EmuTls, EveryThreadsBlockOfModuleThreadLocalsIsAlignedTo64Bytes) {
  const fs::path dir = fs::temp_directory_path() / ("kg-emu-tls-" + std::to_string(kg_test::fresh_seed()));
  fs::remove_all(dir);
  {
    kg::emu::HostJit jit(dir);
    const auto mod = jit.load("test.tls_probe", kProbeSource);
    constexpr unsigned kBlocks = 64, kThreads = 2;
    std::vector<int> out(kBlocks * kThreads, -1);
    std::vector<unsigned long long> probe(3 * kBlocks, 0);
    int* out_p = out.data();
    unsigned long long* probe_p = probe.data();
    void* args[] = {&out_p, &probe_p};
    kg::util::ThreadPool pool(8);  // fresh OS threads: each allocates the module's TLS anew
    kg::emu::GridLaunch L;
    L.kernel = &mod->find("tls_probe", "[test]");
    L.grid = {kBlocks, 1, 1};
    L.block = {kThreads, 1, 1};
    L.args = args;
    L.label = "[test]";
    L.pool = &pool;
    kg::emu::run_grid(L);

    for (unsigned b = 0; b < kBlocks; ++b)
      for (unsigned t = 0; t < kThreads; ++t)
        ASSERT_EQ(out[b * kThreads + t], static_cast<int>(b * kThreads + 1 - t))
            << "block " << b << ", thread " << t;
    for (unsigned b = 0; b < kBlocks; ++b) {
      const unsigned long long begin = probe[3 * b], align = probe[3 * b + 1];
      ASSERT_EQ(probe[3 * b + 2], 1u) << "block " << b << ": the __shared__ pair is not in a TLS segment";
      EXPECT_GE(align, 64u) << "block " << b;
      EXPECT_EQ(begin % 64, 0u) << "block " << b << ": TLS block at 0x" << std::hex << begin;
      EXPECT_NE(begin % 4096, 16u) << "block " << b << ": TLS block at 0x" << std::hex << begin;
    }
#if defined(__SANITIZE_ADDRESS__)
    // LeakSanitizer's tracer scans every live thread's TLS, the pool's included: it crashed here
    // (the whole process, "Tracer caught signal 11") when a block was taken for a glibc 2.19 one.
    EXPECT_EQ(__lsan_do_recoverable_leak_check(), 0);
#endif
  }
  fs::remove_all(dir);
}
