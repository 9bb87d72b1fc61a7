// Runs every reference case (small inputs from faults that shipped in other attention
// libraries, with answers computed independently in float64) through gattn's public API.
// Each JSON file under GATTN_CASES_DIR is one case; its extra runs are run too.

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gattn/gattn.hpp"

namespace {

using nlohmann::json;
using gattn::Index;

std::vector<std::string> case_files() {
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(GATTN_CASES_DIR))
        if (e.path().extension() == ".json") files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
    return files;
}

double number(const json& v) {
    if (v.is_string()) {
        const std::string s = v.get<std::string>();
        if (s == "NaN") return std::numeric_limits<double>::quiet_NaN();
        if (s == "Infinity") return std::numeric_limits<double>::infinity();
        if (s == "-Infinity") return -std::numeric_limits<double>::infinity();
        throw std::runtime_error("unknown number string " + s);
    }
    if (v.is_boolean()) return v.get<bool>() ? 1.0 : 0.0;
    return v.get<double>();
}

std::vector<Index> shape_of(const json& t) { return t.at("shape").get<std::vector<Index>>(); }

std::vector<double> data_of(const json& t) {
    std::vector<double> d;
    for (const auto& v : t.at("data")) d.push_back(number(v));
    return d;
}

bool present(const json& inputs, const char* key) {
    return inputs.contains(key) && !inputs.at(key).is_null();
}

/// [B, H, S, D] (BHSD) → gattn's [B·S, H·D].
template <class Scalar>
gattn::RowMatrix<Scalar> from_bhsd(const json& t) {
    const auto s = shape_of(t);
    const auto d = data_of(t);
    const Index B = s[0], H = s[1], S = s[2], D = s[3];
    gattn::RowMatrix<Scalar> m(B * S, H * D);
    for (Index b = 0; b < B; ++b)
        for (Index h = 0; h < H; ++h)
            for (Index i = 0; i < S; ++i)
                for (Index e = 0; e < D; ++e)
                    m(b * S + i, h * D + e) = static_cast<Scalar>(d[((b * H + h) * S + i) * D + e]);
    return m;
}

/// Row-major tensor of any rank → [Π shape[:-1], shape[-1]].
template <class Scalar>
gattn::RowMatrix<Scalar> flat(const json& t) {
    const auto s = shape_of(t);
    const auto d = data_of(t);
    const Index cols = s.back();
    gattn::RowMatrix<Scalar> m(static_cast<Index>(d.size()) / cols, cols);
    for (Index k = 0; k < m.size(); ++k) m.data()[k] = static_cast<Scalar>(d[k]);
    return m;
}

/// Checks got (in gattn layout) against the expected tensor with the case's tolerance.
template <class Scalar>
void expect_matches(const gattn::RowMatrix<Scalar>& got, const json& expected, const std::string& label) {
    const json& out = expected.at("output");
    const double atol = expected.at("tolerance").at("atol").get<double>();
    const double rtol = expected.at("tolerance").at("rtol").get<double>();
    const gattn::RowMatrix<double> want = out.at("layout").get<std::string>() == "BHSD"
                                              ? from_bhsd<double>(out)
                                              : flat<double>(out);
    ASSERT_EQ(got.rows(), want.rows()) << label;
    ASSERT_EQ(got.cols(), want.cols()) << label;
    int failures = 0;
    for (Index r = 0; r < want.rows(); ++r)
        for (Index c = 0; c < want.cols(); ++c) {
            const double g = static_cast<double>(got(r, c)), w = want(r, c);
            const bool ok = std::isfinite(g) && std::abs(g - w) <= atol + rtol * std::abs(w);
            if (!ok && ++failures <= 5)
                ADD_FAILURE() << label << ": at (" << r << ", " << c << ") got " << g << ", want " << w;
        }
    EXPECT_EQ(failures, 0) << label;
}

template <class Scalar>
void run_sdpa_case(const json& in, const json& expected, const std::string& label) {
    const auto qs = shape_of(in.at("q")), ks = shape_of(in.at("k"));
    const Index B = qs[0], H = qs[1], Nk = ks[2], Hkv = ks[1];
    auto q = from_bhsd<Scalar>(in.at("q"));
    auto k = from_bhsd<Scalar>(in.at("k"));
    auto v = from_bhsd<Scalar>(in.at("v"));
    gattn::SdpaOptions<Scalar> opt;
    if (present(in, "scale")) opt.scale = number(in.at("scale"));
    opt.mask.causal = present(in, "causal") && in.at("causal").get<bool>();
    std::unique_ptr<bool[]> bool_data;
    std::vector<Scalar> bias_data;
    if (present(in, "bool_mask")) {
        const auto s = shape_of(in.at("bool_mask"));
        const auto d = data_of(in.at("bool_mask"));
        bool_data.reset(new bool[d.size()]);
        for (std::size_t i = 0; i < d.size(); ++i) bool_data[i] = d[i] != 0.0;
        opt.mask.bool_mask = {bool_data.get(), s[0], s[1], s[2], s[3]};
    }
    if (present(in, "add_mask")) {
        const auto s = shape_of(in.at("add_mask"));
        for (double x : data_of(in.at("add_mask"))) bias_data.push_back(static_cast<Scalar>(x));
        opt.mask.bias = {bias_data.data(), s[0], s[1], s[2], s[3]};
    }
    ASSERT_EQ(k.rows(), B * Nk);
    const auto out = gattn::scaled_dot_product_attention<Scalar>(q, k, v, {B, H, Hkv}, opt);
    expect_matches(out, expected, label);
}

template <class Scalar>
void run_layer_case(const json& in, const json& expected, const std::string& label) {
    const auto xs = shape_of(in.at("x"));
    const Index B = xs[0], D = xs[2];
    gattn::AttentionConfig c;
    c.d_model = D;
    c.num_heads = in.at("num_q_heads").get<Index>();
    c.num_kv_heads = in.at("num_kv_heads").get<Index>();
    c.head_dim = in.at("head_dim").get<Index>();
    c.causal = present(in, "causal") && in.at("causal").get<bool>();
    if (present(in, "scale")) c.scale = number(in.at("scale"));
    const std::string gate = in.at("gate").get<std::string>();
    gattn::AttentionWeights<Scalar> w;
    if (gate == "elementwise_fused_in_q_proj") {
        c.gate = gattn::GateSpec::g1_elementwise(gattn::GateLayout::PerHeadInterleaved);
        w.q_proj_weight = flat<Scalar>(in.at("Wq_fused_q_gate"));
    } else {
        ASSERT_TRUE(gate == "elementwise" || gate == "headwise") << gate;
        c.gate = gate == "elementwise" ? gattn::GateSpec::g1_elementwise() : gattn::GateSpec::g1_headwise();
        w.q_proj_weight = flat<Scalar>(in.at("Wq"));
        w.gate_proj_weight = flat<Scalar>(in.at("Wg"));
    }
    w.k_proj_weight = flat<Scalar>(in.at("Wk"));
    w.v_proj_weight = flat<Scalar>(in.at("Wv"));
    w.o_proj_weight = flat<Scalar>(in.at("Wo"));
    const gattn::GatedMultiHeadAttention<Scalar> layer(c, w);
    const auto y = layer.forward(flat<Scalar>(in.at("x")), B);
    expect_matches(y, expected, label);
}

template <class Scalar>
void run_case_file(const std::string& name) {
    const std::string path = std::string(GATTN_CASES_DIR) + "/" + name;
    std::ifstream f(path);
    const json j = json::parse(f);
    struct Run {
        std::string name;
        const json* inputs;
        const json* expected;
    };
    std::vector<Run> runs{{"main", &j.at("inputs"), &j.at("expected")}};
    if (j.contains("extra_runs"))
        for (const auto& r : j.at("extra_runs"))
            runs.push_back({r.at("name").get<std::string>(), &r.at("inputs"), &r.at("expected")});
    for (const auto& r : runs) {
        const std::string label = std::filesystem::path(path).filename().string() + " / " + r.name;
        SCOPED_TRACE(label);
        if (r.inputs->contains("q"))
            run_sdpa_case<Scalar>(*r.inputs, *r.expected, label);
        else
            run_layer_case<Scalar>(*r.inputs, *r.expected, label);
    }
}

class ReferenceCase : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceCase, FloatMatchesExpected) { run_case_file<float>(GetParam()); }
TEST_P(ReferenceCase, DoubleMatchesExpected) { run_case_file<double>(GetParam()); }

INSTANTIATE_TEST_SUITE_P(SharedCases, ReferenceCase, ::testing::ValuesIn(case_files()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                             std::string n = std::filesystem::path(info.param).stem().string();
                             std::string out;
                             bool up = true;
                             for (char ch : n) {
                                 if (ch == '_') { up = true; continue; }
                                 out += up ? static_cast<char>(std::toupper(ch)) : ch;
                                 up = false;
                             }
                             return out;
                         });

TEST(SharedCases, DirectoryHoldsCases) { EXPECT_GE(case_files().size(), 11u) << GATTN_CASES_DIR; }

}  // namespace
