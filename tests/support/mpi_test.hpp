// SPDX-License-Identifier: Apache-2.0
#pragma once

// What the MPI tests share: the rank and size of a communicator, and a main that runs the
// GoogleTest suite on every rank and fails when any rank failed.

#include <gtest/gtest.h>
#include <mpi.h>

namespace gattn_test {

inline int rank_of(MPI_Comm c = MPI_COMM_WORLD) {
    int r = 0;
    MPI_Comm_rank(c, &r);
    return r;
}

inline int size_of(MPI_Comm c = MPI_COMM_WORLD) {
    int s = 1;
    MPI_Comm_size(c, &s);
    return s;
}

/// MPI_Init, every test on every rank (each prints its own results), MPI_Finalize; returns
/// nonzero when a test failed on any rank.
inline int run_mpi_tests(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    ::testing::InitGoogleTest(&argc, argv);
    int failed = RUN_ALL_TESTS();
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return failed;
}

}  // namespace gattn_test
