// Model::summary(), Model::to_dot() and render_dot().
#include <gtest/gtest-spi.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "graph/dump.hpp"
#include "graph/render.hpp"
#include "support/test_util.hpp"
#include "util/str.hpp"

using kg_test::fresh_seed;
using kg_test::read_file;
namespace fs = std::filesystem;

namespace {

// An op whose name, attributes and node name need escaping in DOT, with a trainable
// parameter and a non-trainable buffer of another dtype.
class QuotedOp final : public kg::CustomOp {
 public:
  explicit QuotedOp(std::int64_t channels) : channels_(channels) {}
  std::string name() const override { return "test.\"quoted\\op\""; }
  std::string attributes() const override { return "mode=\"fast\" dir=C:\\tmp"; }
  kg::Shape infer_output_shape(const std::vector<kg::Shape>& in) const override { return in.at(0); }
  std::vector<kg::ParamSpec> parameters(const std::vector<kg::Shape>&) const override {
    return {{"scale", {channels_}, kg::DType::F32, kg::ParamInit::constant(1.0), true},
            {"count", {1}, kg::DType::I64, kg::ParamInit::constant(0.0), false}};
  }

 private:
  std::int64_t channels_;
};

// The table row (a line starting with a node id) of `text` that holds `needle` surrounded by
// spaces (a summary row's name cell).
std::string row_of(const std::string& text, const std::string& needle) {
  std::istringstream is(text);
  std::string line;
  std::string found;
  while (std::getline(is, line)) {
    const auto first = line.find_first_not_of(' ');
    if (first == std::string::npos || !std::isdigit(static_cast<unsigned char>(line[first]))) continue;
    if ((" " + line + " ").find(" " + needle + " ") != std::string::npos) {
      EXPECT_TRUE(found.empty()) << "two rows hold '" << needle << "':\n" << text;
      found = line;
    }
  }
  EXPECT_FALSE(found.empty()) << "no row holds '" << needle << "':\n" << text;
  return found;
}

// A DOT statement: a node declaration ("n3 [label=...]") or an edge ("n1 -> n3 [...]").
struct DotStatement {
  std::string from, to;                      // `to` empty for a node declaration
  std::map<std::string, std::string> attrs;  // unescaped values
};

// A small DOT reader for what to_dot() writes: checks that quoted strings are closed and
// escapes valid, that braces balance outside strings, and returns the statements inside
// the graph body (graph/node/edge defaults and graph attributes are skipped).
std::vector<DotStatement> parse_dot(const std::string& dot) {
  std::vector<std::string> tokens;  // quoted strings keep a leading '"' marker, unescaped
  int depth = 0, max_depth = 0;
  for (std::size_t i = 0; i < dot.size(); ++i) {
    const char c = dot[i];
    if (c == '"') {
      std::string value = "\"";
      std::size_t j = i + 1;
      for (; j < dot.size() && dot[j] != '"'; ++j) {
        if (dot[j] == '\n') ADD_FAILURE() << "raw line break inside a quoted string at " << j;
        if (dot[j] == '\\') {
          ++j;
          if (j >= dot.size()) break;
          const char e = dot[j];
          if (e == '"' || e == '\\')
            value += e;
          else if (e == 'n')
            value += '\n';
          else
            ADD_FAILURE() << "unexpected escape \\" << e << " at " << j;
        } else {
          value += dot[j];
        }
      }
      if (j >= dot.size()) {
        ADD_FAILURE() << "unterminated quoted string starting at " << i;
        return {};
      }
      tokens.push_back(value);
      i = j;
    } else if (c == '{' || c == '}' || c == '[' || c == ']' || c == ';' || c == '=' || c == ',') {
      if (c == '{') max_depth = std::max(max_depth, ++depth);
      if (c == '}') --depth;
      EXPECT_GE(depth, 0) << "'}' without '{' at " << i;
      tokens.emplace_back(1, c);
    } else if (c == '-' && i + 1 < dot.size() && dot[i + 1] == '>') {
      tokens.emplace_back("->");
      ++i;
    } else if (!std::isspace(static_cast<unsigned char>(c))) {
      std::string word;
      while (i < dot.size() && (std::isalnum(static_cast<unsigned char>(dot[i])) || dot[i] == '_' ||
                                dot[i] == '.' || dot[i] == '#')) {
        word += dot[i++];
      }
      if (word.empty()) {
        ADD_FAILURE() << "unexpected character '" << c << "' at " << i;
        return {};
      }
      tokens.push_back(word);
      --i;
    }
  }
  EXPECT_EQ(depth, 0) << "unbalanced braces";
  EXPECT_EQ(max_depth, 1);
  EXPECT_GE(tokens.size(), 4u);
  if (tokens.size() < 4) return {};
  EXPECT_EQ(tokens[0], "digraph");
  EXPECT_EQ(tokens[2], "{");
  EXPECT_EQ(tokens.back(), "}");

  std::vector<DotStatement> out;
  std::size_t i = 3;
  auto text = [](const std::string& tok) { return tok.size() > 0 && tok[0] == '"' ? tok.substr(1) : tok; };
  while (i + 1 < tokens.size()) {
    const std::size_t start = i;
    while (i + 1 < tokens.size() && tokens[i] != ";") ++i;
    std::vector<std::string> st(tokens.begin() + static_cast<std::ptrdiff_t>(start),
                                tokens.begin() + static_cast<std::ptrdiff_t>(i));
    ++i;
    if (st.empty() || st[0] == "node" || st[0] == "edge" || st[0] == "graph") continue;
    if (st.size() >= 3 && st[1] == "=") continue;  // a graph attribute
    DotStatement s;
    std::size_t k = 0;
    s.from = text(st[k++]);
    if (k < st.size() && st[k] == "->") {
      EXPECT_LT(k + 1, st.size());
      s.to = text(st[k + 1]);
      k += 2;
    }
    if (k < st.size()) {
      EXPECT_EQ(st[k], "[");
      for (++k; k < st.size() && st[k] != "]";) {
        if (k + 2 >= st.size()) {
          ADD_FAILURE() << "truncated attribute list";
          break;
        }
        EXPECT_EQ(st[k + 1], "=");
        s.attrs[st[k]] = text(st[k + 2]);
        k += 3;
        if (k < st.size() && st[k] == ",") {
          ++k;
        } else {
          EXPECT_TRUE(k < st.size() && st[k] == "]") << "expected ',' or ']' after attribute " << st[k - 3];
        }
      }
      EXPECT_EQ(k + 1, st.size()) << "tokens after the attribute list";
    }
    out.push_back(std::move(s));
  }
  return out;
}

// parse_dot() plus: no node is declared twice and every edge endpoint is declared. Returns
// the declarations by id and the edges.
struct DotGraph {
  std::map<std::string, DotStatement> nodes;
  std::vector<DotStatement> edges;
};
DotGraph check_dot(const std::string& dot) {
  DotGraph g;
  for (auto& st : parse_dot(dot)) {
    if (st.to.empty()) {
      const std::string id = st.from;
      EXPECT_TRUE(g.nodes.emplace(id, std::move(st)).second) << "node " << id << " declared twice";
    } else {
      g.edges.push_back(std::move(st));
    }
  }
  for (const auto& e : g.edges) {
    EXPECT_TRUE(g.nodes.count(e.from)) << "edge from undeclared " << e.from;
    EXPECT_TRUE(g.nodes.count(e.to)) << "edge to undeclared " << e.to;
  }
  return g;
}

bool dot_available() { return std::system("command -v dot >/dev/null 2>&1") == 0; }

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "kg-dump-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (fs::path(path_) / name).string(); }

 private:
  std::string path_;
};

// A small model with random layer sizes: x [batch, in] → fc1 → relu → head.fc2 (+ a dead
// branch), and a second output through QuotedOp.
struct Sizes {
  std::int64_t in, hidden, out;
};

kg::Model build_model(const Sizes& s, kg::LoweringMode mode = kg::LoweringMode::Inference) {
  auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), s.in}, "x");
  auto h = kg::nn::linear(x, s.hidden, "fc1");
  h = kg::relu(h, "act");
  kg::SymTensor y;
  {
    kg::NameScope scope(*g, "head");
    y = kg::nn::linear(h, s.out, "fc2");
  }
  kg::nn::linear(x, 3, "unused");
  auto q = h.record_custom(kg::CustomData::make<QuotedOp>(s.hidden), {}, std::nullopt, "say \"hi\"");
  // Unfused, so that every recorded node has its row (fc1's ReLU would be its epilogue).
  return kg::Model(g, {{"logits", y}, {"side \"q\"", q}}, mode, {.fusion = false});
}

Sizes random_sizes(std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> d(2, 300);
  return {d(rng), d(rng), d(rng)};
}

}  // namespace

TEST(Dump, EscapeAndDigits) {
  EXPECT_EQ(kg::dump::escape_dot("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  EXPECT_EQ(kg::dump::escape_dot("plain [1, 2]"), "plain [1, 2]");
  EXPECT_EQ(kg::dump::group_digits(0), "0");
  EXPECT_EQ(kg::dump::group_digits(999), "999");
  EXPECT_EQ(kg::dump::group_digits(1000), "1,000");
  EXPECT_EQ(kg::dump::group_digits(11689512), "11,689,512");
  EXPECT_EQ(kg::dump::group_digits(-1234), "-1,234");
}

TEST(Dump, SummaryListsEveryLiveNodeWithShapesAndParameterBytes) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Sizes s = random_sizes(rng);
  kg::Model model = build_model(s);
  const std::string text = model.summary();
  SCOPED_TRACE(text);

  // Expected bytes from the layer sizes: f32 weights and biases, the op's f32 scale and i64 count.
  const std::size_t fc1_bytes = static_cast<std::size_t>(s.hidden * s.in + s.hidden) * 4;
  const std::size_t fc2_bytes = static_cast<std::size_t>(s.out * s.hidden + s.out) * 4;
  const std::size_t q_bytes = static_cast<std::size_t>(s.hidden) * 4 + 8;

  struct Want {
    std::string name, op, shape, bytes, attrs;
  };
  const std::vector<Want> want{
      {"x", "input", kg::util::cat("[batch, ", s.in, "]"), "-", ""},
      {"fc1", "nn.linear", kg::util::cat("[batch, ", s.hidden, "]"), kg::util::format_bytes(fc1_bytes),
       kg::util::cat("in=", s.in, " out=", s.hidden)},
      {"act", "nn.relu", kg::util::cat("[batch, ", s.hidden, "]"), "-", ""},
      {"head.fc2", "nn.linear", kg::util::cat("[batch, ", s.out, "]"), kg::util::format_bytes(fc2_bytes),
       kg::util::cat("in=", s.hidden, " out=", s.out)},
      {"say \"hi\"", "test.\"quoted\\op\"", kg::util::cat("[batch, ", s.hidden, "]"),
       kg::util::format_bytes(q_bytes), "mode=\"fast\" dir=C:\\tmp"},
  };
  for (const auto& w : want) {
    const std::string row = row_of(text, w.name);
    const int id = model.graph().find(w.name);
    ASSERT_GE(id, 0) << w.name;
    EXPECT_EQ(row.find(std::to_string(id) + "  "), row.find_first_not_of(' ')) << row;
    for (const std::string& part : {w.op, std::string("f32"), w.shape, w.bytes, w.attrs})
      EXPECT_NE(row.find(part), std::string::npos)
          << "row of " << w.name << " lacks '" << part << "': " << row;
  }
  EXPECT_EQ(text.find("unused"), std::string::npos) << "a dead node is listed";

  const long long params = (s.hidden * s.in + s.hidden) + (s.out * s.hidden + s.out) + s.hidden + 1;
  const long long trainable = params - 1;
  EXPECT_NE(text.find(kg::util::cat("total: 5 nodes, ", kg::dump::group_digits(params), " parameters (",
                                    kg::dump::group_digits(trainable), " trainable) in 6 tensors, ",
                                    kg::util::format_bytes(fc1_bytes + fc2_bytes + q_bytes))),
            std::string::npos);
  EXPECT_NE(text.find(kg::util::cat("outputs: logits = head.fc2 [batch, ", s.out,
                                    "] f32, side \"q\" = say \"hi\"")),
            std::string::npos);
  EXPECT_NE(text.find("inference graph"), std::string::npos);
  EXPECT_NE(build_model(s, kg::LoweringMode::Training).summary().find("training graph"), std::string::npos);
}

TEST(Dump, SummaryCountsF64Parameters) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Sizes s = random_sizes(rng);
  auto [x, g] = kg::SymTensor::input(kg::DType::F64, {kg::dynamic, s.in}, "x");
  auto y = kg::nn::linear(x, s.out, "fc", /*bias=*/false);
  kg::Model model(g, {y});
  const std::string text = model.summary();
  const std::size_t bytes = static_cast<std::size_t>(s.in * s.out) * 8;
  const std::string row = row_of(text, "fc");
  EXPECT_NE(row.find("f64"), std::string::npos) << row;
  EXPECT_NE(row.find(kg::util::format_bytes(bytes)), std::string::npos) << row;
  EXPECT_NE(row.find(kg::util::cat("[?, ", s.out, "]")), std::string::npos) << row;
  EXPECT_NE(text.find(kg::util::cat(kg::dump::group_digits(s.in * s.out), " parameters")), std::string::npos)
      << text;
}

TEST(Dump, FusedNodeShowsEveryAbsorbedParameter) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> d(1, 24);
  const std::int64_t cin = d(rng), cout = d(rng), k = 1 + 2 * (d(rng) % 3);
  auto build = [&](kg::LoweringMode mode) {
    auto [x, g] = kg::SymTensor::input(kg::DType::F32, {kg::Dim::named("batch"), cin, 16, 16}, "x");
    auto y = kg::nn::conv2d(x, cout, k, {.padding = k / 2}, "conv");
    y = kg::nn::batch_norm2d(y, "bn");
    y = kg::relu(y, "act");
    return kg::Model(g, {{"y", y}}, mode);
  };
  const std::size_t conv_bytes = static_cast<std::size_t>(cout * cin * k * k + cout) * 4;
  const std::size_t bn_bytes = static_cast<std::size_t>(4 * cout) * 4 + 8;  // + the i64 counter
  const std::string shape = kg::util::cat("[batch, ", cout, ", 16, 16]");

  kg::Model fused = build(kg::LoweringMode::Inference);
  const std::string text = fused.summary();
  SCOPED_TRACE(text);
  const std::string row = row_of(text, "conv");
  EXPECT_NE(row.find("nn.fused_conv2d"), std::string::npos) << row;
  EXPECT_NE(row.find(kg::util::format_bytes(conv_bytes + bn_bytes)), std::string::npos) << row;
  EXPECT_NE(row.find(shape), std::string::npos) << row;
  EXPECT_EQ(fused.live_nodes().size(), 2u);
  const long long params = cout * cin * k * k + cout + 4 * cout + 1;
  EXPECT_NE(text.find(kg::util::cat("total: 2 nodes, ", kg::dump::group_digits(params), " parameters (",
                                    kg::dump::group_digits(cout * cin * k * k + 3 * cout),
                                    " trainable) in 7 tensors")),
            std::string::npos);
  const DotGraph dot = check_dot(fused.to_dot());
  const int id = fused.graph().find("conv");
  ASSERT_TRUE(dot.nodes.count("n" + std::to_string(id)));
  const std::string& label = dot.nodes.at("n" + std::to_string(id)).attrs.at("label");
  for (const std::string& part :
       {kg::util::cat("weight [", cout, ", ", cin, ", ", k, ", ", k, "]"), kg::util::cat("bias [", cout, "]"),
        kg::util::cat("bn.weight [", cout, "]"), kg::util::cat("bn.running_var [", cout, "]"),
        std::string("bn.num_batches_tracked []")})
    EXPECT_NE(label.find(part), std::string::npos) << part << " not in " << label;

  // The training lowering keeps the nodes as recorded.
  kg::Model plain = build(kg::LoweringMode::Training);
  const std::string ptext = plain.summary();
  EXPECT_NE(row_of(ptext, "conv").find(kg::util::format_bytes(conv_bytes)), std::string::npos) << ptext;
  EXPECT_NE(row_of(ptext, "bn").find(kg::util::format_bytes(bn_bytes)), std::string::npos) << ptext;
  EXPECT_NE(row_of(ptext, "act").find("nn.relu"), std::string::npos) << ptext;
}

TEST(Dump, DotIsWellFormedAndDescribesEveryLiveNode) {
  const auto seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const Sizes s = random_sizes(rng);
  kg::Model model = build_model(s);
  const std::string dot = model.to_dot();
  SCOPED_TRACE(dot);
  const DotGraph parsed = check_dot(dot);
  ASSERT_FALSE(parsed.nodes.empty());
  std::map<std::string, const DotStatement*> declared;
  for (const auto& [id, st] : parsed.nodes) declared[id] = &st;
  std::vector<const DotStatement*> edges;
  for (const auto& e : parsed.edges) edges.push_back(&e);

  const kg::Graph& g = model.graph();
  std::set<std::string> live_ids;
  for (int id : model.live_nodes()) {
    const kg::Node& n = g.node(id);
    const std::string key = "n" + std::to_string(id);
    live_ids.insert(key);
    ASSERT_TRUE(declared.count(key)) << n.name;
    const std::string& label = declared[key]->attrs.at("label");
    for (const std::string& part : {n.name, n.op_name(), n.shape.to_string()})
      EXPECT_NE(label.find(part), std::string::npos)
          << "label of " << n.name << " lacks '" << part << "': " << label;
    for (const auto& p : n.params) {
      const std::string short_name = p.name.substr(n.name.size() + 1);
      EXPECT_NE(label.find(short_name + " " + kg::sizes_to_string(p.shape)), std::string::npos) << label;
    }
    for (int in : n.inputs) {
      const std::string from = "n" + std::to_string(in);
      bool found = false;
      for (const auto* e : edges)
        if (e->from == from && e->to == key) {
          found = true;
          EXPECT_EQ(e->attrs.at("label"), g.node(in).shape.to_string());
        }
      EXPECT_TRUE(found) << "no edge " << from << " -> " << key;
    }
  }
  EXPECT_EQ(declared.count("n" + std::to_string(model.recorded_graph().find("unused"))), 0u)
      << "the dead node is drawn";
  EXPECT_EQ(dot.find("unused"), std::string::npos);
  EXPECT_NE(declared.at("n0")->attrs.count("shape"), 0u) << "inputs are styled apart from ops";

  // The outputs: a marker labelled with each name, joined to its node.
  for (const auto& [name, id] : model.outputs()) {
    const DotStatement* marker = nullptr;
    for (const auto& [key, st] : declared)
      if (!live_ids.count(key) && st->attrs.at("label") == name) marker = st;
    ASSERT_NE(marker, nullptr) << "no marker for output " << name;
    bool joined = false;
    for (const auto* e : edges) joined |= e->from == "n" + std::to_string(id) && e->to == marker->from;
    EXPECT_TRUE(joined) << "output " << name;
  }
  // Every declared node is a live node or an output marker.
  EXPECT_EQ(declared.size(), live_ids.size() + model.outputs().size());
}

// How many test failures `fn` reports (intercepted: they do not fail the running test).
int failures_of(const std::function<void()>& fn) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    fn();
  }
  return results.size();
}

TEST(Dump, DotCheckerRejectsBrokenDot) {
  // The checker used above must notice what a broken escape or a missing node would cause.
  const std::vector<std::string> broken{
      "digraph \"m\" {\n  n0 [label=\"say \"hi\"\"];\n}\n",              // unescaped quotes
      "digraph \"m\" {\n  n0 [label=\"a\\\"];\n}\n",                     // an escaped closing quote
      "digraph \"m\" {\n  n0 [label=\"a\"];\n  n0 -> n1;\n}\n",          // undeclared endpoint
      "digraph \"m\" {\n  n0 [label=\"a\"];\n",                          // unbalanced braces
      "digraph \"m\" {\n  n0 [label=\"a\"];\n  n0 [label=\"b\"];\n}\n",  // declared twice
  };
  for (const auto& dot : broken) EXPECT_GT(failures_of([&] { check_dot(dot); }), 0) << dot;

  DotGraph ok;
  EXPECT_EQ(failures_of([&] {
              ok = check_dot(
                  "digraph \"m\" {\n  n0 [label=\"a\\\"b\\nc\", shape=box];\n  n0 -> n0 [label=\"x\"];\n}\n");
            }),
            0);
  ASSERT_EQ(ok.nodes.count("n0"), 1u);
  EXPECT_EQ(ok.nodes.at("n0").attrs.at("label"), "a\"b\nc");
  EXPECT_EQ(ok.nodes.at("n0").attrs.at("shape"), "box");
  EXPECT_EQ(ok.edges.size(), 1u);
}

TEST(Dump, DotAcceptedByGraphviz) {
  if (!dot_available()) GTEST_SKIP() << "graphviz's dot is not installed";
  kg::Model model = build_model({5, 7, 3});
  TempDir dir;
  const std::string svg = dir.file("model.svg");
  kg::dump::render_dot(model.to_dot(), svg);
  const std::string text = read_file(svg);
  EXPECT_NE(text.find("<svg"), std::string::npos);
  EXPECT_NE(text.find("head.fc2"), std::string::npos);
  EXPECT_NE(text.find("say &quot;hi&quot;"), std::string::npos) << "the escaped name does not survive";
  EXPECT_NE(text.find("test.&quot;quoted\\op&quot;"), std::string::npos);

  const std::string png = dir.file("model.PNG");
  kg::dump::render_dot(model.to_dot(), png);
  EXPECT_EQ(read_file(png).substr(0, 4), "\x89PNG");
  const std::string pdf = dir.file("model.pdf");
  kg::dump::render_dot(model.to_dot(), pdf);
  EXPECT_EQ(read_file(pdf).substr(0, 4), "%PDF");
}

TEST(Dump, RenderWritesDotTextForDotExtensions) {
  TempDir dir;
  const std::string text = build_model({4, 6, 2}).to_dot();
  kg::dump::render_dot(text, dir.file("g.dot"));
  EXPECT_EQ(read_file(dir.file("g.dot")), text);
  kg::dump::render_dot(text, dir.file("g.gv"), "kg-no-such-dot-program");  // needs no program
  EXPECT_EQ(read_file(dir.file("g.gv")), text);
}

TEST(Dump, RenderErrors) {
  TempDir dir;
  const std::string text = build_model({4, 6, 2}).to_dot();
  kg_test::expect_error([&] { kg::dump::render_dot(text, dir.file("g.txt")); },
                        {"g.txt", "'.txt'", ".svg", ".png", ".pdf"});
  kg_test::expect_error([&] { kg::dump::render_dot(text, dir.file("noext")); }, {"noext", ".svg"});
  kg_test::expect_error([&] { kg::dump::render_dot(text, dir.file("g.svg"), "kg-no-such-dot-program"); },
                        {"g.svg", "'kg-no-such-dot-program'", "not found", "graphviz"});
  EXPECT_FALSE(fs::exists(dir.file("g.svg")));
  if (!dot_available()) return;
  kg_test::expect_error([&] { kg::dump::render_dot("digraph {\n  a -> \n", dir.file("bad.svg")); },
                        {"bad.svg", "dot -Tsvg", "exit status", "syntax error"});
  EXPECT_FALSE(fs::exists(dir.file("bad.svg")));
  kg_test::expect_error([&] { kg::dump::render_dot(text, dir.file("missing-dir/g.png")); }, {"missing-dir/g.png"});
}

// The picture goes through the safe write: a link planted at the path is not written through,
// and its target keeps its bytes, for the DOT text and for graphviz's pictures alike.
TEST(Dump, RenderFollowsNoPlantedLink) {
  TempDir dir;
  const std::string text = build_model({4, 6, 2}).to_dot();
  const std::string target = dir.file("precious.txt");
  {
    std::ofstream(target) << "keep me";
  }
  std::vector<std::string> names{"g.dot"};
  if (dot_available()) names.push_back("g.svg");
  for (const std::string& name : names) {
    fs::create_symlink(target, dir.file(name));
    kg_test::expect_error([&] { kg::dump::render_dot(text, dir.file(name)); }, {name});
    EXPECT_EQ(read_file(target), "keep me") << name;
    EXPECT_TRUE(fs::is_symlink(dir.file(name))) << name;
  }
}
