// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// JSON input of gattn's file readers (safetensors headers, config.json,
/// model.safetensors.index.json), through nlohmann_json, with the limit that makes a file from
/// anywhere safe to read: arrays and objects nest at most 128 levels deep (as the safetensors
/// reference reader, whose JSON parser stops at 128; deeper JSON would overflow the stack when
/// copied or printed). Needs nlohmann_json.

#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "gattn/errors.hpp"

GATTN_BEGIN_ISA_NAMESPACE

namespace detail {

/// Deepest nesting of arrays and objects the readers accept (the top-level value is level 1).
inline constexpr int json_max_depth = 128;

/// Parses the JSON text `input` (a std::string or a std::istream) into a document. Calls
/// `fail(what)`, which must throw, with "malformed JSON: <parser message>" or "JSON nested
/// deeper than 128 levels"; the depth is checked as the text is parsed (nlohmann's parser
/// callback), before a deeper document exists.
template <class Input, class Fail>
nlohmann::json parse_json(Input&& input, const Fail& fail) {
    const nlohmann::json::parser_callback_t check = [&](int depth, nlohmann::json::parse_event_t event,
                                                        nlohmann::json&) {
        using Event = nlohmann::json::parse_event_t;
        if ((event == Event::object_start || event == Event::array_start) && depth >= json_max_depth)
            fail("JSON nested deeper than " + std::to_string(json_max_depth) + " levels");
        return true;
    };
    try {
        return nlohmann::json::parse(std::forward<Input>(input), check);
    } catch (const nlohmann::json::exception& e) {
        fail(std::string("malformed JSON: ") + e.what());
    }
    return nullptr;  // not reached: fail throws
}

}  // namespace detail

GATTN_END_ISA_NAMESPACE
