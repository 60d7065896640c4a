#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <span>
#include <sstream>
#include <typeinfo>
#include <utility>

#include "backend/emu/executor.hpp"
#include "graph/no_cpu_impl.hpp"
#include "kg/error.hpp"
#include "kg/model.hpp"
#include "kg/runtime_op.hpp"
#include "kg/testing.hpp"
#include "lower/lowering.hpp"
#include "ops/fused_elementwise.hpp"
#include "testing/check_util.hpp"
#include "util/str.hpp"

namespace kg::testing {
namespace {

using namespace detail;

std::string shapes_text(const std::vector<Shape>& shapes, const std::vector<DType>& dtypes) {
  std::vector<std::string> t;
  for (std::size_t i = 0; i < shapes.size(); ++i)
    t.push_back(util::cat(shapes[i].to_string(), " ", dtype_name(dtypes[i])));
  return util::join(t, ", ");
}

std::string sizes_text(const std::vector<std::vector<std::int64_t>>& shapes) {
  std::vector<std::string> t;
  for (const auto& s : shapes) t.push_back(sizes_to_string(s));
  return util::join(t, ", ");
}

// The concrete output shape against the one recorded: rank, static dims, and dims named by a
// symbol that an input also carries (bound to the batch size).
std::string shape_mismatch(const Shape& declared, const std::vector<std::int64_t>& got, std::int64_t batch,
                           const std::vector<Shape>& inputs) {
  if (declared.rank() != got.size())
    return util::cat("rank ", got.size(), " but ", declared.rank(), " was declared at record time");
  for (std::size_t d = 0; d < got.size(); ++d) {
    const Dim& dim = declared[d];
    if (dim.is_static() && dim.size() != got[d])
      return util::cat("dim ", d, " is ", got[d], " but ", dim.size(), " was declared at record time");
    if (dim.is_dynamic() && !dim.symbol().empty()) {
      bool bound = false;
      for (const auto& s : inputs)
        for (const auto& in_dim : s)
          bound = bound || (in_dim.is_dynamic() && in_dim.symbol() == dim.symbol());
      if (bound && got[d] != batch)
        return util::cat("dim ", d, " is ", got[d], " but it was declared '", dim.symbol(), "', which is ",
                         batch);
    }
  }
  return "";
}


// The op's elementwise form run on the CPU over `inputs` broadcast to `out_shape` (numpy rules),
// in its compute type (f64 for an f64 output, else f32), as the fusion pass runs it.
Tensor run_elementwise_form(const ElementwiseForm& form, const std::vector<Tensor>& inputs,
                            const std::vector<std::int64_t>& out_shape, DType out_dtype) {
  if (!form.cpu) throw Error("elementwise_form() has no CPU form (ElementwiseForm::cpu)");
  const DType compute = out_dtype == DType::F64 ? DType::F64 : DType::F32;
  const std::int64_t n = numel_of(out_shape);
  std::vector<Tensor> wide;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const auto& shape = inputs[k].shape();
    if (shape.size() > out_shape.size())
      throw Error(util::cat("input ", k, " ", sizes_to_string(shape), " has more dims than the output ",
                            sizes_to_string(out_shape), ": not an elementwise op"));
    const std::size_t lead = out_shape.size() - shape.size();
    for (std::size_t d = 0; d < shape.size(); ++d)
      if (shape[d] != 1 && shape[d] != out_shape[lead + d])
        throw Error(util::cat("input ", k, " ", sizes_to_string(shape), " does not broadcast to the output ",
                              sizes_to_string(out_shape), ": not an elementwise op"));
    Tensor b = Tensor::empty(DType::F64, out_shape);
    double* v = b.data<double>();
    for (std::int64_t i = 0; i < n; ++i) {
      std::int64_t rest = i, src = 0, stride = 1;
      for (std::size_t d = out_shape.size(); d-- > 0;) {
        const std::int64_t at = out_shape[d] ? rest % out_shape[d] : 0;
        rest = out_shape[d] ? rest / out_shape[d] : 0;
        if (d >= lead) {
          const std::int64_t size = shape[d - lead];
          src += (size == 1 ? 0 : at) * stride;
          stride *= size;
        }
      }
      v[i] = inputs[k].item(src);
    }
    wide.push_back(b.to(compute));
  }
  Tensor result = Tensor::empty(compute, out_shape);
  std::vector<const void*> ptrs;
  for (const auto& w : wide) ptrs.push_back(w.raw());
  ElementwiseSpan span;
  span.dtype = compute;
  span.inputs = std::span<const void* const>(ptrs.data(), ptrs.size());
  span.result = result.raw();
  span.n = n;
  form.cpu(span);
  return result;
}

}  // namespace

std::string CheckOpReport::to_string() const {
  int failed = 0, passed = 0, skipped = 0;
  for (const auto& l : lines) {
    failed += l.rfind("FAIL", 0) == 0;
    passed += l.rfind("PASS", 0) == 0;
    skipped += l.rfind("SKIP", 0) == 0;
  }
  // The worst result heads the report: a failure line, or `ok` false, is FAILED.
  const bool bad = !ok || failed > 0;
  std::string s = util::cat(check.empty() ? "check_op" : check, ": ", bad ? "FAILED" : "ok", " (",
                            failed > 0 ? util::cat(failed, " failed, ") : "", passed, " passed, ", skipped,
                            " skipped)\n");
  for (const auto& l : lines) s += "  " + l + "\n";
  return s;
}

namespace {

void run_checks(CheckOpReport& report, const CustomData& op, const std::vector<Shape>& input_shapes,
                const std::vector<DType>& dtypes, const CheckOpOptions& o) {
  Reporter rep(report, "[" + op.name() + "]");
  const std::uint64_t seed =
      o.seed != 0 ? o.seed : (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  rep.info(util::cat("op ", op.name(), ", seed ", seed, " (CheckOpOptions::seed reproduces this run)"));
  if (input_shapes.size() != dtypes.size()) {
    rep.fail("setup",
             util::cat("check_op: ", input_shapes.size(), " input shapes but ", dtypes.size(), " dtypes"));
    return;
  }

  // Record the op on symbolic inputs.
  auto graph = Graph::create();
  std::optional<Model> model;
  int node_id = -1;
  if (!rep.guard("record", [&] {
        std::vector<SymTensor> xs;
        for (std::size_t i = 0; i < input_shapes.size(); ++i)
          xs.push_back(graph->input(dtypes[i], input_shapes[i], util::cat("x", i)));
        SymTensor y = graph->record(op, xs);
        rep.set_label(graph->node(y.node()).label());
        model.emplace(graph, std::vector<SymTensor>{y});
        node_id = model->outputs().at(0).second;
        std::vector<std::string> ps;
        for (const auto& p : graph->node(y.node()).params)
          ps.push_back(util::cat(p.name.substr(p.name.rfind('.') + 1), " ", sizes_to_string(p.shape), " ",
                                 dtype_name(p.dtype)));
        rep.pass("record", util::cat("inputs ", shapes_text(input_shapes, dtypes), " -> output ",
                                     y.shape().to_string(), " ", dtype_name(y.dtype()),
                                     ps.empty() ? "" : "; parameters " + util::join(ps, ", ")));
      }))
    return;
  const Node& node = model->graph().node(node_id);

  std::optional<Lowered> lowered;
  const LowerContext lower_ctx = lower::lower_context(*model, node_id, {});
  if (!op->is_view()) {
    if (!rep.guard("lower", [&] { lowered = op->lower(lower_ctx); })) return;
    if (lowered && !lowered->runtime_op) {
      rep.fail("lower", "lower() returned no RuntimeOp");
      return;
    }
  }

  std::mt19937_64 rng(seed);
  bool cpu_missing_noted = false;
  std::optional<ElementwiseForm> form;
  if (!op->is_view()) rep.guard("elementwise form", [&] { form = op->elementwise_form(dtypes); });
  for (const std::int64_t batch : o.batch_sizes) {
    const std::string at = util::cat("batch ", batch);
    // The checks of one batch, in order; after a failure that stops the batch, each later one is
    // a SKIP line saying why, so that every check has its line.
    const std::vector<std::string> stages = {"shape",    "cpu_forward", "elementwise form", "elementwise form, emulator",
                                             "emulator", "gpu"};
    auto skip_from = [&](const std::string& stage, const std::string& why) {
      bool on = false;
      for (const auto& st : stages) {
        on = on || st == stage;
        if (!on) continue;
        if (st.rfind("elementwise form", 0) == 0 && !form) continue;
        rep.skip(at + ", " + st, "not run: " + why);
      }
    };
    if (batch < 0) {
      rep.fail(at, util::cat("batch size ", batch, " is negative"));
      continue;
    }
    // Concrete shapes and inputs.
    std::vector<std::vector<std::int64_t>> shapes;
    std::vector<Shape> concrete;
    for (const auto& s : input_shapes) {
      std::vector<std::int64_t> v;
      for (const auto& d : s) v.push_back(d.is_dynamic() ? batch : d.size());
      shapes.push_back(v);
      concrete.push_back(Shape::of(v));
    }
    std::vector<Tensor> inputs;
    if (!rep.guard(at + ", inputs", [&] {
          for (std::size_t i = 0; i < shapes.size(); ++i) {
            Tensor t = o.make_input ? o.make_input(static_cast<int>(i), shapes[i])
                                    : random_input(rng, dtypes[i], shapes[i]);
            if (t.shape() != shapes[i] || t.dtype() != dtypes[i])
              throw Error(util::cat("CheckOpOptions::make_input(", i, ", ", sizes_to_string(shapes[i]),
                                    ") returned ", sizes_to_string(t.shape()), " ", dtype_name(t.dtype()),
                                    "; the input is ", sizes_to_string(shapes[i]), " ",
                                    dtype_name(dtypes[i])));
            inputs.push_back(t);
          }
        })) {
      skip_from("shape", "the inputs could not be made (above)");
      continue;
    }

    // Shape inference with concrete sizes, against the record and the kernel.
    std::vector<std::int64_t> out_shape;
    if (!rep.guard(at + ", shape", [&] {
          Shape inferred = op->infer_output_shape(concrete);
          if (!inferred.is_concrete())
            throw Error(util::cat("infer_output_shape gives ", inferred.to_string(), " for inputs ",
                                  sizes_text(shapes), ": a dynamic dim although every input size is known"));
          out_shape = inferred.sizes();
          if (auto why = shape_mismatch(node.shape, out_shape, batch, input_shapes); !why.empty())
            throw Error(util::cat("infer_output_shape gives ", sizes_to_string(out_shape), " for inputs ",
                                  sizes_text(shapes), ": ", why, " (", node.shape.to_string(), ")"));
          rep.pass(at + ", shape",
                   util::cat("inputs ", sizes_text(shapes), " -> ", sizes_to_string(out_shape), " (declared ",
                             node.shape.to_string(), ")"));
        })) {
      skip_from("cpu_forward", "the output shape is not known (the shape check failed above)");
      continue;
    }

    // The CPU: loaded through the runtime (parameters initialised), then cpu_forward called
    // directly on outputs poisoned with 0xFF bytes (NaN) and, on reruns, with zero bytes, each
    // followed by canary bytes that must survive.
    std::optional<LoadedModel> cpu;
    std::map<std::string, Tensor> params;
    if (!rep.guard(at + ", cpu", [&] {
          LoadOptions lo;
          lo.poison_buffers = true;
          cpu.emplace(model->load(Device::cpu(), shapes, lo));
          params = cpu->state_dict();
        })) {
      skip_from("cpu_forward", "the model did not load on the cpu (above)");
      continue;
    }
    Tensor want;
    bool have_cpu = true;
    if (op->is_view()) {
      rep.guard(at + ", cpu", [&] {
        want = cpu->forward(inputs).at(0);
        rep.pass(at + ", cpu", "a view of its input (no kernel)");
      });
      continue;
    }
    const std::string where = at + ", cpu_forward";
    bool cpu_failed = false;
    try {
      std::vector<Tensor> ps;
      for (const auto& spec : node.params) ps.push_back(params.at(spec.name));
      std::vector<Tensor> runs;
      constexpr std::size_t kCanary = 64;
      for (int k = 0; k <= std::max(o.reruns, 0) && have_cpu; ++k) {
        const std::size_t bytes = static_cast<std::size_t>(numel_of(out_shape)) * dtype_size(node.dtype);
        auto mem = std::shared_ptr<std::byte[]>(new std::byte[bytes + kCanary + 64]);
        auto* data = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(mem.get()) + 63) &
                                                  ~std::uintptr_t(63));
        std::memset(data, k % 2 == 0 ? 0xFF : 0x00, bytes);
        std::memset(data + bytes, 0xC3, kCanary);
        Tensor out = Tensor::wrap(std::shared_ptr<void>(mem, mem.get()), data, node.dtype, out_shape);
        CpuContext ctx(inputs, ps, out, false, seed);
        op->cpu_forward(ctx);
        for (std::size_t b = 0; b < kCanary; ++b)
          if (static_cast<unsigned char>(data[bytes + b]) != 0xC3)
            throw Error(util::cat("cpu_forward wrote past the end of its output ", sizes_to_string(out_shape), " ",
                                  dtype_name(node.dtype), " (", bytes, " bytes): byte ", b,
                                  " after the end was changed; is the output smaller than what it writes?"));
        runs.push_back(out);
      }
      want = runs.front();
      std::int64_t first = -1;
      const std::int64_t unwritten = count_nan(want, &first);
      bool good = true;
      if (unwritten > 0) {
        rep.fail(where, util::cat("cpu_forward left ", unwritten, " of ", want.numel(),
                                  " output elements unwritten (NaN in a NaN-poisoned output; first at ",
                                  index_text(first, out_shape), ")"));
        good = false;
      }
      for (std::size_t k = 1; k < runs.size() && good; ++k) {
        const std::int64_t i = first_byte_difference(runs[k], want);
        if (i < 0) continue;
        good = false;
        if (all_bytes(want, i, 0xFF) && all_bytes(runs[k], i, 0x00))
          rep.fail(where, util::cat("cpu_forward leaves output element ", index_text(i, out_shape),
                                    " unwritten (it keeps the poison bytes 0xFF and 0x00 of two runs)"));
        else
          rep.fail(where, util::cat("rerun ", k, " differs from the first run at ", index_text(i, out_shape),
                                    ": ", num(runs[k].item(i)), " vs ", num(want.item(i)),
                                    " (the same inputs must give bitwise-equal results)"));
      }
      if (good)
        rep.pass(
            where,
            util::cat("every one of ", want.numel(), " elements written, nothing past the end",
                      runs.size() > 1 ? util::cat(", ", runs.size() - 1, " rerun(s) bitwise equal") : ""));
      cpu_failed = !good;
    } catch (const NoCpuImplementation&) {
      have_cpu = false;
    } catch (const Error& e) {
      rep.fail(where, e.what());
      cpu_failed = true;
    } catch (const std::exception& e) {
      rep.fail(where, util::cat("cpu_forward threw ", typeid(e).name(), ": ", e.what()));
      cpu_failed = true;
    }
    std::string ref = "the CPU";
    if (!have_cpu) {
      if (!cpu_missing_noted)
        rep.skip("cpu_forward",
                 "the op has no CPU implementation; the cpu device runs its kernel through the "
                 "emulator, and the other paths are compared with that run");
      cpu_missing_noted = true;
      if (!rep.guard(at + ", cpu device", [&] {
            want = cpu->forward(inputs).at(0);
            std::int64_t first = -1;
            if (const std::int64_t n = count_nan(want, &first); n > 0)
              throw Error(util::cat("the emulated kernel left ", n, " of ", want.numel(),
                                    " output elements unwritten (first at ", index_text(first, out_shape),
                                    ")"));
            rep.pass(at + ", cpu device",
                     util::cat("emulated kernel (guarded buffers) wrote every one of ", want.numel(), " elements"));
          }))
        cpu_failed = true;
      ref = "the cpu device";
    }

    // The user's reference, when given: the CPU (or the emulated kernel) is compared with it, and
    // the other paths with the CPU. When the CPU failed, the other paths are compared with the
    // reference instead.
    std::optional<Tensor> baseline;
    if (!cpu_failed) baseline = want;
    if (o.reference) {
      Tensor r;
      const bool made = rep.guard(at + ", reference", [&] {
        std::map<std::string, Tensor> short_params;
        for (const auto& spec : node.params)
          short_params[spec.name.substr(node.name.size() + 1)] = params.at(spec.name);
        r = o.reference(inputs, short_params);
        if (r.shape() != out_shape)
          throw Error(util::cat("CheckOpOptions::reference returned ", sizes_to_string(r.shape()),
                                " but the output is ", sizes_to_string(out_shape)));
        r = r.to(node.dtype);
        if (cpu_failed) {
          rep.skip(at + ", reference",
                   util::cat("not compared with ", ref, ", which failed above; the other paths are compared with the "
                             "reference instead"));
          return;
        }
        const Comparison c = compare(want, r, o.rtol, o.atol, ref, "the reference");
        if (!c.ok) throw Error(c.text);
        rep.pass(at + ", reference", c.text);
      });
      if (made && cpu_failed) {
        baseline = r;
        ref = "the reference";
      }
    } else if (!have_cpu && batch == o.batch_sizes.front()) {
      rep.skip("reference",
               "the op has no CPU implementation and no CheckOpOptions::reference: the emulated and GPU "
               "runs are compared with each other only, not with an independent value");
    }
    const std::string not_compared =
        util::cat("; not compared: ", ref, " failed above and there is no CheckOpOptions::reference");

    // The elementwise form (what the fusion pass runs in the op's place) against the op's result.
    if (form) {
      const std::string ew_at = at + ", elementwise form";
      if (!baseline) {
        rep.skip(ew_at, util::cat("not run: ", ref, " failed above and there is no reference to compare with"));
      } else {
        rep.guard(ew_at, [&] {
          const Tensor got = run_elementwise_form(*form, inputs, out_shape, node.dtype);
          const Comparison c = compare(got.to(node.dtype), *baseline, o.rtol, o.atol,
                                       "the op's elementwise_form (what the fusion pass runs in its place)", ref);
          if (!c.ok) throw Error(c.text);
          rep.pass(ew_at, c.text);
        });
      }
      // Its device form, in the kernel the fusion pass generates for a group of this one op, run
      // by the emulator in checked mode.
      const std::string ewk_at = at + ", elementwise form, emulator";
      if (!o.emulate) {
        rep.skip(ewk_at, "off (CheckOpOptions::emulate)");
      } else if (!baseline) {
        rep.skip(ewk_at, util::cat("not run: ", ref, " failed above and there is no reference to compare with"));
      } else if (form->function.empty()) {
        rep.skip(ewk_at, "the elementwise form has no device function (ElementwiseForm::function)");
      } else {
        rep.guard(ewk_at, [&] {
          auto g = Graph::create();
          std::vector<SymTensor> xs;
          ops::FusedMember m{node.name, op, *form, {}};
          for (std::size_t i = 0; i < shapes.size(); ++i) {
            xs.push_back(g->input(dtypes[i], Shape::of(shapes[i]), util::cat("x", i)));
            m.args.push_back(-1 - static_cast<int>(i));
          }
          const CustomData fused = CustomData::make<ops::FusedElementwiseOp>(
              std::vector<ops::FusedMember>{m}, static_cast<int>(shapes.size()), node.dtype, LoweringMode::Inference);
          const SymTensor y = g->record(fused, xs, std::nullopt, node.name);
          const Model fm(g, std::vector<SymTensor>{y});
          const Tensor got = emu::run_model(fm, inputs, {}, /*checked=*/true).at(0);
          const Comparison c = compare(got, *baseline, o.rtol, o.atol,
                                       "the fused kernel of the op's elementwise_form (checked mode)", ref);
          if (!c.ok) throw Error(c.text);
          rep.pass(ewk_at, c.text);
        });
      }
    }

    // The lowered kernel through the emulator, checked, then reruns.
    bool emulator_failed = false;
    const std::string emu_at = at + ", emulator";
    if (!o.emulate) {
      rep.skip(emu_at, "off (CheckOpOptions::emulate)");
    } else if (!lowered) {
      rep.skip(emu_at, "the op has no lowering (CustomOp::lower() returns nothing)");
    } else {
      emulator_failed = !rep.guard(emu_at, [&] {
        Tensor got = emu::run_model(*model, inputs, params, /*checked=*/true).at(0);
        std::int64_t first = -1;
        if (const std::int64_t n = count_nan(got, &first); n > 0 && (!baseline || count_nan(*baseline, &first) == 0))
          throw Error(util::cat("the kernel left ", n, " of ", got.numel(),
                                " output elements unwritten (NaN in a "
                                "NaN-filled buffer; first at ",
                                index_text(first, out_shape), ")"));
        std::string text = "checked run: no fault, race or unwritten element" + not_compared;
        if (baseline) {
          const Comparison c = compare(got, *baseline, o.rtol, o.atol, "the emulated kernel (checked mode)", ref);
          if (!c.ok) throw Error(c.text);
          text = c.text;
        }
        for (int k = 1; k <= o.reruns; ++k) {
          Tensor again = emu::run_model(*model, inputs, params, /*checked=*/false).at(0);
          if (const std::int64_t i = first_byte_difference(again, got); i >= 0)
            throw Error(util::cat("emulated rerun ", k, " differs from the first run at ",
                                  index_text(i, out_shape), ": ", num(again.item(i)), " vs ",
                                  num(got.item(i)), " (the same inputs must give bitwise-equal results)"));
        }
        rep.pass(emu_at, text + (o.reruns > 0 ? util::cat("; ", o.reruns, " rerun(s) bitwise equal") : ""));
      });
    }

    // The GPU.
    const std::string gpu_at = at + ", gpu";
    if (!o.gpu) {
      rep.skip(gpu_at, "off (CheckOpOptions::gpu)");
    } else if (!lowered) {
      rep.skip(gpu_at, "the op has no lowering (CustomOp::lower() returns nothing)");
    } else if (!Device::cuda_available()) {
      rep.skip(gpu_at, "no usable GPU on this machine");
    } else if (emulator_failed) {
      // A kernel that faults on a GPU leaves the CUDA context unusable for the rest of the process.
      rep.skip(gpu_at, "not run: the emulator found the kernel broken (see above)");
    } else if (const std::string why = gpu_unusable(); !why.empty()) {
      rep.skip(gpu_at, why);
    } else {
      bool gpu_faulted = false;
      rep.guard(gpu_at, [&] {
        with_gpu_fault_note(gpu_faulted, [&] {
          LoadOptions lo;
          lo.poison_buffers = true;
          lo.checked = true;  // a fault or a stray write is reported against the op
          LoadedModel gpu = model->load(Device::cuda(), shapes, lo);
          gpu.load_state_dict(params, false);
          Tensor got = gpu.forward(inputs).at(0);
          std::int64_t first = -1;
          if (const std::int64_t n = count_nan(got, &first); n > 0 && (!baseline || count_nan(*baseline, &first) == 0))
            throw Error(util::cat("the kernel left ", n, " of ", got.numel(),
                                  " output elements unwritten on the GPU (first at ",
                                  index_text(first, out_shape), ")"));
          std::string text = "checked run: no fault or unwritten element" + not_compared;
          if (baseline) {
            const Comparison c = compare(got, *baseline, o.rtol, o.atol, "the GPU", ref);
            if (!c.ok) throw Error(c.text);
            text = c.text;
          }
          for (int k = 1; k <= o.reruns; ++k) {
            Tensor again = gpu.forward(inputs).at(0);
            if (const std::int64_t i = first_byte_difference(again, got); i >= 0)
              throw Error(util::cat("GPU rerun ", k, " differs from the first run at ",
                                    index_text(i, out_shape), ": ", num(again.item(i)), " vs ",
                                    num(got.item(i)), " (the same inputs must give bitwise-equal results)"));
          }
          rep.pass(gpu_at, text + (o.reruns > 0 ? util::cat("; ", o.reruns, " rerun(s) bitwise equal") : ""));
        });
      });
    }
  }

  // The backward, at the largest batch size.
  if (op->is_view()) {
    rep.skip("gradient check", "a view op: the runtime aliases its gradient (no backward)");
  } else if (!op->has_cpu_backward() && !(lowered && !op->lower_backward_source(lower_ctx).empty())) {
    rep.skip("gradient check", "the op has no backward (no CPU backward, lower_backward_source() is empty)");
  } else {
    std::int64_t batch = 1;
    for (const std::int64_t b : o.batch_sizes) batch = std::max(batch, b);
    std::vector<std::vector<std::int64_t>> shapes;
    for (const auto& s : input_shapes) {
      std::vector<std::int64_t> v;
      for (const auto& d : s) v.push_back(d.is_dynamic() ? batch : d.size());
      shapes.push_back(v);
    }
    GradCheckOptions g;
    g.seed = seed;
    g.emulate = o.emulate;
    g.gpu = o.gpu;
    g.make_input = o.make_input;
    run_gradient_checks(report, op, shapes, dtypes, g, util::cat("gradients batch ", batch, ", "));
  }
}

}  // namespace

CheckOpReport check_op(const CustomData& op, const std::vector<Shape>& input_shapes,
                       const std::vector<DType>& dtypes, const CheckOpOptions& options) {
  CheckOpReport report;
  try {
    run_checks(report, op, input_shapes, dtypes, options);
  } catch (const std::exception& e) {  // from the op's own methods outside any single check
    report.ok = false;
    report.lines.push_back(util::cat("FAIL check_op: ", e.what()));
  }
  return report;
}

}  // namespace kg::testing
