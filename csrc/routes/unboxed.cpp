// Native because: an unboxed kernel is a C++ function with the operator's C++ signature, and this
// route exists to take the per-operator hot path off the dispatcher's boxing.
//
// Route: unboxed kernels generated from the operator's declaration. The generic fallback is boxed:
// the dispatcher turns the arguments into a stack of IValues (a list of IValues for each tensor
// list), the fallback rewrites the stack, and the CPU kernel turns it back into C++ arguments. For
// the most frequent small operators that is a large part of what a call costs more than on the CPU
// (docs/fallback.md). Here one template, UnboxedRoute<Op>, is instantiated for each operator of a
// list: ATen's generated `at::_ops::<op>` struct gives the C++ signature, the name and a
// `redispatch`, so the compiler writes each kernel. A kernel does what the fallback does, without
// the stack: CPU aliases of the device tensors (the same HostKernel session), the CPU kernel
// through `redispatch`, the write-back of written arguments, results adopted as device tensors.
// Anything out of the ordinary (a graph capture, the asynchronous mode, tensors on several
// devices, a CPU tensor that is not a 0-dim scalar, an undefined tensor) is boxed and handed to
// the generic fallback, which checks, refuses or records it exactly as before.
#include "ops/async_kernel.h"
#include "ops/cow.h"
#include "ops/cpu_kernel.h"
#include "ops/fallback.h"
#include "routes/call_counter.h"
#include "routes/unboxed.h"
#include "runtime/device.h"
#include "runtime/stream.h"

#include <ATen/Operators.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace openreg {
namespace {

constexpr auto kOpenReg = c10::DeviceType::PrivateUse1;

std::atomic<int64_t>& unboxed_calls = call_counter("unboxed.direct");
std::atomic<int64_t>& boxed_calls = call_counter("unboxed.boxed");
std::atomic<bool> g_enabled{true};

template <class T>
using Bare = std::remove_cv_t<std::remove_reference_t<T>>;

// ---- The device of a call, or -1: not the ordinary case (the boxed fallback takes it).
struct Devices {
  int device = -1;
  bool plain = true;
  void tensor(const at::Tensor& t, bool written) {
    if (!t.defined()) return;  // the fallback handles undefined tensors
    const auto type = t.device().type();
    if (type == kOpenReg) {
      const int index = t.device().index();
      if (device < 0) device = index;
      else if (index != device) plain = false;
      if (written && is_cow(t)) plain = false;  // the fallback materializes it (ops/cow.h)
    } else if (type != c10::DeviceType::CPU || t.dim() != 0 || written) {
      plain = false;  // only 0-dim CPU scalars may come along (read)
    }
  }
  template <class T>
  void arg(const T& a, bool written) {
    if constexpr (std::is_same_v<Bare<T>, at::Tensor>) {
      if (!a.defined()) plain = false;
      tensor(a, written);
    } else if constexpr (std::is_same_v<Bare<T>, std::optional<at::Tensor>>) {
      if (a.has_value()) {
        if (!a->defined()) plain = false;
        tensor(*a, written);
      }
    } else if constexpr (std::is_same_v<Bare<T>, at::TensorList>) {
      for (const at::Tensor& t : a) {
        if (!t.defined()) plain = false;
        tensor(t, written);
      }
    }
  }
};

// ---- What the CPU kernel gets for each argument.
template <class T>
struct ToCpu {  // anything that is not a tensor: passed as it is
  using type = T;
  static T convert(HostKernel&, T a) { return std::forward<T>(a); }
};

// A tensor handed to the CPU kernel without a reference count of its own: the alias is held by
// the HostKernel session (or, for a 0-dim CPU scalar, by the caller) for the whole call. A tensor
// list of 500 tensors (a fused optimizer step over 100 parameters) would otherwise pay 1,000
// atomic reference-count operations for the vector alone.
class Borrowed {
 public:
  explicit Borrowed(const at::Tensor& t)
      : t_(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t)) {}
  Borrowed(Borrowed&& other) noexcept : t_(std::move(other.t_)) {}  // leaves it undefined
  Borrowed(const Borrowed&) = delete;
  Borrowed& operator=(const Borrowed&) = delete;
  Borrowed& operator=(Borrowed&&) = delete;
  ~Borrowed() { c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t_); }
  operator at::Tensor&() { return t_; }
  at::Tensor& get() { return t_; }

 private:
  at::Tensor t_;
};

class BorrowedList {
 public:
  BorrowedList() = default;
  BorrowedList(BorrowedList&& other) noexcept : v_(std::move(other.v_)) {}
  ~BorrowedList() {
    for (at::Tensor& t : v_) c10::MaybeOwnedTraits<at::Tensor>::destroyBorrow(t);
  }
  void reserve(size_t n) { v_.reserve(n); }
  void push_back(const at::Tensor& t) {
    v_.push_back(c10::MaybeOwnedTraits<at::Tensor>::createBorrow(t));
  }
  operator at::TensorList() const { return v_; }
  const at::Tensor* data() const { return v_.data(); }

 private:
  std::vector<at::Tensor> v_;
};

inline const at::Tensor& alias_of(HostKernel& k, const at::Tensor& t) {
  return t.device().type() == kOpenReg ? k.alias_ref(t) : t;
}

template <>
struct ToCpu<const at::Tensor&> {
  using type = Borrowed;
  static Borrowed convert(HostKernel& k, const at::Tensor& t) { return Borrowed(alias_of(k, t)); }
};
template <>
struct ToCpu<at::Tensor&> {
  using type = Borrowed;
  static Borrowed convert(HostKernel& k, at::Tensor& t) { return Borrowed(alias_of(k, t)); }
};
template <>
struct ToCpu<const std::optional<at::Tensor>&> {
  using type = std::optional<at::Tensor>;
  static std::optional<at::Tensor> convert(HostKernel& k, const std::optional<at::Tensor>& t) {
    if (!t.has_value()) return std::nullopt;
    return alias_of(k, *t);
  }
};
template <>
struct ToCpu<at::TensorList> {
  using type = BorrowedList;
  static BorrowedList convert(HostKernel& k, at::TensorList list) {
    BorrowedList cpu;
    cpu.reserve(list.size());
    for (const at::Tensor& t : list) cpu.push_back(alias_of(k, t));
    return cpu;
  }
};

// Arguments the fast path does not take (generators and devices need the fallback's rewriting).
template <class T>
constexpr bool supported_arg() {
  using B = Bare<T>;
  return !std::is_same_v<B, std::optional<at::Generator>> && !std::is_same_v<B, at::Generator> &&
         !std::is_same_v<B, std::optional<c10::Device>> && !std::is_same_v<B, c10::Device> &&
         !std::is_same_v<B, c10::List<std::optional<at::Tensor>>>;
}

// The call's written arguments carry the kernel's changes back (resized out= arguments), each
// with the alias the kernel got for it: no lookup in the session.
template <class T, class C>
void sync_arg(HostKernel& k, const T& a, C& cpu) {
  if constexpr (std::is_same_v<Bare<T>, at::Tensor>) {
    if (a.defined() && a.device().type() == kOpenReg) k.sync_written(a, cpu.get());
  } else if constexpr (std::is_same_v<Bare<T>, at::TensorList>) {
    const at::Tensor* aliases = cpu.data();
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].device().type() == kOpenReg) k.sync_written(a[i], aliases[i]);
  } else if constexpr (std::is_same_v<Bare<T>, std::optional<at::Tensor>>) {
    if (a.has_value() && a->defined() && a->device().type() == kOpenReg) k.sync_written(*a, *cpu);
  }
}

// The written argument an in-place or out= kernel returned, as the device tensor.
template <class A, class C>
void match_returned(A& arg, C& cpu, const at::Tensor& returned, at::Tensor*& found) {
  if constexpr (std::is_same_v<A, at::Tensor>) {
    if (found == nullptr && cpu.get().unsafeGetTensorImpl() == returned.unsafeGetTensorImpl())
      found = &arg;
  }
}

void check_result(const at::Tensor& t, const c10::OperatorHandle& op) {
  TORCH_CHECK_NOT_IMPLEMENTED(t.layout() == c10::kStrided && !c10::isQIntType(t.scalar_type()),
                              "openreg: ", op.schema().operator_name(),
                              " returned a tensor it cannot hand back");
}

template <class Op, class Sig = typename Op::schema>
struct UnboxedRoute;

template <class Op, class Ret, class... Args>
struct UnboxedRoute<Op, Ret(Args...)> {
  static_assert((supported_arg<Args>() && ...), "an argument the unboxed route cannot take");

  // [docs:start UNBOXED_KEEPS_METADATA]
  // An in-place operator (ATen's `inplace` tag) that is not tagged `inplace_view` (resize_, set_,
  // squeeze_, as_strided_, ...) writes its arguments' elements, never their sizes, strides,
  // storage or math bits: its written arguments need no write-back, which compares four objects
  // per tensor (an alias and a device tensor, each with its storage). `_resize_output_` is tagged
  // `inplace` alone and resizes, so names with "resize" keep the write-back, as do out= and
  // metadata operators.
  static bool keeps_metadata() {
    static const bool keeps = [] {
      const c10::OperatorHandle& h = op();
      const std::string& name = h.schema().name();
      return h.hasTag(at::Tag::inplace) && !h.hasTag(at::Tag::inplace_view) &&
             name.find("resize") == std::string::npos;
    }();
    return keeps;
  }
  // [docs:end UNBOXED_KEEPS_METADATA]

  static const c10::OperatorHandle& op() { return op_handle<Op>(); }

  static Ret boxed(c10::DispatchKeySet ks, Args... args) {
    boxed_calls.fetch_add(1, std::memory_order_relaxed);
    return c10::impl::BoxedKernelWrapper<Ret(Args...)>::call(
        c10::BoxedKernel::makeFromFunction<&generic_fallback>(), op(), ks,
        std::forward<Args>(args)...);
  }

  static const std::array<bool, sizeof...(Args)>& writes() {
    return written_args<Op, sizeof...(Args)>();
  }

  // [docs:start UNBOXED_MEMO_SITE]
  // Tensor-list operators keep a memo of their last call's tensors (cpu_kernel.cpp, ALIAS_MEMO):
  // an optimizer step passes the same parameters and states to the same operator every step.
  static int memo_site() {
    if constexpr ((std::is_same_v<Bare<Args>, at::TensorList> || ...)) {
      static const int site = HostKernel::new_memo_site();
      return site;
    } else {
      return -1;
    }
  }
  // [docs:end UNBOXED_MEMO_SITE]

  // [docs:start UNBOXED_ROUTE]
  static Ret call(c10::DispatchKeySet ks, Args... args) {
    const auto& w = writes();
    Devices d;
    {
      size_t i = 0;
      (d.arg(args, w[i++]), ...);
    }
    // The fallback decides, checks, records or queues anything else, exactly as without the route.
    if (!g_enabled.load(std::memory_order_relaxed) || !d.plain || d.device < 0 ||
        async_kernels_enabled() || capturing(d.device) != nullptr)
      return boxed(ks, std::forward<Args>(args)...);
    unboxed_calls.fetch_add(1, std::memory_order_relaxed);
    check_device(d.device);
    return run(d.device, w, std::index_sequence_for<Args...>{}, args...);
  }

  template <size_t... I>
  static Ret run(int device, const std::array<bool, sizeof...(Args)>& w,
                 std::index_sequence<I...>, Args&... args) {
    HostKernel k(device, memo_site());
    k.caller_holds_arguments();  // the caller's references outlive the call
    std::tuple<typename ToCpu<Args>::type...> cpu{ToCpu<Args>::convert(k, args)...};
    const bool write_back = !keeps_metadata();
    auto sync = [&] {
      if (write_back) ((w[I] ? sync_arg(k, args, std::get<I>(cpu)) : void()), ...);
    };
    auto invoke = [&]() -> decltype(auto) {
      return Op::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), std::get<I>(cpu)...);
    };
    // [docs:end UNBOXED_ROUTE]
    try {
      if constexpr (std::is_void_v<Ret>) {
        invoke();
        sync();
        return;
      } else if constexpr (std::is_same_v<Ret, at::Tensor&>) {
        at::Tensor& r = invoke();
        sync();
        // An in-place or out= kernel returns its written argument: the device tensor itself.
        at::Tensor* found = nullptr;
        (match_returned(args, std::get<I>(cpu), r, found), ...);
        TORCH_INTERNAL_ASSERT(found != nullptr, "openreg: ", op().schema().operator_name(),
                              " returned a tensor that is not its written argument");
        return *found;
      } else if constexpr (std::is_same_v<Ret, at::Tensor>) {
        at::Tensor r = invoke();
        sync();
        if (r.defined() && r.is_cpu()) {
          check_result(r, op());
          return k.result(std::move(r));
        }
        return r;
      } else {
        static_assert(std::is_same_v<Ret, std::vector<at::Tensor>>, "a return the route cannot give");
        std::vector<at::Tensor> r = invoke();
        sync();
        for (at::Tensor& t : r)
          if (t.defined() && t.is_cpu()) {
            check_result(t, op());
            t = k.result(std::move(t));
          }
        return r;
      }
    } catch (c10::Error& e) {
      sync();
      add_error_context(e, op(), device);
      throw;
    }
  }
};

// [docs:start UNBOXED_OPS]
// The operators the route serves: the most frequent small operators of test suites, gradchecks
// and optimizer steps (element-wise arithmetic, foreach and fused optimizer kernels, matrix
// products, activations and their backward, reductions, softmax, the element-wise kernels of
// the for-loop forms of Adam and AdamW, and the dot products, reductions and comparisons of LBFGS's
// line search, each called hundreds of times per step on 0-dim and 2-element tensors).
#define OPENREG_UNBOXED_OPS(X)                                                      \
  X(add_Tensor) X(add__Tensor) X(sub_Tensor) X(sub__Tensor) X(mul_Tensor)           \
  X(mul__Tensor) X(div_Tensor) X(div__Tensor)                                       \
  X(_foreach_add__List) X(_foreach_add__Scalar) X(_foreach_mul__List)               \
  X(_foreach_mul__Scalar) X(_foreach_lerp__Scalar) X(_foreach_lerp__List)           \
  X(_foreach_addcmul__Scalar) X(_foreach_addcdiv__Scalar) X(_foreach_sqrt)          \
  X(_foreach_div__List) X(_foreach_add_List) X(_foreach_mul_Scalar)                 \
  X(_fused_adam_) X(_fused_adamw_) X(_fused_sgd_)                                  \
  X(mm) X(addmm) X(bmm) X(mm_out) X(addmm_out) X(bmm_out)                         \
  X(tanh) X(sigmoid) X(exp) X(neg) X(relu) X(pow_Tensor_Scalar)                   \
  X(sum_dim_IntList) X(mean_dim) X(_softmax) X(_log_softmax) X(_softmax_backward_data) \
  X(tanh_backward) X(sigmoid_backward) X(threshold_backward)                       \
  X(lerp__Scalar) X(addcmul_) X(addcdiv_) X(sqrt) X(rsqrt) X(div__Scalar)          \
  X(div_Scalar) X(eq_Scalar) X(gt_Scalar) X(sum) X(linalg_vector_norm) X(clamp_min)   \
  X(dot) X(max) X(reciprocal) X(lt_Scalar) X(le_Scalar) X(ge_Scalar)                \
  X(lt_Tensor) X(le_Tensor)
// [docs:end UNBOXED_OPS]

// [docs:start UNBOXED_REGISTRATION]
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
#define OPENREG_REGISTER(op) \
  m.impl(registration_name<at::_ops::op>(), TORCH_FN((&UnboxedRoute<at::_ops::op>::call)));
  OPENREG_UNBOXED_OPS(OPENREG_REGISTER)
#undef OPENREG_REGISTER
}
// [docs:end UNBOXED_REGISTRATION]

}  // namespace

void set_unboxed_route(bool enabled) { g_enabled.store(enabled); }
bool unboxed_route_enabled() { return g_enabled.load(); }

}  // namespace openreg
