// profile_clock.h — the clock every measured second of the profile is read from.
#pragma once

#include <chrono>

namespace memfit {

using ProfileClock = std::chrono::steady_clock;
inline double seconds_since(ProfileClock::time_point t0) {
  return std::chrono::duration<double>(ProfileClock::now() - t0).count();
}

}  // namespace memfit
