// The unit tests' main: one thread each, set before LibTorch, OpenMP and OpenBLAS load (they
// read the environment then), so the process restarts itself once with it. ctest runs a test
// per core, and tests that time things (the planner's) must not share cores with another test's
// spinning threads (a probe's fp32 run then took 20x its time). Results do not depend on the
// thread count; a variable set by the caller is kept.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

int main(int argc, char** argv) {
  if (std::getenv("MEMFIT_TEST_ENV") == nullptr) {
    setenv("MEMFIT_TEST_ENV", "1", 1);
    setenv("OMP_NUM_THREADS", "1", 0);
    setenv("OPENBLAS_NUM_THREADS", "1", 0);
    setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
    execv("/proc/self/exe", argv);  // returns only on failure: then run as we are
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
