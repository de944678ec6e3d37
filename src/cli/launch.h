// launch.h — `memfit launch --nproc N -- train ...`: N local ranks of `memfit train`, like
// torchrun: each rank is a fresh process (fork + exec of this executable, so no rank inherits a
// LibTorch runtime), its output lines prefixed "[rank R] ", SIGINT/SIGTERM forwarded, and when
// one rank fails the others are stopped and the launcher exits non-zero.
#pragma once

#include <string>
#include <vector>

namespace memfit::cli {

struct LaunchOptions {
  int nproc = 2;
  int master_port = 0;                // 0: a free port on 127.0.0.1
  double grace_seconds = 30;          // SIGTERM/SIGINT, then SIGKILL after this long (ranks
                                      // finish their step and save first)
  std::vector<std::string> command;   // "train" and its flags
};

// Runs the ranks until all exit. Returns 0 if every rank succeeded, else the first failing
// rank's exit code (128 + signal if it was killed; 128 + signal forwarded on SIGINT/SIGTERM).
// Throws std::invalid_argument (one line) for bad options.
int launch(const LaunchOptions& options);

}  // namespace memfit::cli
