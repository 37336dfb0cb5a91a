// Native because: the exit-time flush drives the autograd engine with a graph that must hold no
// Python object, which only a graph built in C++ guarantees (see autograd.cpp).
#pragma once

namespace openreg {

// True on the autograd engine's worker threads for devices ("pt_autograd_<n>"), where backward
// runs. Used to note those threads here and to size their OpenMP team (ops/cpu_kernel.cpp).
bool is_autograd_worker_thread();

// Called by the DeviceGuard when a thread sets its current device: notes which openreg devices
// have an autograd engine worker thread ("pt_autograd_<n>"). Cheap after a thread's first call.
void note_current_device_set(int device);

// Makes every openreg autograd worker thread finish what it holds of the last backward, so that
// nothing of it is released after the interpreter starts finalizing. Called by an atexit handler
// (torch_openreg/__init__.py) without the GIL. Never throws.
void release_autograd_graphs() noexcept;

}  // namespace openreg
