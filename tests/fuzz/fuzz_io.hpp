// SPDX-License-Identifier: Apache-2.0
// Helpers shared by the loader harnesses (fuzz_safetensors, fuzz_config, fuzz_index): a
// temporary directory of this process, writing the input to a file, and the checks that stop
// the run with __builtin_trap() (libFuzzer then saves the input) after printing what failed.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <typeinfo>

namespace fuzz_io {

/// A directory of this process, gattn_fuzz_<pid> in the temporary directory (TMPDIR), created
/// on first use: parallel runs of a harness (libFuzzer -jobs, -fork) do not share files.
/// libFuzzer ends a process with _Exit, which runs no exit handler, so the directories of
/// processes that have ended are removed here instead.
inline const std::filesystem::path& temp_dir() {
    static const std::filesystem::path dir = [] {
        namespace fs = std::filesystem;
        const fs::path tmp = fs::temp_directory_path();
        const std::string prefix = "gattn_fuzz_";
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(tmp, ec)) {
            const std::string name = entry.path().filename().string();
            if (name.compare(0, prefix.size(), prefix) != 0) continue;
            const std::string digits = name.substr(prefix.size());
            if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
                continue;
            const pid_t pid = static_cast<pid_t>(std::stol(digits));
            if (pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH) fs::remove_all(entry.path(), ec);
        }
        const fs::path d = tmp / (prefix + std::to_string(::getpid()));
        fs::remove_all(d);
        fs::create_directories(d);
        return d;
    }();
    return dir;
}

/// Writes `size` bytes to `path`, replacing the file.
inline void write_file(const std::filesystem::path& path, const void* data, std::size_t size) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!out) {
        std::fprintf(stderr, "harness: cannot write %s\n", path.c_str());
        std::abort();
    }
}

/// Stops the run: a finding.
[[noreturn]] inline void finding(const std::string& what) {
    std::fprintf(stderr, "FINDING: %s\n", what.c_str());
    std::fflush(stderr);
    __builtin_trap();
}

/// Runs f(). Returns true when it returns, false when it throws an exception of one of the types
/// Allowed (or derived from one); any other exception is a finding.
template <class... Allowed, class F>
bool only_throws(const char* call, F&& f) {
    try {
        f();
        return true;
    } catch (const std::exception& e) {
        if ((... || (dynamic_cast<const Allowed*>(&e) != nullptr))) return false;
        finding(std::string(call) + " threw an undocumented " + typeid(e).name() + ": " + e.what());
    } catch (...) {
        finding(std::string(call) + " threw something that is not a std::exception");
    }
}

}  // namespace fuzz_io

/// A property every accepted input must have; a finding when it does not hold.
#define FUZZ_CHECK(cond, what)                                                              \
    do {                                                                                    \
        if (!(cond)) ::fuzz_io::finding(std::string("check failed: " #cond ": ") + (what)); \
    } while (0)
