// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// JSON input of gattn's file readers (safetensors headers, config.json,
/// model.safetensors.index.json), through nlohmann_json, with the limits that make a file from
/// anywhere safe to read: arrays and objects nest at most 128 levels deep (as the safetensors
/// reference reader, whose JSON parser stops at 128; deeper JSON would overflow the stack when
/// copied or printed), and where asked, no object names a key twice. Needs nlohmann_json.

#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "gattn/errors.hpp"

GATTN_BEGIN_ISA_NAMESPACE

namespace detail {

/// Deepest nesting of arrays and objects the readers accept (the top-level value is level 1).
inline constexpr int json_max_depth = 128;

/// Parses the JSON text `input` (a std::string or a std::istream) into a document. Calls
/// `fail(what)`, which must throw, with "malformed JSON: <parser message>", "JSON nested deeper
/// than 128 levels", or with `unique_keys` "key 'k' appears twice in the top-level object"
/// (or "... in the object of 'parent'", "... in an object in an array"). The key check runs as
/// the text is parsed (nlohmann's parser callback), since the parsed document keeps only the
/// last of equal keys.
template <class Input, class Fail>
nlohmann::json parse_json(Input&& input, bool unique_keys, const Fail& fail) {
    // Per open object: its keys so far and the key it is the value of ("" at the top level or in
    // an array).
    std::vector<std::pair<std::set<std::string>, std::string>> objects;
    std::vector<std::string> last_key{""};  // per open container: its latest key
    const nlohmann::json::parser_callback_t check = [&](int depth, nlohmann::json::parse_event_t event,
                                                        nlohmann::json& parsed) {
        using Event = nlohmann::json::parse_event_t;
        switch (event) {
            case Event::object_start:
            case Event::array_start:
                if (depth >= json_max_depth)
                    fail("JSON nested deeper than " + std::to_string(json_max_depth) + " levels");
                if (unique_keys && event == Event::object_start)
                    objects.emplace_back(std::set<std::string>{}, last_key.back());
                last_key.emplace_back();
                break;
            case Event::key:
                last_key.back() = parsed.get<std::string>();
                if (unique_keys && !objects.back().first.insert(last_key.back()).second)
                    fail("key '" + last_key.back() + "' appears twice in " +
                         (depth == 1                      ? std::string("the top-level object")
                          : objects.back().second.empty() ? std::string("an object in an array")
                                                          : "the object of '" + objects.back().second + "'"));
                break;
            case Event::object_end:
            case Event::array_end:
                if (unique_keys && event == Event::object_end) objects.pop_back();
                last_key.pop_back();
                break;
            case Event::value: break;
        }
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
