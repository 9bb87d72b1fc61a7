// gattn: gated attention layers for C++ (header-only).
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Library version. CMake reads these three lines; they are the only place the version lives.

#define GATTN_VERSION_MAJOR 0
#define GATTN_VERSION_MINOR 1
#define GATTN_VERSION_PATCH 0

#define GATTN_VERSION_STRINGIFY_(x) #x
#define GATTN_VERSION_STRINGIFY(x) GATTN_VERSION_STRINGIFY_(x)
/// "major.minor.patch", e.g. "0.1.0".
#define GATTN_VERSION_STRING                                                                \
    GATTN_VERSION_STRINGIFY(GATTN_VERSION_MAJOR)                                           \
    "." GATTN_VERSION_STRINGIFY(GATTN_VERSION_MINOR) "." GATTN_VERSION_STRINGIFY(GATTN_VERSION_PATCH)

namespace gattn {
/// The library version, GATTN_VERSION_STRING.
inline const char* version() noexcept { return GATTN_VERSION_STRING; }
}  // namespace gattn

/// True when the library version is at least major.minor.patch.
#define GATTN_VERSION_AT_LEAST(major, minor, patch)                                        \
    ((GATTN_VERSION_MAJOR > (major)) ||                                                    \
     (GATTN_VERSION_MAJOR == (major) && GATTN_VERSION_MINOR > (minor)) ||                  \
     (GATTN_VERSION_MAJOR == (major) && GATTN_VERSION_MINOR == (minor) &&                  \
      GATTN_VERSION_PATCH >= (patch)))
