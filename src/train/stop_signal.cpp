#include "memfit/train/stop_signal.h"

#include <unistd.h>

#include <atomic>

namespace memfit {
namespace {

std::atomic<bool> g_stop{false};

void on_signal(int) {
  if (g_stop.exchange(true)) _exit(130);  // the second signal: at once (async-signal-safe)
  static const char note[] = "\nmemfit: stopping after this step (again to stop at once)\n";
  (void)!::write(2, note, sizeof note - 1);
}

}  // namespace

void request_stop() { g_stop.store(true); }
bool stop_requested() { return g_stop.load(); }

StopOnSignals::StopOnSignals() {
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, &previous_int_);
  sigaction(SIGTERM, &action, &previous_term_);
}

StopOnSignals::~StopOnSignals() {
  sigaction(SIGINT, &previous_int_, nullptr);
  sigaction(SIGTERM, &previous_term_, nullptr);
}

}  // namespace memfit
