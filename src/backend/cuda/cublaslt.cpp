#ifdef KG_HAVE_CUDA
// cuBLASLt for a GemmCall: the library opened with dlopen, one handle per process (a cuBLASLt
// handle is not tied to a context), row-major calls mapped onto the column-major library.
#include <cublasLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "backend/cuda/driver.hpp"
#include "backend/cuda/vendor.hpp"
#include "kg/error.hpp"
#include "util/str.hpp"

namespace kg::cuda {
namespace {

#define KG_CUBLASLT_FUNCTIONS(X)          \
  X(cublasLtCreate)                       \
  X(cublasLtGetVersion)                   \
  X(cublasLtGetStatusName)                \
  X(cublasLtGetStatusString)              \
  X(cublasLtMatmulDescCreate)             \
  X(cublasLtMatmulDescDestroy)            \
  X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatrixLayoutCreate)           \
  X(cublasLtMatrixLayoutDestroy)          \
  X(cublasLtMatrixLayoutSetAttribute)     \
  X(cublasLtMatmulPreferenceCreate)       \
  X(cublasLtMatmulPreferenceDestroy)      \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulAlgoGetHeuristic)       \
  X(cublasLtMatmulAlgoConfigGetAttribute) \
  X(cublasLtMatmulAlgoCheck)              \
  X(cublasLtMatmul)

// Function pointers of cuBLASLt, typed by the toolkit's cublasLt.h.
struct LtApi {
#define KG_DECLARE(name) decltype(&::name) name = nullptr;
  KG_CUBLASLT_FUNCTIONS(KG_DECLARE)
#undef KG_DECLARE
};

// The loaded library with its process-wide handle.
class LtImpl final : public BlasLt {
 public:
  LtImpl(const Driver& d, const LtApi& f, cublasLtHandle_t h) : d_(d), f_(f), handle_(h) {}
  std::unique_ptr<VendorPlan> plan(const GemmCall& g, const VendorOptions& o, CUstream stream,
                                   const std::string& label) const override;

  // Throws "<label> cuBLASLt <fn>: <name> (<text>)" unless s is success.
  void check(cublasStatus_t s, const std::string& label, const char* fn) const {
    if (s == CUBLAS_STATUS_SUCCESS) return;
    const char* name = f_.cublasLtGetStatusName(s);
    const char* text = f_.cublasLtGetStatusString(s);
    throw Error(util::cat(label, " cuBLASLt ", fn, ": ", name ? name : "unknown status", " (",
                          text ? text : "no description", ")"));
  }
  const LtApi& api() const { return f_; }
  cublasLtHandle_t handle() const { return handle_; }

 private:
  const Driver& d_;
  LtApi f_;
  cublasLtHandle_t handle_;
};

// One planned matmul; owns its descriptors. Operands are named in cuBLASLt's order: its A is the
// call's B and its B is the call's A (row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ).
class LtPlan final : public VendorPlan {
 public:
  explicit LtPlan(const LtImpl& lt) : lt_(lt) {}
  ~LtPlan() override {
    const LtApi& f = lt_.api();
    if (op_) f.cublasLtMatmulDescDestroy(op_);
    for (cublasLtMatrixLayout_t l : {a_layout_, b_layout_, c_layout_})
      if (l) f.cublasLtMatrixLayoutDestroy(l);
  }
  std::size_t workspace_bytes() const override { return workspace_; }
  std::string describe() const override { return description_; }
  void run(CUstream stream, DevicePtr workspace, const std::string& label) const override {
    lt_.check(enqueue(stream, workspace, algo_, workspace_), label, "cublasLtMatmul");
  }
  // One cublasLtMatmul with `algo` (also used while tuning).
  cublasStatus_t enqueue(CUstream stream, DevicePtr workspace, const cublasLtMatmulAlgo_t& algo,
                         std::size_t ws_bytes) const {
    const void* one = f64_ ? static_cast<const void*>(&one_d_) : static_cast<const void*>(&one_f_);
    const void* zero = f64_ ? static_cast<const void*>(&zero_d_) : static_cast<const void*>(&zero_f_);
    void* c = reinterpret_cast<void*>(c_);
    return lt_.api().cublasLtMatmul(lt_.handle(), op_, one, reinterpret_cast<const void*>(a_), a_layout_,
                                    reinterpret_cast<const void*>(b_), b_layout_, zero, c, c_layout_, c,
                                    c_layout_, &algo, ws_bytes ? reinterpret_cast<void*>(workspace) : nullptr,
                                    ws_bytes, stream);
  }

  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_layout_ = nullptr, b_layout_ = nullptr, c_layout_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
  DevicePtr a_ = 0, b_ = 0, c_ = 0;
  bool f64_ = false;
  float one_f_ = 1.0f, zero_f_ = 0.0f;
  double one_d_ = 1.0, zero_d_ = 0.0;
  std::size_t workspace_ = 0;
  std::string description_;

 private:
  const LtImpl& lt_;
};

// The largest power of two (at most 256) dividing the byte addresses of every batch item.
std::uint32_t alignment(DevicePtr p, std::int64_t stride_elems, std::int64_t batch, std::size_t elem) {
  std::uint64_t bits = p | 256u;
  if (batch > 1) bits |= static_cast<std::uint64_t>(stride_elems) * elem;
  return static_cast<std::uint32_t>(bits & (~bits + 1));
}

// Device memory and events for tuning, released however planning ends.
struct TuneScratch {
  const Driver& d;
  CUstream stream;
  CUdeviceptr ws = 0;
  CUevent start = nullptr, stop = nullptr;
  ~TuneScratch() {
    d.cuStreamSynchronize(stream);
    if (start) d.cuEventDestroy(start);
    if (stop) d.cuEventDestroy(stop);
    if (ws) d.cuMemFree(ws);
  }
};

// A cuBLASLt algorithm as text for the tuning cache (its opaque words in hex, then the workspace),
// and back; nullopt for text that is not one.
std::string algo_text(const cublasLtMatmulAlgo_t& a, std::size_t ws) {
  std::string s;
  char hex[17];
  for (std::uint64_t w : a.data) {
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(w));
    s += hex;
  }
  return util::cat(s, " ", ws);
}
std::optional<std::pair<cublasLtMatmulAlgo_t, std::size_t>> parse_algo(const std::string& s) {
  cublasLtMatmulAlgo_t a{};
  constexpr std::size_t words = sizeof a.data / sizeof a.data[0];
  if (s.size() < words * 16 + 2 || s[words * 16] != ' ') return std::nullopt;
  for (std::size_t i = 0; i < words; ++i) {
    std::uint64_t w = 0;
    for (std::size_t k = 0; k < 16; ++k) {
      const char c = s[i * 16 + k];
      const int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
      if (v < 0) return std::nullopt;
      w = w << 4 | static_cast<std::uint64_t>(v);
    }
    a.data[i] = w;
  }
  // The workspace: at most 15 digits (under 1 PB), so the sum cannot overflow.
  if (s.size() > words * 16 + 1 + 15) return std::nullopt;
  std::size_t ws = 0;
  for (std::size_t k = words * 16 + 1; k < s.size(); ++k) {
    if (s[k] < '0' || s[k] > '9') return std::nullopt;
    ws = ws * 10 + static_cast<std::size_t>(s[k] - '0');
  }
  return std::pair{a, ws};
}

}  // namespace

std::string tuning_key(const GemmCall& g, bool tf32) {
  return util::cat("gemm ", dtype_name(g.dtype), g.dtype == DType::F32 && tf32 ? "/tf32" : "", " m", g.m, " n",
                   g.n, " k", g.k, " t", g.trans_a, g.trans_b, " ld", g.lda, ",", g.ldb, ",", g.ldc, " batch",
                   g.batch, " stride", g.stride_a, ",", g.stride_b, ",", g.stride_c, g.bias ? " bias" : "",
                   g.relu ? " relu" : "");
}

namespace {

std::unique_ptr<VendorPlan> LtImpl::plan(const GemmCall& g, const VendorOptions& o, CUstream stream,
                                         const std::string& label) const {
  cudaDataType_t data;
  cudaDataType_t scale = CUDA_R_32F;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  switch (g.dtype) {
    case DType::F32:
      data = CUDA_R_32F;
      if (o.tf32) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
      break;
    case DType::F16:
      data = CUDA_R_16F;
      break;
    case DType::BF16:
      data = CUDA_R_16BF;
      break;
    case DType::F64:
      data = scale = CUDA_R_64F;
      compute = CUBLAS_COMPUTE_64F;
      break;
    default:
      return nullptr;
  }
  const std::size_t elem = dtype_size(g.dtype);
  // Stored (row-major) shapes: A is [m, k] or, transposed, [k, m]; B is [k, n] or [n, k].
  const std::int64_t a_cols = g.trans_a ? g.m : g.k, a_rows = g.trans_a ? g.k : g.m;
  const std::int64_t b_cols = g.trans_b ? g.k : g.n, b_rows = g.trans_b ? g.n : g.k;
  const std::int64_t int_max = std::numeric_limits<std::int32_t>::max();
  if (g.m <= 0 || g.n <= 0 || g.k <= 0 || g.batch < 1 || g.batch > int_max) return nullptr;
  if (g.lda < a_cols || g.ldb < b_cols || g.ldc < g.n) return nullptr;
  if (g.stride_a < 0 || g.stride_b < 0 || g.stride_c < 0) return nullptr;
  if (g.batch > 1 && g.stride_c < (g.m - 1) * g.ldc + g.n) return nullptr;  // output items would overlap
  if (!g.a || !g.b || !g.c) return nullptr;

  auto p = std::make_unique<LtPlan>(*this);
  p->a_ = g.b;
  p->b_ = g.a;
  p->c_ = g.c;
  p->f64_ = g.dtype == DType::F64;
  check(f_.cublasLtMatmulDescCreate(&p->op_, compute, scale), label, "cublasLtMatmulDescCreate");
  auto set_op = [&](cublasLtMatmulDescAttributes_t attr, const void* v, std::size_t n) {
    check(f_.cublasLtMatmulDescSetAttribute(p->op_, attr, v, n), label, "cublasLtMatmulDescSetAttribute");
  };
  // The column-major view of a stored row-major [r, c] matrix is [c, r] with the same stride, so
  // each operand keeps its own transpose flag.
  const std::int32_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const std::int32_t op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_op(CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a);
  set_op(CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b);
  // The bias of each row-major column is one per row of the column-major result.
  std::uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  if (g.bias)
    epilogue = g.relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
  else if (g.relu)
    epilogue = CUBLASLT_EPILOGUE_RELU;
  set_op(CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue);
  if (g.bias) {
    const void* bias = reinterpret_cast<const void*>(g.bias);
    set_op(CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
  }

  auto layout = [&](cublasLtMatrixLayout_t* l, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                    std::int64_t stride) {
    check(f_.cublasLtMatrixLayoutCreate(l, data, static_cast<std::uint64_t>(rows),
                                        static_cast<std::uint64_t>(cols), ld),
          label, "cublasLtMatrixLayoutCreate");
    if (g.batch == 1) return;
    const std::int32_t count = static_cast<std::int32_t>(g.batch);
    check(f_.cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count),
          label, "cublasLtMatrixLayoutSetAttribute");
    check(f_.cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                              sizeof stride),
          label, "cublasLtMatrixLayoutSetAttribute");
  };
  layout(&p->a_layout_, b_cols, b_rows, g.ldb, g.stride_b);
  layout(&p->b_layout_, a_cols, a_rows, g.lda, g.stride_a);
  layout(&p->c_layout_, g.n, g.m, g.ldc, g.stride_c);

  cublasLtMatmulPreference_t pref = nullptr;
  check(f_.cublasLtMatmulPreferenceCreate(&pref), label, "cublasLtMatmulPreferenceCreate");
  struct PrefGuard {
    const LtApi& f;
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { f.cublasLtMatmulPreferenceDestroy(p); }
  } pref_guard{f_, pref};
  auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, std::size_t n) {
    check(f_.cublasLtMatmulPreferenceSetAttribute(pref, attr, v, n), label,
          "cublasLtMatmulPreferenceSetAttribute");
  };
  const std::uint64_t max_ws = o.max_workspace_bytes;
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof max_ws);
  // The plan is for these addresses: tell the heuristic how they are aligned.
  const std::uint32_t align_a = alignment(p->a_, g.stride_b, g.batch, elem);
  const std::uint32_t align_b = alignment(p->b_, g.stride_a, g.batch, elem);
  const std::uint32_t align_c = alignment(p->c_, g.stride_c, g.batch, elem);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof align_a);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof align_b);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c, sizeof align_c);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c, sizeof align_c);

  cublasLtMatmulHeuristicResult_t results[8] = {};
  int found = 0;
  const cublasStatus_t hs = f_.cublasLtMatmulAlgoGetHeuristic(
      handle_, p->op_, p->a_layout_, p->b_layout_, p->c_layout_, p->c_layout_, pref, 8, results, &found);
  if (hs == CUBLAS_STATUS_NOT_SUPPORTED) return nullptr;
  check(hs, label, "cublasLtMatmulAlgoGetHeuristic");
  std::vector<const cublasLtMatmulHeuristicResult_t*> candidates;
  for (int i = 0; i < found; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= o.max_workspace_bytes)
      candidates.push_back(&results[i]);
  if (candidates.empty()) return nullptr;

  const cublasLtMatmulHeuristicResult_t* best = candidates.front();
  // A choice measured before on this device and library (keyed with the alignments this plan's
  // addresses allow), if the library still takes it for this call.
  const std::string scope = util::cat(o.device_scope, " cublasLt ", f_.cublasLtGetVersion());
  const std::string key =
      util::cat(tuning_key(g, o.tf32), " align", align_a, ",", align_b, ",", align_c);
  bool cached = false;
  if (o.cache)
    if (auto text = o.cache->find(scope, key))
      if (auto algo = parse_algo(*text)) {
        cublasLtMatmulHeuristicResult_t checked{};
        if (algo->second <= o.max_workspace_bytes &&
            f_.cublasLtMatmulAlgoCheck(handle_, p->op_, p->a_layout_, p->b_layout_, p->c_layout_, p->c_layout_,
                                       &algo->first, &checked) == CUBLAS_STATUS_SUCCESS &&
            checked.workspaceSize <= o.max_workspace_bytes) {
          results[0].algo = algo->first;
          results[0].workspaceSize = std::max(algo->second, checked.workspaceSize);
          best = &results[0];
          cached = true;
        }
      }
  if (!cached && o.tune && candidates.size() > 1) {
    std::size_t need = 1;
    for (const auto* c : candidates) need = std::max(need, c->workspaceSize);
    TuneScratch t{d_, stream};
    d_.check(d_.cuMemAlloc(&t.ws, need), label + " cuBLASLt tuning: cuMemAlloc of the workspace");
    d_.check(d_.cuEventCreate(&t.start, CU_EVENT_DEFAULT), label + " cuBLASLt tuning: cuEventCreate");
    d_.check(d_.cuEventCreate(&t.stop, CU_EVENT_DEFAULT), label + " cuBLASLt tuning: cuEventCreate");
    float best_ms = std::numeric_limits<float>::infinity();
    best = nullptr;
    for (const auto* c : candidates) {
      bool ok = true;
      for (int i = 0; i < 2 && ok; ++i)
        ok = p->enqueue(stream, t.ws, c->algo, c->workspaceSize) == CUBLAS_STATUS_SUCCESS;
      if (!ok) continue;  // an algorithm that refuses to run is not a candidate
      d_.check(d_.cuEventRecord(t.start, stream), label + " cuBLASLt tuning: cuEventRecord");
      for (int i = 0; i < 5 && ok; ++i)
        ok = p->enqueue(stream, t.ws, c->algo, c->workspaceSize) == CUBLAS_STATUS_SUCCESS;
      d_.check(d_.cuEventRecord(t.stop, stream), label + " cuBLASLt tuning: cuEventRecord");
      d_.check(d_.cuEventSynchronize(t.stop), label + " cuBLASLt tuning: cuEventSynchronize");
      float ms = 0;
      d_.check(d_.cuEventElapsedTime(&ms, t.start, t.stop), label + " cuBLASLt tuning: cuEventElapsedTime");
      if (ok && ms < best_ms) best_ms = ms, best = c;
    }
    if (!best) return nullptr;
  }
  p->algo_ = best->algo;
  p->workspace_ = best->workspaceSize;
  if (o.cache && o.tune && !cached) o.cache->store(scope, key, algo_text(p->algo_, p->workspace_));

  std::int32_t algo_id = -1;
  std::uint32_t tile = 0;
  std::size_t written = 0;
  f_.cublasLtMatmulAlgoConfigGetAttribute(&p->algo_, CUBLASLT_ALGO_CONFIG_ID, &algo_id, sizeof algo_id,
                                          &written);
  f_.cublasLtMatmulAlgoConfigGetAttribute(&p->algo_, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile,
                                          &written);
  p->description_ =
      util::cat("cublasLt ", dtype_name(g.dtype), g.dtype == DType::F32 && o.tf32 ? "/tf32" : "", " algo ",
                algo_id, " tile ", tile, cached ? " (tuned, cached)" : o.tune ? " (tuned)" : "", ", ",
                p->workspace_, " B workspace");
  return p;
}

struct LtLoaded {
  std::unique_ptr<LtImpl> impl;
  std::string reason;
};

LtLoaded load_lt() {
  LtLoaded l;
  const Driver* d = Driver::get();
  if (!d) {
    l.reason = "CUDA is not available: " + Driver::unavailable_reason();
    return l;
  }
  void* lib = ::dlopen("libcublasLt.so.13", RTLD_NOW | RTLD_LOCAL);
  const char* err = lib ? nullptr : ::dlerror();
  const std::string why = err ? err : "?";
  if (!lib) lib = ::dlopen("libcublasLt.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    l.reason = util::cat("cuBLASLt not found (libcublasLt.so.13 could not be opened: ", why, ")");
    return l;
  }
  LtApi f;
#define KG_RESOLVE(name)                                                       \
  f.name = reinterpret_cast<decltype(f.name)>(::dlsym(lib, #name));            \
  if (!f.name) {                                                               \
    l.reason = "cuBLASLt lacks " #name " (a library older than the headers?)"; \
    return l;                                                                  \
  }
  KG_CUBLASLT_FUNCTIONS(KG_RESOLVE)
#undef KG_RESOLVE
  const std::size_t version = f.cublasLtGetVersion();
  if (version / 10000 < CUBLAS_VER_MAJOR) {
    l.reason = util::cat("cuBLASLt ", version, " is too old (", CUBLAS_VER_MAJOR, ".x is needed)");
    return l;
  }
  cublasLtHandle_t h = nullptr;
  const cublasStatus_t s = f.cublasLtCreate(&h);
  if (s != CUBLAS_STATUS_SUCCESS) {
    const char* name = f.cublasLtGetStatusName(s);
    l.reason = util::cat("cublasLtCreate failed: ", name ? name : "unknown status");
    return l;
  }
  // The handle lives for the process: destroying it at exit may run after the driver is gone.
  l.impl = std::make_unique<LtImpl>(*d, f, h);
  return l;
}

const LtLoaded& lt_loaded() {
  static const LtLoaded l = load_lt();
  return l;
}

}  // namespace

const BlasLt* BlasLt::get() { return lt_loaded().impl.get(); }
const std::string& BlasLt::unavailable_reason() { return lt_loaded().reason; }

}  // namespace kg::cuda

#endif  // KG_HAVE_CUDA
