// Native because: the operator routes that count their calls are C++ kernels (csrc/routes/).
//
// A call counter per operator route, so that tests can prove which route ran an operator
// (torch_openreg._C._route_calls(name)). One relaxed atomic increment per call.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace openreg {

// [docs:start CALL_COUNTER]
// The counter named `route`, created on first use; the reference stays valid for the process.
inline std::atomic<int64_t>& call_counter(const std::string& route) {
  static std::mutex mutex;
  static std::map<std::string, std::atomic<int64_t>> counters;
  std::lock_guard<std::mutex> lock(mutex);
  return counters[route];
}
// [docs:end CALL_COUNTER]

}  // namespace openreg
