// Native because: this is minidev's C++ side (examples/minimal_backend/minidev.cpp, included, not
// copied) with the mistake a first DeviceGuard makes: the current device and the current streams
// are process-wide variables instead of per thread. tests/test_minimal_backend.py builds it as
// minidev._C; the device_guard check must fail on it.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/InferSize.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>

#define thread_local  // minidev's headers are in: only its own thread_locals lose the word
#include "minidev.cpp"
