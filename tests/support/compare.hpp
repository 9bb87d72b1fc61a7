// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Comparison helpers for the tests: per-element tolerance checks that report the worst element
/// and the number of failures (one failure message per tensor, not one per element), a
/// whole-tensor normalised mean squared error, and deterministic random matrices.
///
/// Set the environment variable GATTN_TEST_ERROR_SUMMARY=1 to print, at program exit, the worst
/// observed errors per label prefix (the part of the label before the first '/').

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>

#include <Eigen/Core>

#include "gattn/types.hpp"

namespace gattn_test {

/// What one comparison observed.
struct CloseStats {
    double max_abs_err = 0.0;  ///< largest |got − ref| over finite pairs
    double max_excess = 0.0;   ///< largest |got − ref| / (atol + rtol·|ref|)
    double nmse = 0.0;         ///< Σ(ref − got)² / Σ ref² over finite pairs
    long failures = 0;         ///< elements outside the tolerance
    gattn::Index worst_row = -1;
    gattn::Index worst_col = -1;
};

/// Worst errors seen per label prefix, printed at exit when GATTN_TEST_ERROR_SUMMARY is set.
class ErrorSummary {
public:
    static ErrorSummary& instance() {
        static ErrorSummary s;
        return s;
    }
    void record(const std::string& label, const CloseStats& st) {
        const std::string key = label.substr(0, label.find('/'));
        std::lock_guard<std::mutex> lock(m_mutex);
        Entry& e = m_entries[key];
        e.max_abs_err = std::max(e.max_abs_err, st.max_abs_err);
        e.max_excess = std::max(e.max_excess, st.max_excess);
        e.nmse = std::max(e.nmse, st.nmse);
        ++e.count;
    }
    ~ErrorSummary() {
        const char* env = std::getenv("GATTN_TEST_ERROR_SUMMARY");
        if (!env || !*env || std::string(env) == "0") return;
        std::fprintf(stderr, "%-40s %8s %14s %14s %14s\n", "label", "checks", "max|err|", "max err/tol", "max NMSE");
        for (const auto& [key, e] : m_entries)
            std::fprintf(stderr, "%-40s %8ld %14.3e %14.3e %14.3e\n", key.c_str(), e.count, e.max_abs_err, e.max_excess,
                         e.nmse);
    }

private:
    struct Entry {
        double max_abs_err = 0.0, max_excess = 0.0, nmse = 0.0;
        long count = 0;
    };
    std::mutex m_mutex;
    std::map<std::string, Entry> m_entries;
};

/// Checks |got − ref| ≤ atol + rtol·|ref| for every element, and (when nmse_bound ≥ 0) the
/// whole-tensor NMSE Σ(ref − got)² / Σ ref² ≤ nmse_bound. Equal infinities match; a NaN in got
/// where ref is not NaN fails, as does a NaN in ref where got is finite. Reports at most one
/// failure per call (count, worst index, values) through ADD_FAILURE.
template <class GotDerived, class RefDerived>
CloseStats expect_close(const Eigen::DenseBase<GotDerived>& got, const Eigen::DenseBase<RefDerived>& ref, double atol,
                        double rtol, const std::string& label, double nmse_bound = -1.0) {
    CloseStats st;
    if (got.rows() != ref.rows() || got.cols() != ref.cols()) {
        ADD_FAILURE() << label << ": shape [" << got.rows() << ", " << got.cols() << "] differs from the reference ["
                      << ref.rows() << ", " << ref.cols() << "]";
        st.failures = 1;
        return st;
    }
    double err2 = 0.0, ref2 = 0.0;
    double worst_got = 0.0, worst_ref = 0.0;
    long nan_failures = 0;
    for (gattn::Index r = 0; r < got.rows(); ++r) {
        for (gattn::Index c = 0; c < got.cols(); ++c) {
            const double g = static_cast<double>(got(r, c));
            const double e = static_cast<double>(ref(r, c));
            bool ok;
            double excess = 0.0;
            if (std::isnan(e) || std::isnan(g)) {
                ok = std::isnan(e) && std::isnan(g);
                if (!ok) ++nan_failures;
                excess = ok ? 0.0 : std::numeric_limits<double>::infinity();
            } else if (std::isinf(e) || std::isinf(g)) {
                ok = g == e;
                excess = ok ? 0.0 : std::numeric_limits<double>::infinity();
            } else {
                const double d = std::abs(g - e);
                const double tol = atol + rtol * std::abs(e);
                ok = d <= tol;
                excess = tol > 0 ? d / tol : (d > 0 ? std::numeric_limits<double>::infinity() : 0.0);
                st.max_abs_err = std::max(st.max_abs_err, d);
                err2 += d * d;
                ref2 += e * e;
            }
            if (!ok) ++st.failures;
            if (excess > st.max_excess || (st.worst_row < 0 && !ok)) {
                st.max_excess = std::max(st.max_excess, excess);
                st.worst_row = r;
                st.worst_col = c;
                worst_got = g;
                worst_ref = e;
            }
        }
    }
    st.nmse = ref2 > 0 ? err2 / ref2 : err2;
    if (st.failures > 0) {
        std::ostringstream msg;
        msg.precision(17);
        msg << label << ": " << st.failures << " of " << got.size() << " elements exceed atol " << atol << " + rtol "
            << rtol << " * |ref|";
        if (nan_failures) msg << " (" << nan_failures << " with NaN)";
        msg << "; worst at (" << st.worst_row << ", " << st.worst_col << "): got " << worst_got << ", ref " << worst_ref
            << ", |diff| " << std::abs(worst_got - worst_ref) << "; max |diff| over finite " << st.max_abs_err
            << ", NMSE " << st.nmse;
        ADD_FAILURE() << msg.str();
    }
    if (nmse_bound >= 0 && !(st.nmse <= nmse_bound)) {
        ADD_FAILURE() << label << ": NMSE " << st.nmse << " exceeds " << nmse_bound;
        if (st.failures == 0) st.failures = 1;
    }
    ErrorSummary::instance().record(label, st);
    return st;
}

/// Deterministic U(−1, 1) · scale values, the same on every platform (raw 53-bit draws from
/// std::mt19937_64, not std::uniform_real_distribution, whose algorithm is unspecified).
class UniformSource {
public:
    explicit UniformSource(std::uint64_t seed) : m_rng(seed) {}
    double next(double scale = 1.0) {
        const double u = static_cast<double>(m_rng() >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
        return (2.0 * u - 1.0) * scale;
    }

private:
    std::mt19937_64 m_rng;
};

/// [rows, cols] row-major double matrix of U(−1, 1) · scale, deterministic for a seed.
inline gattn::RowMatrix<double> random_matrix(gattn::Index rows, gattn::Index cols, std::uint64_t seed,
                                              double scale = 1.0) {
    UniformSource src(seed);
    gattn::RowMatrix<double> m(rows, cols);
    for (gattn::Index r = 0; r < rows; ++r)
        for (gattn::Index c = 0; c < cols; ++c) m(r, c) = src.next(scale);
    return m;
}

/// The matrix rounded to Scalar and back to double, so the reference sees the library's inputs.
template <class Scalar, class Derived>
gattn::RowMatrix<double> rounded(const Eigen::MatrixBase<Derived>& m) {
    return m.template cast<Scalar>().template cast<double>();
}

/// True when two contiguous matrices (or full-width row blocks) have the same shape and bytes. Cache storage past the
/// written rows is uninitialised and may hold NaN patterns, which `==` never equates.
template <class A, class B>
bool same_bytes(const Eigen::DenseBase<A>& a, const Eigen::DenseBase<B>& b) {
    static_assert(std::is_same_v<typename A::Scalar, typename B::Scalar>, "same_bytes compares one type");
    return a.rows() == b.rows() && a.cols() == b.cols() &&
           std::memcmp(a.derived().data(), b.derived().data(),
                       sizeof(typename A::Scalar) * static_cast<std::size_t>(a.size())) == 0;
}

/// A storage type's name in test labels: Float, Double, Bf16, Fp16 or Int8.
template <class S>
const char* type_label() {
    return std::is_same_v<S, float>             ? "Float"
           : std::is_same_v<S, double>          ? "Double"
           : std::is_same_v<S, gattn::bfloat16> ? "Bf16"
           : std::is_same_v<S, std::int8_t>     ? "Int8"
                                                : "Fp16";
}

/// Names the instances of a typed test suite by their type (TYPED_TEST_SUITE's third argument).
struct ScalarNames {
    template <class S>
    static std::string GetName(int) {
        return type_label<S>();
    }
};

}  // namespace gattn_test
