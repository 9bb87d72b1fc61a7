// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Exception types and the message helpers every public entry point uses.
///
/// Policy: public functions validate shapes and options before writing anything and throw
///  - `gattn::shape_error` (a `std::invalid_argument`) when an argument has the wrong shape,
///  - `std::invalid_argument` when an option or a combination of options is invalid,
///  - `gattn::io_error` (a `std::runtime_error`) when a file cannot be read or is malformed,
///  - `gattn::out_of_pages` (a `std::invalid_argument`) when a paged KV pool has too few free
///    pages for an append.
/// An output view whose rows overlap (row stride below its columns) is an invalid argument.
/// Messages name the function, the argument, what was expected and what was given.
/// The exception types stay in `gattn` itself (not in the instruction-set namespace, see
/// config.hpp), so `catch (const gattn::shape_error&)` works whatever flags threw it.

#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>

#include "gattn/config.hpp"

namespace gattn {

/// Index type for sizes and shapes (Eigen's default index, a signed 64-bit integer).
using Index = std::ptrdiff_t;

/// Thrown when an argument's shape does not fit the others.
class shape_error : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

/// Thrown when a paged KV pool has fewer free pages than an append needs (PagedKVPool::append
/// and append_ragged, and so the layers' forward over a pool): a state of the pool, not a wrong
/// argument, that a server answers by freeing or preempting a sequence and trying again. A
/// std::invalid_argument, as before it had a type of its own, so code catching those still does.
class out_of_pages : public std::invalid_argument {
public:
    using std::invalid_argument::invalid_argument;
};

/// Thrown when a file (e.g. a safetensors checkpoint) cannot be opened, is truncated or malformed,
/// or lacks a requested tensor.
class io_error : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

}  // namespace gattn

GATTN_BEGIN_ISA_NAMESPACE
namespace detail {

/// Formats a shape as "[a, b, c]".
inline std::string shape_string(std::initializer_list<Index> dims) {
    std::ostringstream s;
    s << '[';
    bool first = true;
    for (Index d : dims) {
        if (!first) s << ", ";
        s << d;
        first = false;
    }
    s << ']';
    return s.str();
}

/// Formats a number for a message: shortest general form ("1e-50", "0.75", "nan"), where
/// std::to_string would print "0.000000" or 300 digits.
inline std::string number_string(double x) {
    std::ostringstream s;
    s.precision(7);
    s << x;
    return s.str();
}

/// Throws shape_error "<function>: <argument> must have shape <expected>, got <actual>".
[[noreturn]] inline void throw_shape(const char* function, const std::string& argument, const std::string& expected,
                                     const std::string& actual) {
    throw shape_error(std::string(function) + ": " + argument + " must have shape " + expected + ", got " + actual);
}

/// Checks a 2-D shape; throws shape_error naming function and argument.
inline void check_shape(const char* function, const std::string& argument, Index rows, Index cols, Index expected_rows,
                        Index expected_cols) {
    if (rows != expected_rows || cols != expected_cols)
        throw_shape(function, argument, shape_string({expected_rows, expected_cols}), shape_string({rows, cols}));
}

/// Throws std::invalid_argument "<function>: <argument> <what>".
[[noreturn]] inline void throw_invalid(const char* function, const std::string& argument, const std::string& what) {
    throw std::invalid_argument(std::string(function) + ": " + argument + " " + what);
}

/// "" when the rows of a row-major matrix view (rows(), cols(), outerStride()) are apart
/// (row stride ≥ cols), else "must have rows apart …": an output whose rows share elements (a
/// Map with row stride 1, say) would have one row's results overwrite another's.
template <class View>
inline std::string rows_apart_error(const View& out) {
    if (out.rows() <= 1 || out.cols() == 0 || out.outerStride() >= out.cols()) return {};
    return "must have rows apart (row stride >= cols), got row stride " + std::to_string(out.outerStride()) + " for " +
           std::to_string(out.cols()) + " columns";
}

/// Checks an output view: its shape (shape_error), and that its rows are apart
/// (std::invalid_argument, rows_apart_error).
template <class View>
inline void check_output(const char* function, const std::string& argument, const View& out, Index expected_rows,
                         Index expected_cols) {
    check_shape(function, argument, out.rows(), out.cols(), expected_rows, expected_cols);
    const std::string apart = rows_apart_error(out);
    if (!apart.empty()) throw_invalid(function, argument, apart);
}

}  // namespace detail
GATTN_END_ISA_NAMESPACE
