// gattn: gated attention layers for C++ (header-only).
// SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Library version. CMake reads these three lines; they are the only place the version lives.

#define GATTN_VERSION_MAJOR 0
#define GATTN_VERSION_MINOR 1
#define GATTN_VERSION_PATCH 0

/// True when the library version is at least major.minor.patch.
#define GATTN_VERSION_AT_LEAST(major, minor, patch)                                        \
    ((GATTN_VERSION_MAJOR > (major)) ||                                                    \
     (GATTN_VERSION_MAJOR == (major) && GATTN_VERSION_MINOR > (minor)) ||                  \
     (GATTN_VERSION_MAJOR == (major) && GATTN_VERSION_MINOR == (minor) &&                  \
      GATTN_VERSION_PATCH >= (patch)))
