#include "backend/emu/emu_runtime.hpp"

#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/context/fiber.hpp>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "util/thread_pool.hpp"
#include "backend/emu/host_jit.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::emu {
namespace bctx = boost::context;

namespace {

constexpr std::size_t kStackBytes = 256 * 1024;  // per emulated thread, plus a guard page
constexpr std::size_t kAltStackBytes = 64 * 1024;
constexpr unsigned char kCanary = 0xA5;
constexpr unsigned long long kUndefinedLane = ~0ull;  // what a read of a non-participating lane gives

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return p;
}

unsigned char* map_pages(std::size_t bytes, int prot, const char* what) {
  void* p = ::mmap(nullptr, bytes, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw Error(util::cat("CUDA emulation: cannot map ", bytes, " bytes for ", what));
  return static_cast<unsigned char*>(p);
}

std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

std::string dim_text(const KgEmuDim3& d) { return util::cat("(", d.x, ", ", d.y, ", ", d.z, ")"); }

const char* warp_op_name(int op) {
  switch (op) {
    case KG_EMU_SHFL_IDX:
      return "__shfl_sync";
    case KG_EMU_SHFL_UP:
      return "__shfl_up_sync";
    case KG_EMU_SHFL_DOWN:
      return "__shfl_down_sync";
    case KG_EMU_SHFL_XOR:
      return "__shfl_xor_sync";
    case KG_EMU_VOTE_ALL:
      return "__all_sync";
    case KG_EMU_VOTE_ANY:
      return "__any_sync";
    case KG_EMU_VOTE_BALLOT:
      return "__ballot_sync";
    case KG_EMU_SYNCWARP:
      return "__syncwarp";
    case KG_EMU_MATCH_ANY:
      return "__match_any_sync";
    case KG_EMU_MATCH_ALL:
      return "__match_all_sync";
    case KG_EMU_REDUCE_ADD:
      return "__reduce_add_sync";
    case KG_EMU_REDUCE_MIN_S:
    case KG_EMU_REDUCE_MIN_U:
      return "__reduce_min_sync";
    case KG_EMU_REDUCE_MAX_S:
    case KG_EMU_REDUCE_MAX_U:
      return "__reduce_max_sync";
    case KG_EMU_REDUCE_AND:
      return "__reduce_and_sync";
    case KG_EMU_REDUCE_OR:
      return "__reduce_or_sync";
    case KG_EMU_REDUCE_XOR:
      return "__reduce_xor_sync";
  }
  return "a warp intrinsic";
}

// ---- fibers ----

// AddressSanitizer is told of every switch between the scheduler's stack and a fiber's, so that it
// does not take the other stack's frames for overflows (a no-op in builds without ASan).
#if defined(__SANITIZE_ADDRESS__)
#define KG_EMU_ASAN_FIBERS 1
extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, std::size_t size);
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, std::size_t* size_old);
void __asan_unpoison_memory_region(const volatile void* addr, std::size_t size);
}
#endif
struct AsanStack {
  const void* bottom = nullptr;
  std::size_t size = 0;
};
// The scheduler's stack of this OS thread, learnt when a fiber first starts on it.
thread_local AsanStack tl_scheduler_stack;
inline void asan_start_switch([[maybe_unused]] void** fake, [[maybe_unused]] const AsanStack& to) {
#ifdef KG_EMU_ASAN_FIBERS
  __sanitizer_start_switch_fiber(fake, to.bottom, to.size);
#endif
}
// A pooled stack is reused by the next block: frames a failed or unwound fiber left behind must not
// stay poisoned for the next one.
inline void asan_unpoison([[maybe_unused]] const AsanStack& s) {
#ifdef KG_EMU_ASAN_FIBERS
  __asan_unpoison_memory_region(s.bottom, s.size);
#endif
}
inline void asan_finish_switch([[maybe_unused]] void* fake, [[maybe_unused]] AsanStack* from) {
#ifdef KG_EMU_ASAN_FIBERS
  __sanitizer_finish_switch_fiber(fake, from ? &from->bottom : nullptr, from ? &from->size : nullptr);
#endif
}

// A fiber stack: a no-access page below kStackBytes of stack.
struct Stack {
  unsigned char* base = nullptr;
  std::size_t bytes = 0;  // including the guard page
};

// Boost.Context's StackAllocator over a stack the block runner keeps for reuse.
struct PooledStack {
  Stack* stack;
  bctx::stack_context allocate() {
    bctx::stack_context sc;
    sc.size = stack->bytes - page_size();
    sc.sp = stack->base + stack->bytes;
    return sc;
  }
  void deallocate(bctx::stack_context&) noexcept {}
};

enum class State : unsigned char { Runnable, Barrier, Warp, Done };

struct BlockRunner;

struct EThread {
  KgEmuThreadInfo info{};
  bctx::fiber fiber;   // the suspended fiber, held by the scheduler
  bctx::fiber caller;  // the scheduler, held by the fiber while it runs
  State state = State::Done;
  int lane = 0, warp = 0;
  int bar_op = 0;
  int wait_op = 0;  // the warp intrinsic it waits in
  unsigned wait_mask = 0;
  unsigned long long result = 0;
  sigjmp_buf jmp;
  BlockRunner* runner = nullptr;
  AsanStack stack;  // this fiber's stack, for the sanitizer's switch annotations
  std::string failure;  // set before a jump back to thread_main that is not a signal's
};

struct Collective {
  int op = 0;
  unsigned mask = 0, arrived = 0;
  int width = 32;
  unsigned long long value[32];
  int arg[32];
};

struct WarpState {
  unsigned exists = 0, exited = 0;
  std::vector<Collective> pending;
};

// ---- faults ----

struct Fault {
  int sig = 0, code = 0;
  std::uintptr_t address = 0;
  int write = -1;  // 1 write, 0 read, -1 unknown
};

thread_local EThread* tl_running = nullptr;  // the fiber now running on this OS thread
thread_local Fault tl_fault;

constexpr int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGFPE};
struct sigaction g_previous[3];

void on_fault(int sig, siginfo_t* info, void* uc) {
  EThread* t = tl_running;
  int k = sig == SIGSEGV ? 0 : sig == SIGBUS ? 1 : 2;
  if (t == nullptr) {
    // Not an emulated kernel: put the previous disposition back; the instruction faults again.
    ::sigaction(sig, &g_previous[k], nullptr);
    return;
  }
  tl_fault = {sig, info->si_code, reinterpret_cast<std::uintptr_t>(info->si_addr), -1};
#if defined(__x86_64__)
  if (sig == SIGSEGV) tl_fault.write = (static_cast<ucontext_t*>(uc)->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
#else
  (void)uc;
#endif
  tl_running = nullptr;
  siglongjmp(t->jmp, 1);
}

// Installs the handlers, again if something replaced them since (the replacement then becomes the
// disposition that faults outside kernels are handed back to).
void install_fault_handlers() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lk(mu);
  for (int k = 0; k < 3; ++k) {
    struct sigaction now;
    if (::sigaction(kFaultSignals[k], nullptr, &now) == 0 && (now.sa_flags & SA_SIGINFO) &&
        now.sa_sigaction == on_fault)
      continue;
    struct sigaction sa;
    std::memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    ::sigaction(kFaultSignals[k], &sa, &g_previous[k]);
  }
}

// The alternate signal stack of a worker thread, so that a fault on a full fiber stack can still
// be handled.
struct AltStack {
  unsigned char* mem = nullptr;
  AltStack() {
    stack_t old;
    if (::sigaltstack(nullptr, &old) == 0 && !(old.ss_flags & SS_DISABLE)) return;  // one is set already
    mem = map_pages(kAltStackBytes, PROT_READ | PROT_WRITE, "a signal stack");
    stack_t ss;
    ss.ss_sp = mem;
    ss.ss_size = kAltStackBytes;
    ss.ss_flags = 0;
    ::sigaltstack(&ss, nullptr);
  }
  ~AltStack() {
    if (!mem) return;
    stack_t ss;
    std::memset(&ss, 0, sizeof ss);
    ss.ss_flags = SS_DISABLE;
    ::sigaltstack(&ss, nullptr);
    ::munmap(mem, kAltStackBytes);
  }
};

// ---- one block at a time on one OS thread ----

struct BlockRunner {
  const GridLaunch* launch = nullptr;
  std::unique_ptr<EThread[]> threads;
  int capacity = 0, n = 0;
  std::vector<Stack> stacks;
  std::vector<WarpState> warps;
  int live = 0, at_barrier = 0, bar_true = 0;
  bool failed = false;
  std::string error;
  std::unique_ptr<unsigned char[]> shared_plain;
  std::size_t shared_plain_bytes = 0;
  std::unique_ptr<GuardedRegion> shared_guarded;
  KgEmuDim3 block_idx{};

  BlockRunner() = default;
  BlockRunner(const BlockRunner&) = delete;
  BlockRunner& operator=(const BlockRunner&) = delete;
  ~BlockRunner() {
    for (auto& s : stacks) ::munmap(s.base, s.bytes);
  }

  std::string prefix() const { return util::cat(launch->label, " kernel '", launch->kernel->entry, "': "); }
  std::string where(const EThread& t) const {
    return util::cat("thread ", dim_text(t.info.thread_idx), " of block ", dim_text(t.info.block_idx));
  }
  void fail(const std::string& msg) {
    if (!failed) failed = true, error = msg;
  }
  EThread& thread(int warp, int lane) { return threads[static_cast<std::size_t>(warp * 32 + lane)]; }
  void yield(EThread& t) {
    void* fake = nullptr;
    asan_start_switch(&fake, tl_scheduler_stack);
    t.caller = std::move(t.caller).resume();
    asan_finish_switch(fake, &tl_scheduler_stack);
  }

  unsigned char* prepare_shared() {
    const std::size_t bytes = launch->shared;
    if (launch->checked) {
      if (!shared_guarded || shared_guarded->size() != bytes)
        shared_guarded = std::make_unique<GuardedRegion>(bytes);
      std::memset(shared_guarded->data(), 0xFF, bytes);
      shared_guarded->reset_canaries();
      return shared_guarded->data();
    }
    if (bytes == 0) return nullptr;
    if (shared_plain_bytes < bytes) {
      shared_plain.reset(new unsigned char[bytes + 64]);
      shared_plain_bytes = bytes;
    }
    auto p = reinterpret_cast<std::uintptr_t>(shared_plain.get());
    return reinterpret_cast<unsigned char*>((p + 63) & ~std::uintptr_t(63));
  }

  void ensure(int threads_needed) {
    if (threads_needed > capacity) {
      threads.reset(new EThread[static_cast<std::size_t>(threads_needed)]);
      capacity = threads_needed;
    }
    while (static_cast<int>(stacks.size()) < threads_needed) {
      Stack s;
      s.bytes = kStackBytes + page_size();
      s.base = map_pages(s.bytes, PROT_READ | PROT_WRITE, "a fiber stack");
      ::mprotect(s.base, page_size(), PROT_NONE);
      stacks.push_back(s);
    }
  }

  static void thread_main(EThread& t) {
    BlockRunner& r = *t.runner;
    t.failure.clear();
    if (sigsetjmp(t.jmp, 0) == 0) {
      try {
        r.launch->kernel->run(&t.info, r.launch->args);
      } catch (const std::exception& e) {
        r.fail(e.what());
      }
    } else if (!t.failure.empty()) {
      r.fail(r.prefix() + util::cat(t.failure, " in ", r.where(t)));
    } else {
      r.fail(r.fault_text(t, tl_fault));
    }
    r.exit_thread(t);
  }

  std::string fault_text(const EThread& t, const Fault& f) const {
    std::string what;
    if (f.sig == SIGFPE) {
      what = f.code == FPE_INTDIV   ? "integer division by zero"
             : f.code == FPE_INTOVF ? "integer overflow in a division"
                                    : "arithmetic exception (SIGFPE)";
    } else {
      const char* access = f.write == 1 ? "write" : f.write == 0 ? "read" : "access";
      if (launch->describe_fault) what = launch->describe_fault(f.address, access);
      if (what.empty() && shared_guarded) {
        if (auto off = shared_guarded->guard_offset(f.address))
          what = util::cat("out-of-bounds ", access, " of dynamic shared memory (", shared_guarded->size(),
                           " bytes) at byte offset ", *off);
      }
      if (what.empty()) {
        for (const auto& s : stacks)
          if (f.address >= reinterpret_cast<std::uintptr_t>(s.base) &&
              f.address < reinterpret_cast<std::uintptr_t>(s.base) + page_size())
            what =
                util::cat("stack overflow (each emulated thread has ", kStackBytes / 1024, " KiB of stack)");
      }
      if (what.empty())
        what = util::cat(f.sig == SIGBUS ? "bus error" : "segmentation fault", " (", access, " at address 0x",
                         std::hex, f.address, std::dec, ", outside every argument buffer)");
    }
    return prefix() + util::cat(what, " in ", where(t));
  }

  void exit_thread(EThread& t) {
    t.state = State::Done;
    --live;
    WarpState& w = warps[static_cast<std::size_t>(t.warp)];
    const unsigned bit = 1u << t.lane;
    w.exited |= bit;
    for (const auto& c : w.pending)
      if (c.mask & bit)
        fail(prefix() +
             util::cat("lane ", t.lane, " of warp ", t.warp, " exited while lanes ", lanes_text(c.arrived),
                       " wait for it in ", warp_op_name(c.op), " with mask ", hex(c.mask),
                       "; every lane the mask names must call the same intrinsic (", where(t), ")"));
  }

  void release_barrier() {
    const int participants = at_barrier;
    for (int i = 0; i < n; ++i) {
      EThread& t = threads[static_cast<std::size_t>(i)];
      if (t.state != State::Barrier) continue;
      switch (t.bar_op) {
        case KG_EMU_BAR_COUNT:
          t.result = static_cast<unsigned long long>(bar_true);
          break;
        case KG_EMU_BAR_AND:
          t.result = bar_true == participants;
          break;
        case KG_EMU_BAR_OR:
          t.result = bar_true > 0;
          break;
        default:
          t.result = 0;
      }
      t.state = State::Runnable;
    }
    at_barrier = 0;
    bar_true = 0;
  }

  std::string state_text(const EThread& t) const {
    switch (t.state) {
      case State::Barrier:
        return "waits at __syncthreads()";
      case State::Warp:
        return util::cat("waits in ", warp_op_name(t.wait_op), " with mask ", hex(t.wait_mask));
      case State::Done:
        return "has exited";
      default:
        return "is runnable";
    }
  }

  std::string deadlock_text() {
    std::vector<std::string> parts;
    for (std::size_t wi = 0; wi < warps.size(); ++wi)
      for (const auto& c : warps[wi].pending) {
        const unsigned missing = c.mask & ~c.arrived;
        int first = 0;
        while (!((missing >> first) & 1u)) ++first;
        parts.push_back(util::cat("lanes ", lanes_text(c.arrived), " of warp ", wi, " wait in ",
                                  warp_op_name(c.op), " with mask ", hex(c.mask), " for lanes ",
                                  lanes_text(missing), " (lane ", first, " ",
                                  state_text(thread(static_cast<int>(wi), first)), ")"));
      }
    if (at_barrier > 0)
      parts.push_back(util::cat(at_barrier, " of ", live, " live threads wait at __syncthreads()"));
    return prefix() + util::cat("deadlock in block ", dim_text(block_idx), ": ", util::join(parts, "; "));
  }

  bool run(const GridLaunch& L, long long index) {
    launch = &L;
    const Dim3 g = L.grid, b = L.block;
    n = static_cast<int>(b.x * b.y * b.z);
    ensure(n);
    failed = false;
    error.clear();
    block_idx = {static_cast<unsigned>(index % g.x), static_cast<unsigned>((index / g.x) % g.y),
                 static_cast<unsigned>(index / (static_cast<long long>(g.x) * g.y))};
    unsigned char* shared = prepare_shared();
    const int nw = (n + 31) / 32;
    warps.resize(static_cast<std::size_t>(nw));
    for (int w = 0; w < nw; ++w) {
      auto& ws = warps[static_cast<std::size_t>(w)];
      const int lanes = std::min(32, n - w * 32);
      ws.exists = lanes == 32 ? ~0u : (1u << lanes) - 1;
      ws.exited = 0;
      ws.pending.clear();
    }
    for (int i = 0; i < n; ++i) {
      EThread& t = threads[static_cast<std::size_t>(i)];
      const unsigned u = static_cast<unsigned>(i);
      t.info.thread_idx = {u % b.x, (u / b.x) % b.y, u / (b.x * b.y)};
      t.info.block_idx = block_idx;
      t.info.block_dim = {b.x, b.y, b.z};
      t.info.grid_dim = {g.x, g.y, g.z};
      t.info.dynamic_shared = shared;
      t.info.runtime = &t;
      t.info.checked = L.checked ? 1 : 0;
      t.runner = this;
      t.state = State::Runnable;
      t.lane = i % 32;
      t.warp = i / 32;
      t.result = 0;
      EThread* tp = &t;
      const Stack& st = stacks[static_cast<std::size_t>(i)];
      t.stack = {st.base + page_size(), st.bytes - page_size()};
      asan_unpoison(t.stack);
      t.fiber = bctx::fiber(std::allocator_arg, PooledStack{&stacks[static_cast<std::size_t>(i)]},
                            [tp](bctx::fiber&& c) {
                              asan_finish_switch(nullptr, &tl_scheduler_stack);
                              tp->caller = std::move(c);
                              thread_main(*tp);
                              asan_start_switch(nullptr, tl_scheduler_stack);  // this fiber ends
                              return std::move(tp->caller);
                            });
    }
    live = n;
    at_barrier = 0;
    bar_true = 0;
    const bool forward = L.order == Order::Forward;
    while (!failed && live > 0) {
      for (int k = 0; k < n && !failed; ++k) {
        EThread& t = threads[static_cast<std::size_t>(forward ? k : n - 1 - k)];
        if (t.state != State::Runnable) continue;
        tl_running = &t;
        void* fake = nullptr;
        asan_start_switch(&fake, t.stack);
        t.fiber = std::move(t.fiber).resume();
        asan_finish_switch(fake, nullptr);
        tl_running = nullptr;
      }
      if (failed || live == 0) break;
      if (at_barrier == live) {
        release_barrier();
        continue;
      }
      bool runnable = false;
      for (int i = 0; i < n && !runnable; ++i)
        runnable = threads[static_cast<std::size_t>(i)].state == State::Runnable;
      if (!runnable) fail(deadlock_text());
    }
    if (failed) {
      // Unwinds the fibers that are still suspended.
      for (int i = 0; i < n; ++i) threads[static_cast<std::size_t>(i)].fiber = bctx::fiber();
    } else if (launch->checked && shared_guarded) {
      if (auto off = shared_guarded->check_canaries())
        fail(prefix() + util::cat("out-of-bounds write of dynamic shared memory (", shared_guarded->size(),
                                  " bytes) at byte offset ", *off, " in block ", dim_text(block_idx)));
    }
    for (int i = 0; i < n; ++i) threads[static_cast<std::size_t>(i)].state = State::Done;
    return !failed;
  }
};

EThread& self_of(const KgEmuThreadInfo* self) { return *static_cast<EThread*>(self->runtime); }

int api_barrier(const KgEmuThreadInfo* self, int op, int predicate) {
  EThread& t = self_of(self);
  BlockRunner& r = *t.runner;
  t.state = State::Barrier;
  t.bar_op = op;
  ++r.at_barrier;
  if (predicate) ++r.bar_true;
  r.yield(t);
  return static_cast<int>(t.result);
}

// The result of lane `j` of a completed collective.
unsigned long long lane_result(const Collective& c, int j) {
  auto pred = [&](int l) { return c.value[l] != 0; };
  switch (c.op) {
    case KG_EMU_VOTE_ALL:
    case KG_EMU_VOTE_ANY:
    case KG_EMU_VOTE_BALLOT: {
      unsigned ballot = 0;
      bool all = true;
      for (int l = 0; l < 32; ++l)
        if ((c.mask >> l) & 1u) {
          if (pred(l))
            ballot |= 1u << l;
          else
            all = false;
        }
      return c.op == KG_EMU_VOTE_BALLOT ? ballot : c.op == KG_EMU_VOTE_ALL ? all : ballot != 0;
    }
    case KG_EMU_SYNCWARP:
      return 0;
    case KG_EMU_MATCH_ANY:
    case KG_EMU_MATCH_ALL: {
      unsigned same = 0;
      for (int l = 0; l < 32; ++l)
        if (((c.mask >> l) & 1u) && c.value[l] == c.value[j]) same |= 1u << l;
      return c.op == KG_EMU_MATCH_ANY ? same : same == c.mask ? c.mask : 0u;
    }
    case KG_EMU_REDUCE_ADD:
    case KG_EMU_REDUCE_MIN_S:
    case KG_EMU_REDUCE_MIN_U:
    case KG_EMU_REDUCE_MAX_S:
    case KG_EMU_REDUCE_MAX_U:
    case KG_EMU_REDUCE_AND:
    case KG_EMU_REDUCE_OR:
    case KG_EMU_REDUCE_XOR: {
      bool first = true;
      unsigned acc = 0;
      for (int l = 0; l < 32; ++l) {
        if (!((c.mask >> l) & 1u)) continue;
        const auto v = static_cast<unsigned>(c.value[l]);
        const auto sv = static_cast<int>(v), sacc = static_cast<int>(acc);
        if (first)
          acc = v;
        else if (c.op == KG_EMU_REDUCE_ADD)
          acc += v;
        else if (c.op == KG_EMU_REDUCE_MIN_S)
          acc = static_cast<unsigned>(std::min(sacc, sv));
        else if (c.op == KG_EMU_REDUCE_MIN_U)
          acc = std::min(acc, v);
        else if (c.op == KG_EMU_REDUCE_MAX_S)
          acc = static_cast<unsigned>(std::max(sacc, sv));
        else if (c.op == KG_EMU_REDUCE_MAX_U)
          acc = std::max(acc, v);
        else if (c.op == KG_EMU_REDUCE_AND)
          acc &= v;
        else if (c.op == KG_EMU_REDUCE_OR)
          acc |= v;
        else
          acc ^= v;
        first = false;
      }
      return acc;
    }
    default:
      break;
  }
  const long long width = c.width, seg_start = j & ~(width - 1), seg_end = seg_start + width - 1;
  const long long arg = c.arg[j] & 31;  // the hardware uses the low 5 bits of a delta or lane mask
  long long src = j;
  bool valid = true;
  switch (c.op) {
    case KG_EMU_SHFL_IDX:
      src = seg_start | (arg & (width - 1));
      break;
    case KG_EMU_SHFL_UP:
      src = j - arg;
      valid = src >= seg_start;
      break;
    case KG_EMU_SHFL_DOWN:
      src = j + arg;
      valid = src <= seg_end;
      break;
    case KG_EMU_SHFL_XOR:
      src = j ^ arg;
      valid = src <= seg_end;
      break;
  }
  if (!valid) return c.value[j];
  return ((c.mask >> src) & 1u) ? c.value[src] : kUndefinedLane;
}

unsigned long long api_warp(const KgEmuThreadInfo* self, int op, unsigned mask, unsigned long long value,
                            int arg, int width) {
  EThread& t = self_of(self);
  BlockRunner& r = *t.runner;
  WarpState& w = r.warps[static_cast<std::size_t>(t.warp)];
  const unsigned bit = 1u << t.lane;
  const char* name = warp_op_name(op);
  auto error = [&](const std::string& what) {
    return Error(r.prefix() +
                 util::cat(name, ": ", what, " (lane ", t.lane, " of warp ", t.warp, ", ", r.where(t), ")"));
  };
  if (op >= KG_EMU_SHFL_IDX && op <= KG_EMU_SHFL_XOR &&
      (width < 1 || width > 32 || (width & (width - 1)) != 0))
    throw error(util::cat("width ", width, " is not a power of 2 between 1 and 32"));
  if (!(mask & bit))
    throw error(util::cat("mask ", hex(mask), " does not include the calling lane ", t.lane,
                          "; every calling lane must be in the mask"));
  if (const unsigned ghost = mask & ~w.exists)
    throw error(util::cat("mask ", hex(mask), " names lanes ", lanes_text(ghost),
                          " that do not exist (the block has ", r.n, " threads)"));
  if (const unsigned gone = mask & w.exited)
    throw error(
        util::cat("mask ", hex(mask), " names lanes ", lanes_text(gone), " that have already exited"));
  std::size_t ci = w.pending.size();
  for (std::size_t i = 0; i < w.pending.size(); ++i)
    if (w.pending[i].mask == mask && w.pending[i].op == op && w.pending[i].width == width) ci = i;
  if (ci == w.pending.size()) {
    for (const auto& c : w.pending)
      if (c.mask & bit)
        throw error(util::cat("called with mask ", hex(mask), " while lanes ", lanes_text(c.arrived),
                              " wait in ", warp_op_name(c.op), " with mask ", hex(c.mask),
                              ", which includes this lane: the lanes disagree on the mask"));
    Collective c;
    c.op = op;
    c.mask = mask;
    c.width = width;
    w.pending.push_back(c);
  }
  Collective& c = w.pending[ci];
  c.arrived |= bit;
  c.value[t.lane] = value;
  c.arg[t.lane] = arg;
  if (c.arrived == c.mask) {
    for (int j = 0; j < 32; ++j) {
      if (!((c.mask >> j) & 1u)) continue;
      EThread& o = r.thread(t.warp, j);
      o.result = lane_result(c, j);
      if (&o != &t) o.state = State::Runnable;
    }
    w.pending.erase(w.pending.begin() + static_cast<std::ptrdiff_t>(ci));
    return t.result;
  }
  t.state = State::Warp;
  t.wait_op = op;
  t.wait_mask = mask;
  r.yield(t);
  return t.result;
}

unsigned api_active_mask(const KgEmuThreadInfo* self) {
  EThread& t = self_of(self);
  const WarpState& w = t.runner->warps[static_cast<std::size_t>(t.warp)];
  return w.exists & ~w.exited;
}

void api_note_atomic(const KgEmuThreadInfo* self, const void* address) {
  const auto& f = self_of(self).runner->launch->note_atomic;
  if (f) f(address);
}

void api_trap(const KgEmuThreadInfo* self, const char* what) {
  EThread& t = self_of(self);
  throw Error(t.runner->prefix() + util::cat(what, " was called in ", t.runner->where(t)));
}

void api_misaligned(const KgEmuThreadInfo* self, const void* address, unsigned alignment, int store, const char* type,
                    const char* file, unsigned line) {
  EThread& t = self_of(self);
  {
    // In a scope of its own: the jump below skips destructors, so no string may be alive then.
    const auto a = reinterpret_cast<std::uintptr_t>(address);
    const GridLaunch& launch = *t.runner->launch;
    std::string where = launch.describe_address ? launch.describe_address(a) : "";
    if (where.empty()) where = util::cat("address 0x", std::hex, a, std::dec);
    t.failure = util::cat("misaligned ", store == 1 ? "store" : store == 0 ? "load" : "access", " of ", type, " at ",
                          where, ": ", a % alignment, " bytes past a multiple of ", alignment,
                          ", the type's alignment (a GPU faults there) at ", file, ":", line);
  }
  // Back to thread_main's sigsetjmp, as a fault's signal handler does: the access never happens.
  tl_running = nullptr;
  siglongjmp(t.jmp, 1);
}

const KgEmuApi kApi = {KG_EMU_ABI_VERSION, &api_barrier,     &api_warp, &api_active_mask,
                       &api_note_atomic,   &api_trap,        &api_misaligned};

BlockRunner& runner_of_this_thread() {
  static thread_local AltStack alt;
  static thread_local std::unique_ptr<BlockRunner> runner;
  (void)alt;
  if (!runner) runner = std::make_unique<BlockRunner>();
  return *runner;
}

}  // namespace

const KgEmuApi* runtime_api() { return &kApi; }

std::string lanes_text(unsigned mask) {
  std::vector<std::string> parts;
  for (int i = 0; i < 32;) {
    if (!((mask >> i) & 1u)) {
      ++i;
      continue;
    }
    int j = i;
    while (j + 1 < 32 && ((mask >> (j + 1)) & 1u)) ++j;
    parts.push_back(i == j ? util::cat(i) : util::cat(i, "-", j));
    i = j + 1;
  }
  return parts.empty() ? "none" : util::join(parts, ", ");
}

void run_grid(const GridLaunch& L) {
  install_fault_handlers();
  const long long blocks = static_cast<long long>(L.grid.x) * L.grid.y * L.grid.z;
  if (blocks <= 0) return;
  auto& pool = L.pool ? *L.pool : util::ThreadPool::global();
  const int workers = static_cast<int>(std::min<long long>(pool.size(), blocks));
  std::atomic<long long> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::string first_error;
  pool.parallel_for(workers, 1, [&](std::int64_t, std::int64_t) {
    BlockRunner& r = runner_of_this_thread();
    while (!stop.load(std::memory_order_relaxed)) {
      const long long i = next.fetch_add(1);
      if (i >= blocks) break;
      if (!r.run(L, L.order == Order::Forward ? i : blocks - 1 - i)) {
        std::lock_guard<std::mutex> lk(mu);
        if (first_error.empty()) first_error = r.error;
        stop = true;
      }
    }
  });
  if (!first_error.empty()) throw Error(first_error);
}

// ---- guarded regions ----

GuardedRegion::GuardedRegion(std::size_t bytes) : bytes_(bytes) {
  const std::size_t pg = page_size(), padded = (bytes + 15) & ~std::size_t(15);
  const std::size_t body = std::max<std::size_t>((padded + pg - 1) / pg * pg, pg);
  map_bytes_ = body + 2 * pg;
  map_ = map_pages(map_bytes_, PROT_NONE, "a guarded buffer");
  if (::mprotect(map_ + pg, body, PROT_READ | PROT_WRITE) != 0) {
    ::munmap(map_, map_bytes_);
    throw Error("CUDA emulation: mprotect failed for a guarded buffer");
  }
  data_ = map_ + pg + body - padded;
  reset_canaries();
}

GuardedRegion::~GuardedRegion() { ::munmap(map_, map_bytes_); }

void GuardedRegion::reset_canaries() {
  const std::size_t pg = page_size();
  std::memset(map_ + pg, kCanary, static_cast<std::size_t>(data_ - (map_ + pg)));
  unsigned char* end = map_ + map_bytes_ - pg;
  std::memset(data_ + bytes_, kCanary, static_cast<std::size_t>(end - (data_ + bytes_)));
}

std::optional<std::ptrdiff_t> GuardedRegion::check_canaries() const {
  const std::size_t pg = page_size();
  const unsigned char* end = map_ + map_bytes_ - pg;
  for (const unsigned char* p = data_ + bytes_; p < end; ++p)
    if (*p != kCanary) return p - data_;
  for (const unsigned char* p = data_ - 1; p >= map_ + pg; --p)
    if (*p != kCanary) return p - data_;
  return std::nullopt;
}

std::optional<std::ptrdiff_t> GuardedRegion::guard_offset(std::uintptr_t address) const {
  const auto lo = reinterpret_cast<std::uintptr_t>(map_), hi = lo + map_bytes_, pg = page_size();
  if ((address >= lo && address < lo + pg) || (address >= hi - pg && address < hi))
    return static_cast<std::ptrdiff_t>(address - reinterpret_cast<std::uintptr_t>(data_));
  return std::nullopt;
}

}  // namespace kg::emu
