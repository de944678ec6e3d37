// stop_signal.h — Ctrl-C (SIGINT) and SIGTERM asking a training run to stop cleanly.
//
// While a StopOnSignals guard lives, the first such signal only sets a flag: the Trainer
// finishes the step it is in, saves the state (if it saves at all), writes the summary, the
// JSON log and the HTML report, and its summary says `interrupted` (the CLI then exits 130).
// A second signal exits at once with status 130. Without the guard, request_stop() asks the
// same from code (another thread, a callback).
#pragma once

#include <csignal>

namespace memfit {

void request_stop();
bool stop_requested();

class StopOnSignals {
 public:
  StopOnSignals();   // installs the handlers for SIGINT and SIGTERM
  ~StopOnSignals();  // puts the previous handlers back
  StopOnSignals(const StopOnSignals&) = delete;
  StopOnSignals& operator=(const StopOnSignals&) = delete;

 private:
  struct sigaction previous_int_ {}, previous_term_ {};
};

}  // namespace memfit
