// The vectorised float and double functions of <kg/cpu_math.hpp> against SLEEF's (when the build
// found libsleef) and against glibc's scalar calls, over 4M elements on one thread.
//   cpu_math [--n 4194304] [Google Benchmark flags, e.g. --benchmark_filter=tanh]
// Each function is timed through each copy of apply()'s loop this CPU runs (AVX-512F, AVX2 +
// FMA, the portable baseline) and through SLEEF's AVX-512F and AVX2 entry points (u10 and, for
// tanh, u35; SLEEF has no sigmoid, so 1 / (1 + Sleef_exp(-x)) stands in). After Google
// Benchmark's own lines it prints one table: the minimum over the repetitions, in ns per element.
#include "kg/cpu_math.hpp"

#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace cm = kg::cpu_math;

#if defined(KG_BENCH_SLEEF) && defined(__x86_64__)
#define KG_BENCH_HAVE_SLEEF 1
// sleef.h declares its AVX2 and AVX-512 entry points only where the whole file is compiled for
// them (__AVX512F__), so the few used here are declared again, with target attributes.
#define KG_AVX512 [[gnu::target("avx512f")]]
#define KG_AVX2 [[gnu::target("avx2,fma")]]
extern "C" {
KG_AVX512 __m512 Sleef_expf16_u10avx512f(__m512);
KG_AVX512 __m512 Sleef_tanhf16_u10avx512f(__m512);
KG_AVX512 __m512 Sleef_tanhf16_u35avx512f(__m512);
KG_AVX512 __m512 Sleef_erfcf16_u15avx512f(__m512);
KG_AVX512 __m512d Sleef_expd8_u10avx512f(__m512d);
KG_AVX512 __m512d Sleef_tanhd8_u10avx512f(__m512d);
KG_AVX512 __m512d Sleef_tanhd8_u35avx512f(__m512d);
KG_AVX2 __m256 Sleef_expf8_u10avx2(__m256);
KG_AVX2 __m256 Sleef_tanhf8_u10avx2(__m256);
KG_AVX2 __m256 Sleef_tanhf8_u35avx2(__m256);
KG_AVX2 __m256 Sleef_erfcf8_u15avx2(__m256);
KG_AVX2 __m256d Sleef_expd4_u10avx2(__m256d);
KG_AVX2 __m256d Sleef_tanhd4_u10avx2(__m256d);
KG_AVX2 __m256d Sleef_tanhd4_u35avx2(__m256d);
}
#else
#define KG_BENCH_HAVE_SLEEF 0
#endif

namespace {

std::int64_t g_n = std::int64_t{1} << 22;  // elements per pass (4M)

// Random inputs in [lo, hi), made once per function and dtype.
template <class T>
const std::vector<T>& inputs(double lo, double hi) {
  static std::map<std::pair<double, double>, std::vector<T>> cache;
  std::vector<T>& v = cache[{lo, hi}];
  if (v.empty()) {
    std::mt19937_64 rng(12345);
    std::uniform_real_distribution<double> u(lo, hi);
    v.resize(static_cast<std::size_t>(g_n));
    for (T& e : v) e = static_cast<T>(u(rng));
  }
  return v;
}

// One pass: y = f(x) over all g_n elements.
template <class T>
using Pass = std::function<void(const T* x, T* y, std::int64_t n)>;

template <class T>
void run_pass(benchmark::State& state, const Pass<T>& pass, double lo, double hi) {
  const std::vector<T>& x = inputs<T>(lo, hi);
  std::vector<T> y(x.size());
  pass(x.data(), y.data(), g_n);  // warm: touches the output pages
  for (auto _ : state) {
    pass(x.data(), y.data(), g_n);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["ns_per_elem"] =
      benchmark::Counter(static_cast<double>(g_n) * 1e-9,
                         benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

// ---- ours: apply_n_on with one copy of the loop ----

template <class T, class F>
Pass<T> ours(cm::Isa isa, F f) {
  return [isa, f](const T* x, T* y, std::int64_t n) { cm::apply_n_on(isa, n, y, f, x); };
}

// ---- glibc: the scalar loop a custom op had before ----

template <class T, class F>
Pass<T> scalar(F f) {
  return [f](const T* x, T* y, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i) y[i] = f(x[i]);
  };
}

#if KG_BENCH_HAVE_SLEEF
// ---- SLEEF: one vector call per 16 / 8 / 4 elements (n is a multiple of 16) ----

using F16 = __m512 (*)(__m512);
using D8 = __m512d (*)(__m512d);
using F8 = __m256 (*)(__m256);
using D4 = __m256d (*)(__m256d);

template <F16 Fn, bool Sigmoid = false>
KG_AVX512 void sleef_f16(const float* x, float* y, std::int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (std::int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    if constexpr (Sigmoid)
      _mm512_storeu_ps(y + i,
                       _mm512_div_ps(one, _mm512_add_ps(one, Fn(_mm512_sub_ps(_mm512_setzero_ps(), v)))));
    else
      _mm512_storeu_ps(y + i, Fn(v));
  }
}
template <D8 Fn, bool Sigmoid = false>
KG_AVX512 void sleef_d8(const double* x, double* y, std::int64_t n) {
  const __m512d one = _mm512_set1_pd(1.0);
  for (std::int64_t i = 0; i < n; i += 8) {
    const __m512d v = _mm512_loadu_pd(x + i);
    if constexpr (Sigmoid)
      _mm512_storeu_pd(y + i,
                       _mm512_div_pd(one, _mm512_add_pd(one, Fn(_mm512_sub_pd(_mm512_setzero_pd(), v)))));
    else
      _mm512_storeu_pd(y + i, Fn(v));
  }
}
template <F8 Fn, bool Sigmoid = false>
KG_AVX2 void sleef_f8(const float* x, float* y, std::int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (std::int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if constexpr (Sigmoid)
      _mm256_storeu_ps(y + i,
                       _mm256_div_ps(one, _mm256_add_ps(one, Fn(_mm256_sub_ps(_mm256_setzero_ps(), v)))));
    else
      _mm256_storeu_ps(y + i, Fn(v));
  }
}
template <D4 Fn, bool Sigmoid = false>
KG_AVX2 void sleef_d4(const double* x, double* y, std::int64_t n) {
  const __m256d one = _mm256_set1_pd(1.0);
  for (std::int64_t i = 0; i < n; i += 4) {
    const __m256d v = _mm256_loadu_pd(x + i);
    if constexpr (Sigmoid)
      _mm256_storeu_pd(y + i,
                       _mm256_div_pd(one, _mm256_add_pd(one, Fn(_mm256_sub_pd(_mm256_setzero_pd(), v)))));
    else
      _mm256_storeu_pd(y + i, Fn(v));
  }
}
#endif

// ---- the table ----

struct Row {
  std::string function;              // "tanh/f32"
  std::map<std::string, double> ns;  // implementation -> ns per element
};
std::vector<Row> g_rows;
std::vector<std::string> g_columns;  // implementations, in order of first appearance

// Forwards to the console and keeps the "min" aggregate of every benchmark for the table.
class TableReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      const bool single = r.repetitions <= 1 && r.run_type == Run::RT_Iteration;
      // (No error field: its name differs between Google Benchmark versions; a failed run has no
      // iterations.)
      if (r.iterations <= 0 || !(single || (r.run_type == Run::RT_Aggregate && r.aggregate_name == "min")))
        continue;
      // name: function/dtype/implementation
      const std::string name = r.run_name.function_name;
      const auto b = name.rfind('/');
      const std::string fn = name.substr(0, b), impl = name.substr(b + 1);
      const double ns =
          r.real_accumulated_time / static_cast<double>(r.iterations) / static_cast<double>(g_n) * 1e9;
      auto row = std::find_if(g_rows.begin(), g_rows.end(), [&](const Row& x) { return x.function == fn; });
      if (row == g_rows.end()) row = g_rows.insert(g_rows.end(), Row{fn, {}});
      row->ns[impl] = ns;
      if (std::find(g_columns.begin(), g_columns.end(), impl) == g_columns.end()) g_columns.push_back(impl);
    }
  }
  void Finalize() override {
    ConsoleReporter::Finalize();
    std::printf("\nns per element, %lld elements, one thread (minimum of the repetitions):\n\n| function |",
                static_cast<long long>(g_n));
    for (const std::string& c : g_columns) std::printf(" %s |", c.c_str());
    std::printf("\n| --- |");
    for (std::size_t i = 0; i < g_columns.size(); ++i) std::printf(" ---: |");
    std::printf("\n");
    for (const Row& r : g_rows) {
      std::printf("| %s |", r.function.c_str());
      for (const std::string& c : g_columns) {
        const auto it = r.ns.find(c);
        if (it == r.ns.end())
          std::printf(" |");
        else
          std::printf(" %.3f |", it->second);
      }
      std::printf("\n");
    }
  }
};

template <class T>
void add(const std::string& name, Pass<T> pass, double lo, double hi) {
  benchmark::RegisterBenchmark(name.c_str(),
                               [pass, lo, hi](benchmark::State& s) { run_pass<T>(s, pass, lo, hi); })
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime()
      ->ComputeStatistics("min",
                          [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); });
}

// Ours in every copy of the loop the CPU runs, and glibc's scalar call.
template <class T, class F, class G>
void add_ours(const std::string& fn, F f, G libm, double lo, double hi) {
  const std::string dt = sizeof(T) == 4 ? "/f32" : "/f64";
  const cm::Isa best = cm::isa();
  if (best == cm::Isa::Avx512) add<T>(fn + dt + "/ours-avx512", ours<T>(cm::Isa::Avx512, f), lo, hi);
  if (best != cm::Isa::Baseline) add<T>(fn + dt + "/ours-avx2", ours<T>(cm::Isa::Avx2, f), lo, hi);
  add<T>(fn + dt + "/ours-baseline", ours<T>(cm::Isa::Baseline, f), lo, hi);
  add<T>(fn + dt + "/libm-scalar", scalar<T>(libm), lo, hi);
}

void register_all() {
  const cm::Isa best = cm::isa();
  const bool avx512 = best == cm::Isa::Avx512, avx2 = best != cm::Isa::Baseline;
  (void)avx512;
  (void)avx2;
  // exp
  add_ours<float>(
      "exp", [](float v) { return cm::exp(v); }, [](float v) { return std::exp(v); }, -87.0, 88.0);
#if KG_BENCH_HAVE_SLEEF
  if (avx512) add<float>("exp/f32/sleef-avx512-u10", sleef_f16<Sleef_expf16_u10avx512f>, -87.0, 88.0);
  if (avx2) add<float>("exp/f32/sleef-avx2-u10", sleef_f8<Sleef_expf8_u10avx2>, -87.0, 88.0);
#endif
  add_ours<double>(
      "exp", [](double v) { return cm::exp(v); }, [](double v) { return std::exp(v); }, -700.0, 700.0);
#if KG_BENCH_HAVE_SLEEF
  if (avx512) add<double>("exp/f64/sleef-avx512-u10", sleef_d8<Sleef_expd8_u10avx512f>, -700.0, 700.0);
  if (avx2) add<double>("exp/f64/sleef-avx2-u10", sleef_d4<Sleef_expd4_u10avx2>, -700.0, 700.0);
#endif
  // tanh
  add_ours<float>(
      "tanh", [](float v) { return cm::tanh(v); }, [](float v) { return std::tanh(v); }, -10.0, 10.0);
#if KG_BENCH_HAVE_SLEEF
  if (avx512) add<float>("tanh/f32/sleef-avx512-u10", sleef_f16<Sleef_tanhf16_u10avx512f>, -10.0, 10.0);
  if (avx512) add<float>("tanh/f32/sleef-avx512-u35", sleef_f16<Sleef_tanhf16_u35avx512f>, -10.0, 10.0);
  if (avx2) add<float>("tanh/f32/sleef-avx2-u10", sleef_f8<Sleef_tanhf8_u10avx2>, -10.0, 10.0);
  if (avx2) add<float>("tanh/f32/sleef-avx2-u35", sleef_f8<Sleef_tanhf8_u35avx2>, -10.0, 10.0);
#endif
  add_ours<double>(
      "tanh", [](double v) { return cm::tanh(v); }, [](double v) { return std::tanh(v); }, -10.0, 10.0);
#if KG_BENCH_HAVE_SLEEF
  if (avx512) add<double>("tanh/f64/sleef-avx512-u10", sleef_d8<Sleef_tanhd8_u10avx512f>, -10.0, 10.0);
  if (avx512) add<double>("tanh/f64/sleef-avx512-u35", sleef_d8<Sleef_tanhd8_u35avx512f>, -10.0, 10.0);
  if (avx2) add<double>("tanh/f64/sleef-avx2-u10", sleef_d4<Sleef_tanhd4_u10avx2>, -10.0, 10.0);
  if (avx2) add<double>("tanh/f64/sleef-avx2-u35", sleef_d4<Sleef_tanhd4_u35avx2>, -10.0, 10.0);
#endif
  // sigmoid (SLEEF: 1 / (1 + exp(-x)) with its exp)
  add_ours<float>(
      "sigmoid", [](float v) { return cm::sigmoid(v); }, [](float v) { return 1.0f / (1.0f + std::exp(-v)); },
      -20.0, 20.0);
#if KG_BENCH_HAVE_SLEEF
  if (avx512)
    add<float>("sigmoid/f32/sleef-avx512-u10", sleef_f16<Sleef_expf16_u10avx512f, true>, -20.0, 20.0);
  if (avx2) add<float>("sigmoid/f32/sleef-avx2-u10", sleef_f8<Sleef_expf8_u10avx2, true>, -20.0, 20.0);
#endif
  add_ours<double>(
      "sigmoid", [](double v) { return cm::sigmoid(v); }, [](double v) { return 1.0 / (1.0 + std::exp(-v)); },
      -20.0, 20.0);
#if KG_BENCH_HAVE_SLEEF
  if (avx512)
    add<double>("sigmoid/f64/sleef-avx512-u10", sleef_d8<Sleef_expd8_u10avx512f, true>, -20.0, 20.0);
  if (avx2) add<double>("sigmoid/f64/sleef-avx2-u10", sleef_d4<Sleef_expd4_u10avx2, true>, -20.0, 20.0);
#endif
  // erfc (SLEEF's is u15)
  add_ours<float>(
      "erfc", [](float v) { return cm::erfc(v); }, [](float v) { return std::erfc(v); }, -5.0, 10.0);
#if KG_BENCH_HAVE_SLEEF
  if (avx512) add<float>("erfc/f32/sleef-avx512-u15", sleef_f16<Sleef_erfcf16_u15avx512f>, -5.0, 10.0);
  if (avx2) add<float>("erfc/f32/sleef-avx2-u15", sleef_f8<Sleef_erfcf8_u15avx2>, -5.0, 10.0);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  // --n N before the Google Benchmark flags; a multiple of 16 keeps SLEEF's loops simple.
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (i > 0 && std::strcmp(argv[i], "--n") == 0 && i + 1 < argc) {
      const long long n = std::atoll(argv[++i]);
      if (n < 16 || n % 16 != 0) {
        std::fprintf(stderr, "cpu_math: --n wants a positive multiple of 16, got %s\n", argv[i]);
        return 2;
      }
      g_n = n;
    } else {
      rest.push_back(argv[i]);
    }
  }
  int rc = static_cast<int>(rest.size());
  // Five repetitions unless the command line says otherwise; the table takes their minimum.
  std::vector<std::string> defaults = {"--benchmark_repetitions=5",
                                       "--benchmark_report_aggregates_only=true"};
  std::vector<char*> args(rest.begin(), rest.begin() + 1);
  for (std::string& d : defaults) args.push_back(d.data());
  args.insert(args.end(), rest.begin() + 1, rest.end());
  rc = static_cast<int>(args.size());
  benchmark::Initialize(&rc, args.data());
  if (benchmark::ReportUnrecognizedArguments(rc, args.data())) return 2;
  std::printf("kernelgraph cpu_math: widest copy of apply()'s loop on this CPU: %s; SLEEF %s\n",
              cm::isa() == cm::Isa::Avx512 ? "AVX-512F"
              : cm::isa() == cm::Isa::Avx2 ? "AVX2+FMA"
                                           : "baseline",
              KG_BENCH_HAVE_SLEEF ? "linked" : "not built in (libsleef-dev not found)");
  register_all();
  TableReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
