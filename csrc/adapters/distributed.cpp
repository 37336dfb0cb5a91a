// Native because: c10d's ProcessGroup routes each tensor to the c10d::Backend registered for its
// device type, and a Backend can only be a C++ class (torch 2.13 has a Python trampoline for
// ProcessGroup, not for Backend: a Python group replaces the whole ProcessGroup, so
// "cpu:gloo,openreg:occl" could not compose); DDP's reducer also issues collectives from the
// autograd thread, where a C++ backend needs no GIL.
//
// occl (docs/distributed.md): a c10d backend for openreg tensors built on gloo. Each collective
// hands gloo CPU tensors that alias the device memory (cpu_alias: same address, sizes, strides),
// so gloo reads and writes device memory in place: no copy to the host and back. What gloo does
// not do itself, occl adds around it: stream order, AVG and PREMUL_SUM, device tensors in the
// results and futures, host access to device pages in strict-memory mode.
#include "adapters/distributed.h"

#include "ops/cpu_kernel.h"
#include "runtime/faults.h"
#include "runtime/memory.h"
#include "runtime/stream.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>

namespace openreg {
namespace {

using c10d::Backend;
using c10d::OpType;
using c10d::ReduceOp;
using c10d::Work;
using TensorList = std::vector<at::Tensor>;

bool on_device(const at::Tensor& t) {
  return t.defined() && t.device().type() == c10::DeviceType::PrivateUse1;
}

// [docs:start OCCL_WORK]
// The Work returned for an occl collective: gloo's Work underneath, but its result and future
// hold the device tensors (DDP's reducer and FSDP read the reduced bucket from the future), and
// a completion step (AVG's division) runs before anyone sees the result.
class OcclWork : public Work {
 public:
  OcclWork(OpType type, c10::intrusive_ptr<Work> inner, TensorList outputs,
           std::vector<c10::Device> devices, std::function<void()> finish,
           std::shared_ptr<KernelScope> scope, std::optional<DeviceActivity> profiled)
      : Work(-1, type), inner_(std::move(inner)), state_(std::make_shared<State>()) {
    state_->outputs = std::move(outputs);
    state_->finish = std::move(finish);
    state_->scope = std::move(scope);
    state_->profiled = std::move(profiled);
    state_->future = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), std::move(devices));
    c10::intrusive_ptr<c10::ivalue::Future> inner_future;
    try {
      inner_future = inner_->getFuture();
    } catch (const std::exception&) {
      // gloo's send/recv works have no future: they complete in wait() or isCompleted()
    }
    if (inner_future) {
      inner_future->addCallback([state = state_](c10::ivalue::Future& done) {
        state->complete(done.hasError() ? done.exception_ptr() : nullptr);
      });
    }
  }

  // Blocks the host until the collective has finished (gloo's wait, which raises gloo's errors
  // and timeouts): kernels issued afterwards on any stream see the result. The completion step
  // runs on whichever thread gets there first, this one or gloo's callback, so the host is not
  // woken a second time for it.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    bool ok = false;
    try {
      ok = inner_->wait(timeout);
    } catch (...) {
      state_->complete(std::current_exception());
      throw;
    }
    state_->complete(nullptr);
    state_->future->waitAndThrow();
    return ok;
  }
  bool isCompleted() override {
    if (!state_->future->completed() && inner_->isCompleted())
      state_->complete(inner_->exception());
    return state_->future->completed();
  }
  bool isSuccess() const override {
    return state_->future->completed() && !state_->future->hasError();
  }
  std::exception_ptr exception() const override {
    auto& f = state_->future;
    return f->completed() && f->hasError() ? f->exception_ptr() : nullptr;
  }
  int sourceRank() const override { return inner_->sourceRank(); }
  TensorList result() override { return state_->outputs; }
  void synchronize() override {}
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return state_->future; }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }

 private:
  // Shared with gloo's completion callback.
  struct State {
    std::mutex mutex;
    bool done = false;
    TensorList outputs;
    std::function<void()> finish;
    std::shared_ptr<KernelScope> scope;
    c10::intrusive_ptr<c10::ivalue::Future> future;
    std::optional<DeviceActivity> profiled;  // issued while the profiler recorded

    // Once: the completion step (e.g. AVG's division), then the future, then the host access.
    void complete(std::exception_ptr error) {
      std::lock_guard guard(mutex);
      if (done) return;
      done = true;
      if (!error && finish) {
        try {
          finish();
        } catch (...) {
          error = std::current_exception();
        }
      }
      if (error) {
        future->setError(error);
      } else {
        future->markCompleted(c10::IValue(outputs));
      }
      scope.reset();
      if (profiled.has_value()) {  // the profiler's device row: from issue to the result
        if (ActivityRecorder* r = activity_recorder()) {
          profiled->end_ns = activity_clock_ns();
          r->record(*profiled);
        }
      }
    }
  };

  c10::intrusive_ptr<Work> inner_;
  std::shared_ptr<State> state_;
};
// [docs:end OCCL_WORK]

// The Work of a coalesced group of operations: completes when all of them have.
class CoalescedWork : public Work {
 public:
  explicit CoalescedWork(std::vector<c10::intrusive_ptr<Work>> works)
      : Work(-1, OpType::COALESCED), works_(std::move(works)) {
    std::vector<c10::Device> devices;
    for (const auto& w : works_)
      for (const auto& t : w->result())
        if (on_device(t) && std::find(devices.begin(), devices.end(), t.device()) == devices.end())
          devices.push_back(t.device());
    future_ = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), devices);
  }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override {
    try {
      for (auto& w : works_) w->wait(timeout);
    } catch (...) {
      if (!future_->completed()) future_->setErrorIfNeeded(std::current_exception());
      throw;
    }
    if (!future_->completed()) future_->markCompleted(c10::IValue(result()));
    return true;
  }
  bool isCompleted() override {
    for (auto& w : works_)
      if (!w->isCompleted()) return false;
    return true;
  }
  TensorList result() override {
    TensorList out;
    for (auto& w : works_)
      for (auto& t : w->result()) out.push_back(t);
    return out;
  }
  void synchronize() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<c10::intrusive_ptr<Work>> works_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// [docs:start OCCL_CALL]
// One collective being issued: device tensors become CPU aliases of their memory for gloo; the
// host waits for the current stream of every device involved, so the collective sees every
// kernel and copy issued before it (kernels run inline on the issuing thread, so this waits only
// for queued asynchronous work, e.g. a non_blocking copy still in flight).
class Call {
 public:
  at::Tensor alias(const at::Tensor& t) {
    if (!on_device(t)) return t;
    if (std::find(devices_.begin(), devices_.end(), t.device()) == devices_.end())
      devices_.push_back(t.device());
    return cpu_alias(t);
  }
  TensorList alias(const TensorList& ts) {
    TensorList out;
    out.reserve(ts.size());
    for (const auto& t : ts) out.push_back(alias(t));
    return out;
  }
  std::vector<TensorList> alias(const std::vector<TensorList>& ls) {
    std::vector<TensorList> out;
    out.reserve(ls.size());
    for (const auto& l : ls) out.push_back(alias(l));
    return out;
  }

  // After the aliases were taken, before gloo (or occl itself) touches the memory.
  void start() {
    on_collective("occl");  // an injected hang or exit of this rank (runtime/faults.h)
    if (ActivityRecorder* r = activity_recorder(); r != nullptr && !devices_.empty()) {
      const int device = devices_.front().index();
      profiled_ = DeviceActivity{ActivityKind::Collective, device, current_stream_id(device),
                                 activity_clock_ns(), 0, 0, r->issuer()};
      profiled_->issuer.start_ns = profiled_->start_ns;
    }
    for (const auto& d : devices_) stream_synchronize(current_stream(d.index()));
    // In strict-memory mode, device pages are open to the host while the collective runs.
    if (strict_memory() && !devices_.empty()) scope_ = std::make_shared<KernelScope>();
  }

  c10::intrusive_ptr<Work> finish(OpType type, c10::intrusive_ptr<Work> inner, TensorList outputs,
                                  std::function<void()> post = nullptr) {
    if (profiled_.has_value()) {
      std::string name = c10d::opTypeToString(type);
      std::transform(name.begin(), name.end(), name.begin(), ::tolower);
      profiled_->name = "occl:" + name;
      for (const auto& t : outputs) profiled_->bytes += t.numel() * t.element_size();
      profiled_->issuer.end_ns = activity_clock_ns();
    }
    return c10::make_intrusive<OcclWork>(type, std::move(inner), std::move(outputs), devices_,
                                         std::move(post), std::move(scope_),
                                         std::move(profiled_));
  }

 private:
  std::vector<c10::Device> devices_;
  std::shared_ptr<KernelScope> scope_;
  std::optional<DeviceActivity> profiled_;
};
// [docs:end OCCL_CALL]

bool is_floating(const at::Tensor& t) { return at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()); }

// [docs:start OCCL_REDUCE_OPS]
// gloo reduces with SUM, PRODUCT, MIN, MAX and the bitwise ops. occl adds the two NCCL has:
// AVG = SUM, then a division by the group size once the sum is complete (integer tensors divide
// with truncation, as NCCL's ncclAvg); PREMUL_SUM = SUM of the inputs multiplied by the factor
// (scaled in place when the input is the output, through a scaled copy otherwise).
struct Reduction {
  ReduceOp gloo_op;
  double premul = 1.0;
  at::Tensor premul_tensor;
  bool average = false;
};

Reduction reduction(const ReduceOp& op) {
  Reduction r{op};
  if (op.op_ == ReduceOp::AVG) {
    r.gloo_op = ReduceOp(ReduceOp::SUM);
    r.average = true;
  } else if (op.op_ == ReduceOp::PREMUL_SUM) {
    auto* s = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK(s != nullptr, "occl: ReduceOp.PREMUL_SUM without its factor");
    r.gloo_op = ReduceOp(ReduceOp::SUM);
    r.premul = s->double_factor;
    if (s->tensor_factor.defined()) r.premul_tensor = s->tensor_factor;
  }
  return r;
}

bool premultiplies(const Reduction& r) {
  return r.premul_tensor.defined() || r.premul != 1.0;
}

void premultiply(const Reduction& r, at::Tensor& t) {
  if (r.premul_tensor.defined()) {
    t.mul_(r.premul_tensor.cpu().item());  // scalar factor, on the host
  } else {
    t.mul_(r.premul);
  }
}

std::function<void()> average(const Reduction& r, TensorList outputs, int size) {
  if (!r.average) return nullptr;
  return [outputs = std::move(outputs), size] {
    for (auto t : outputs) {
      if (is_floating(t)) {
        t.div_(size);
      } else {
        t.div_(size, "trunc");
      }
    }
  };
}
// [docs:end OCCL_REDUCE_OPS]

// [docs:start OCCL_AGREE]
// Before each collective, the ranks of the group compare what they are about to run: gloo
// trusts each rank's sizes, and a rank that receives more bytes than its buffer holds is aborted
// by gloo's transport thread (SIGABRT), while a rank with a larger buffer may return with it
// partly filled. occl exchanges a fixed-size record per rank first (one small all-gather through
// the same gloo backend, so every rank's tags stay in step): a hash of what must agree (kind,
// reduction, root, dtypes and element counts: gloo moves elements, so [6] and [2, 3] agree)
// and, for all_to_all_single, whose inputs and outputs may differ by rank, the element counts
// sent to and expected from each peer. When the records disagree, every rank takes part in a
// second all-gather of the descriptions and raises the same error naming each rank's call.
struct Signature {
  std::string text;  // kind, reduction, root, dtypes and shapes: "ALLREDUCE(SUM) (Float[2, 3])"
  std::vector<int64_t> sends, receives;  // elements per peer; all_to_all_single only
};

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << t.sizes();
  return s.str();
}
template <typename T>  // a tensor list, or a list of them
std::string describe(const std::vector<T>& items) {
  std::string s = "(";
  for (size_t i = 0; i < items.size(); ++i) s += (i ? ", " : "") + describe(items[i]);
  return s + ")";
}
std::string describe(const ReduceOp& op) {
  static const char* names[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND",
                                "BOR", "BXOR", "PREMUL_SUM", "UNUSED"};
  const auto i = static_cast<size_t>(op.op_);
  return i < sizeof(names) / sizeof(names[0]) ? names[i] : std::to_string(i);
}

// What is hashed: the description with each shape replaced by its element count.
std::string agreed_part(const std::string& text) {
  std::string key;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '[') {
      key += text[i];
      continue;
    }
    const size_t end = text.find(']', i);
    int64_t numel = 1, dim = 0;
    bool digits = false;
    for (size_t k = i + 1; k < end; ++k) {
      if (std::isdigit(static_cast<unsigned char>(text[k]))) {
        dim = dim * 10 + (text[k] - '0');
        digits = true;
      } else if (text[k] == ',') {
        numel *= dim;
        dim = 0;
        digits = false;
      }
    }
    if (digits) numel *= dim;
    key += "{" + std::to_string(numel) + "}";
    i = end;
  }
  return key;
}

uint64_t fnv1a(const std::string& text) {  // the same on every machine, unlike std::hash
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ULL;
  return h;
}
// [docs:end OCCL_AGREE]

class OcclBackend : public Backend {
 public:
  OcclBackend(c10::intrusive_ptr<Backend> gloo, bool check)
      : Backend(gloo->getRank(), gloo->getSize()), gloo_(std::move(gloo)), check_(check) {}

  const std::string getBackendName() const override { return "occl"; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return gloo_->getBackendOptions(); }
  // [docs:start OCCL_COALESCING]
  // Coalescing (torch.distributed._coalescing_manager, batch_isend_irecv): the operations issued
  // between start and end run as they are issued; endCoalescing returns one Work that completes
  // when all of them have.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override {
    std::lock_guard guard(coalescing_mutex_);
    TORCH_CHECK(!coalescing_, "occl: startCoalescing called twice without endCoalescing");
    coalescing_ = true;
    coalesced_.clear();
  }
  c10::intrusive_ptr<Work> endCoalescing() override {
    std::lock_guard guard(coalescing_mutex_);
    TORCH_CHECK(coalescing_, "occl: endCoalescing called without startCoalescing");
    coalescing_ = false;
    return c10::make_intrusive<CoalescedWork>(std::move(coalesced_));
  }
  // [docs:end OCCL_COALESCING]
  // [docs:start OCCL_SPLIT]
  // Splitting (split_group, DeviceMesh's dimensions when the default group is bound to a device):
  // ProcessGroup::splitGroup calls split on each device type's backend with the same store and
  // options, gloo's (CPU tensors) first. occl splits its own gloo backend in its own key space of
  // that store, and wraps the result; a rank outside `ranks` gets no backend, as with gloo.
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                    const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override {
    // gloo maps `ranks` to global ranks through its options, which torch does not fill for a
    // backend it got from occl's creator: taken as the world group (docs/distributed.md)
    auto own = gloo_->getBackendOptions();
    if (own->global_ranks_in_group.empty())
      for (int r = 0; r < getSize(); ++r) own->global_ranks_in_group.push_back(r);
    auto gloo = gloo_->split(c10::make_intrusive<c10d::PrefixStore>("openreg/", store), ranks, opts);
    if (!gloo) return nullptr;
    auto occl = c10::make_intrusive<OcclBackend>(std::move(gloo), check_);
    occl->setGroupUid(opts->group_name);
    return occl;
  }
  // [docs:end OCCL_SPLIT]
  const c10::intrusive_ptr<Backend>& gloo() const { return gloo_; }
  bool checks() const { return check_; }

  void setTimeout(std::chrono::milliseconds timeout) override { gloo_->setTimeout(timeout); }
  void setSequenceNumberForGroup() override { gloo_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return gloo_->getSequenceNumberForGroup(); }
  void abort() override { gloo_->abort(); }
  void shutdown() override { gloo_->shutdown(); }

  // [docs:start OCCL_ALLREDUCE]
  // allreduce and allreduce_coalesced: gloo reduces the aliases of the device memory in place;
  // the reductions gloo lacks are made of one it has (PREMUL_SUM: scale, then SUM; AVG: SUM,
  // then divide once the work is done).
  template <typename Options, typename GlooCall>
  c10::intrusive_ptr<Work> reduce_in_place(TensorList& tensors, const Options& opts, OpType type,
                                           GlooCall gloo_call) {
    agree([&] {
      return Signature{c10d::opTypeToString(type) + "(" + describe(opts.reduceOp) + ") " +
                       describe(tensors)};
    });
    Call call;
    TensorList a = call.alias(tensors);
    Reduction r = reduction(opts.reduceOp);
    call.start();
    if (premultiplies(r))
      for (auto& t : a) premultiply(r, t);
    Options o = opts;
    o.reduceOp = r.gloo_op;
    auto inner = gloo_call(a, o);
    return record(call.finish(type, inner, tensors, average(r, a, getSize())));
  }

  c10::intrusive_ptr<Work> allreduce(TensorList& tensors,
                                     const c10d::AllreduceOptions& opts) override {
    return reduce_in_place(tensors, opts, OpType::ALLREDUCE,
                           [this](TensorList& a, c10d::AllreduceOptions& o) {
                             return gloo_->allreduce(a, o);
                           });
  }
  // [docs:end OCCL_ALLREDUCE]

  c10::intrusive_ptr<Work> allreduce_coalesced(
      TensorList& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    return reduce_in_place(tensors, opts, OpType::ALLREDUCE_COALESCED,
                           [this](TensorList& a, c10d::AllreduceCoalescedOptions& o) {
                             return gloo_->allreduce_coalesced(a, o);
                           });
  }

  // reduce: the root gets the reduction; on the other ranks the tensor is gloo's scratch space
  // (partial reductions), as with gloo on the CPU, and AVG divides it there too, as gloo on the
  // CPU does (NCCL leaves non-root tensors unchanged; docs/distributed.md).
  c10::intrusive_ptr<Work> reduce(TensorList& tensors, const c10d::ReduceOptions& opts) override {
    agree([&] {
      return Signature{"REDUCE(" + describe(opts.reduceOp) + ", root " +
                       std::to_string(opts.rootRank) + ") " + describe(tensors)};
    });
    Call call;
    TensorList a = call.alias(tensors);
    Reduction r = reduction(opts.reduceOp);
    call.start();
    if (premultiplies(r))
      for (auto& t : a) premultiply(r, t);
    c10d::ReduceOptions o = opts;
    o.reduceOp = r.gloo_op;
    auto inner = gloo_->reduce(a, o);
    return record(call.finish(OpType::REDUCE, inner, tensors, average(r, a, getSize())));
  }

  c10::intrusive_ptr<Work> broadcast(TensorList& tensors,
                                      const c10d::BroadcastOptions& opts) override {
    agree([&] {
      return Signature{"BROADCAST(root " + std::to_string(opts.rootRank) + ") " +
                       describe(tensors)};
    });
    Call call;
    TensorList a = call.alias(tensors);
    call.start();
    return record(call.finish(OpType::BROADCAST, gloo_->broadcast(a, opts), tensors));
  }

  c10::intrusive_ptr<Work> allgather(std::vector<TensorList>& outputs, TensorList& inputs,
                                     const c10d::AllgatherOptions& opts) override {
    agree([&] { return Signature{"ALLGATHER " + describe(inputs) + " -> " + describe(outputs)}; });
    Call call;
    auto ao = call.alias(outputs);
    auto ai = call.alias(inputs);
    call.start();
    return record(call.finish(OpType::ALLGATHER, gloo_->allgather(ao, ai, opts), flat(outputs)));
  }

  c10::intrusive_ptr<Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) override {
    agree([&] {
      return Signature{"ALLGATHER_BASE " + describe(input) + " -> " + describe(output)};
    });
    Call call;
    at::Tensor ao = call.alias(output);
    at::Tensor ai = call.alias(input);
    call.start();
    return record(call.finish(OpType::_ALLGATHER_BASE, gloo_->_allgather_base(ao, ai, opts), {output}));
  }

  c10::intrusive_ptr<Work> allgather_coalesced(std::vector<TensorList>& outputs,
                                               TensorList& inputs,
                                               const c10d::AllgatherOptions& opts) override {
    agree([&] {
      return Signature{"ALLGATHER_COALESCED " + describe(inputs) + " -> " + describe(outputs)};
    });
    Call call;
    auto ao = call.alias(outputs);
    auto ai = call.alias(inputs);
    call.start();
    return record(call.finish(OpType::ALLGATHER_COALESCED, gloo_->allgather_coalesced(ao, ai, opts),
                       flat(outputs)));
  }

  c10::intrusive_ptr<Work> allgather_into_tensor_coalesced(
      TensorList& outputs, TensorList& inputs, const c10d::AllgatherOptions& opts) override {
    agree([&] {
      return Signature{"ALLGATHER_INTO_TENSOR_COALESCED " + describe(inputs) + " -> " +
                       describe(outputs)};
    });
    Call call;
    auto ao = call.alias(outputs);
    auto ai = call.alias(inputs);
    call.start();
    return record(call.finish(OpType::ALLGATHER_COALESCED,
                       gloo_->allgather_into_tensor_coalesced(ao, ai, opts), outputs));
  }

  c10::intrusive_ptr<Work> gather(std::vector<TensorList>& outputs, TensorList& inputs,
                                  const c10d::GatherOptions& opts) override {
    // only the root has outputs
    agree([&] {
      return Signature{"GATHER(root " + std::to_string(opts.rootRank) + ") " + describe(inputs)};
    });
    Call call;
    auto ao = call.alias(outputs);
    auto ai = call.alias(inputs);
    call.start();
    return record(call.finish(OpType::GATHER, gloo_->gather(ao, ai, opts), flat(outputs)));
  }

  c10::intrusive_ptr<Work> scatter(TensorList& outputs, std::vector<TensorList>& inputs,
                                   const c10d::ScatterOptions& opts) override {
    // only the root has inputs
    agree([&] {
      return Signature{"SCATTER(root " + std::to_string(opts.rootRank) + ") " + describe(outputs)};
    });
    Call call;
    auto ao = call.alias(outputs);
    auto ai = call.alias(inputs);
    call.start();
    return record(call.finish(OpType::SCATTER, gloo_->scatter(ao, ai, opts), outputs));
  }

  c10::intrusive_ptr<Work> reduce_scatter(TensorList& outputs, std::vector<TensorList>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    // outputs may differ by rank (each rank's share of the inputs, which all ranks pass alike)
    agree([&] {
      return Signature{"REDUCE_SCATTER(" + describe(opts.reduceOp) + ") " + describe(inputs)};
    });
    Call call;
    auto ao = call.alias(outputs);
    auto ai = call.alias(inputs);
    Reduction r = reduction(opts.reduceOp);
    call.start();
    if (premultiplies(r))
      for (auto& l : ai)
        for (auto& t : l) t = scaled_copy(r, t);
    c10d::ReduceScatterOptions o = opts;
    o.reduceOp = r.gloo_op;
    auto inner = gloo_->reduce_scatter(ao, ai, o);
    return record(call.finish(OpType::REDUCE_SCATTER, inner, outputs, average(r, ao, getSize())));
  }

  c10::intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) override {
    agree([&] {
      return Signature{"REDUCE_SCATTER_BASE(" + describe(opts.reduceOp) + ") " + describe(input) +
                       " -> " + describe(output)};
    });
    Call call;
    at::Tensor ao = call.alias(output);
    at::Tensor ai = call.alias(input);
    Reduction r = reduction(opts.reduceOp);
    call.start();
    if (premultiplies(r)) ai = scaled_copy(r, ai);
    c10d::ReduceScatterOptions o = opts;
    o.reduceOp = r.gloo_op;
    auto inner = gloo_->_reduce_scatter_base(ao, ai, o);
    return record(call.finish(OpType::_REDUCE_SCATTER_BASE, inner, {output},
                       average(r, {ao}, getSize())));
  }

  c10::intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
      TensorList& outputs, TensorList& inputs, const c10d::ReduceScatterOptions& opts) override {
    agree([&] {
      return Signature{"REDUCE_SCATTER_TENSOR_COALESCED(" + describe(opts.reduceOp) + ") " +
                       describe(inputs) + " -> " + describe(outputs)};
    });
    Call call;
    auto ao = call.alias(outputs);
    auto ai = call.alias(inputs);
    Reduction r = reduction(opts.reduceOp);
    call.start();
    if (premultiplies(r))
      for (auto& t : ai) t = scaled_copy(r, t);
    c10d::ReduceScatterOptions o = opts;
    o.reduceOp = r.gloo_op;
    auto inner = gloo_->reduce_scatter_tensor_coalesced(ao, ai, o);
    return record(call.finish(OpType::REDUCE_SCATTER_TENSOR_COALESCED, inner, outputs,
                       average(r, ao, getSize())));
  }

  c10::intrusive_ptr<Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                         std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits,
                                         const c10d::AllToAllOptions& opts) override {
    agree([&] { return all_to_all_single(output, input, output_splits, input_splits); });
    Call call;
    at::Tensor ao = call.alias(output);
    at::Tensor ai = call.alias(input);
    call.start();
    return record(call.finish(OpType::ALLTOALL_BASE,
                       gloo_->alltoall_base(ao, ai, output_splits, input_splits, opts), {output}));
  }

  c10::intrusive_ptr<Work> alltoall(TensorList& outputs, TensorList& inputs,
                                    const c10d::AllToAllOptions& opts) override {
    agree([&] { return all_to_all(outputs, inputs); });
    Call call;
    auto ao = call.alias(outputs);
    auto ai = call.alias(inputs);
    call.start();
    return record(call.finish(OpType::ALLTOALL, gloo_->alltoall(ao, ai, opts), outputs));
  }

  c10::intrusive_ptr<Work> send(TensorList& tensors, int dst, int tag) override {
    Call call;
    auto a = call.alias(tensors);
    call.start();
    return record(call.finish(OpType::SEND, gloo_->send(a, dst, tag), tensors));
  }

  c10::intrusive_ptr<Work> recv(TensorList& tensors, int src, int tag) override {
    Call call;
    auto a = call.alias(tensors);
    call.start();
    return record(call.finish(OpType::RECV, gloo_->recv(a, src, tag), tensors));
  }

  c10::intrusive_ptr<Work> recvAnysource(TensorList& tensors, int tag) override {
    Call call;
    auto a = call.alias(tensors);
    call.start();
    return record(call.finish(OpType::RECVANYSOURCE, gloo_->recvAnysource(a, tag), tensors));
  }

  c10::intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    agree([&] { return Signature{"BARRIER"}; });
    Call call;
    call.start();
    return record(call.finish(OpType::BARRIER, gloo_->barrier(opts), {}));
  }

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    gloo_->monitoredBarrier(opts, wait_all_ranks);
  }

 private:
  static TensorList flat(const std::vector<TensorList>& ls) {
    TensorList out;
    for (const auto& l : ls) out.insert(out.end(), l.begin(), l.end());
    return out;
  }
  // all-to-all: each rank may send and receive a different number of elements per peer; the
  // records carry them, and the description only what every rank shares (dtype, row shape).
  Signature all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                              const std::vector<int64_t>& output_splits,
                              const std::vector<int64_t>& input_splits) const {
    const int n = getSize();
    auto per_peer = [n](const at::Tensor& t, const std::vector<int64_t>& splits) {
      const int64_t rows = t.dim() > 0 ? t.size(0) : 1;
      const int64_t row = rows > 0 ? t.numel() / rows : 0;
      std::vector<int64_t> counts(n, rows / n * row);
      if (!splits.empty())
        for (int j = 0; j < n && j < static_cast<int>(splits.size()); ++j)
          counts[j] = splits[j] * row;
      return counts;
    };
    // gloo moves elements: the rows' shapes may differ too (an empty tensor from a rank that
    // sends nothing)
    return {"ALLTOALL_BASE " + std::string(c10::toString(input.scalar_type())),
            per_peer(input, input_splits), per_peer(output, output_splits)};
  }
  Signature all_to_all(const TensorList& outputs, const TensorList& inputs) const {
    Signature sig{"ALLTOALL "};
    if (!inputs.empty()) sig.text += c10::toString(inputs[0].scalar_type());
    for (const auto& t : inputs) sig.sends.push_back(t.numel());
    for (const auto& t : outputs) sig.receives.push_back(t.numel());
    return sig;
  }

  static at::Tensor scaled_copy(const Reduction& r, const at::Tensor& t) {
    at::Tensor c = t.clone();
    premultiply(r, c);
    return c;
  }

  // [docs:start OCCL_AGREE_CALL]
  // Raises on every rank when the ranks are not about to run the same collective (see
  // Signature). Errors of the exchange itself (a timeout, a peer gone) are gloo's, as the
  // collective's own would have been. `signature` builds the description only when it is used.
  template <typename Describe>
  void agree(Describe signature) {
    const int n = getSize();
    if (!check_ || n == 1) return;
    const Signature mine = signature();
    const int64_t width = 1 + 2 * n;
    at::Tensor record = at::zeros({width}, at::kLong);
    int64_t* r = record.data_ptr<int64_t>();
    r[0] = static_cast<int64_t>(fnv1a(agreed_part(mine.text)));
    for (size_t j = 0; j < mine.sends.size() && j < static_cast<size_t>(n); ++j)
      r[1 + j] = mine.sends[j];
    for (size_t j = 0; j < mine.receives.size() && j < static_cast<size_t>(n); ++j)
      r[1 + n + j] = mine.receives[j];
    at::Tensor records = gather_all(record);
    const int64_t* all = records.data_ptr<int64_t>();
    std::string counts;  // the first all-to-all count that does not match, if any
    bool same = true;
    for (int i = 0; i < n && same; ++i) same = all[i * width] == all[0];
    for (int i = 0; i < n && same && counts.empty(); ++i)
      for (int j = 0; j < n && counts.empty(); ++j) {
        const int64_t sent = all[i * width + 1 + j], expected = all[j * width + 1 + n + i];
        if (sent != expected)
          counts = "rank " + std::to_string(i) + " sends " + std::to_string(sent) +
                   " elements to group rank " + std::to_string(j) + ", which expects " +
                   std::to_string(expected) + " from it";
      }
    if (same && counts.empty()) return;
    // Every rank saw the same records, so every rank is here: exchange the descriptions.
    constexpr size_t kText = 512;
    std::string shown = mine.text;
    if (shown.size() > kText - 1) {  // cut, with the hash: two long calls never read the same
      std::ostringstream tail;
      tail << "... [" << shown.size() << " characters, hash " << std::hex << r[0] << "]";
      shown = shown.substr(0, kText - 1 - tail.str().size()) + tail.str();
    }
    at::Tensor text = at::zeros({static_cast<int64_t>(kText)}, at::kByte);
    std::memcpy(text.data_ptr(), shown.data(), shown.size());
    at::Tensor texts = gather_all(text);
    std::vector<std::pair<std::string, std::vector<int>>> calls;  // description, its ranks
    for (int i = 0; i < n; ++i) {
      std::string call(reinterpret_cast<const char*>(texts.data_ptr<uint8_t>() + i * kText));
      auto it = std::find_if(calls.begin(), calls.end(),
                             [&](const auto& c) { return c.first == call; });
      if (it == calls.end()) {
        calls.push_back({call, {i}});
      } else {
        it->second.push_back(i);
      }
    }
    std::string message = "occl: Detected mismatch between collectives on ranks: ";
    for (size_t i = 0; i < calls.size(); ++i) {
      const auto& ranks = calls[i].second;
      message += std::string(i ? "; " : "") + (ranks.size() > 1 ? "group ranks " : "group rank ");
      for (size_t k = 0; k < ranks.size(); ++k)
        message += (k ? ", " : "") + std::to_string(ranks[k]);
      message += " called " + calls[i].first;
    }
    if (!counts.empty()) message += ", but group " + counts;
    {
      // raised inside a coalescing block, whose end torch then never calls: the group must not
      // stay in it (the next startCoalescing would refuse)
      std::lock_guard guard(coalescing_mutex_);
      coalescing_ = false;
      coalesced_.clear();
    }
    TORCH_CHECK(false, message,
                ". occl compares each collective's shapes across the group before running it "
                "(OPENREG_OCCL_CHECK=0 turns this off; docs/distributed.md)");
  }
  // Every rank's `mine`, one after the other, through gloo (the host waits).
  at::Tensor gather_all(const at::Tensor& mine) {
    at::Tensor all = at::empty({getSize() * mine.numel()}, mine.options());
    at::Tensor in = mine;
    gloo_->_allgather_base(all, in, c10d::AllgatherOptions())->wait();
    return all;
  }
  // [docs:end OCCL_AGREE_CALL]

  c10::intrusive_ptr<Work> record(c10::intrusive_ptr<Work> work) {
    std::lock_guard guard(coalescing_mutex_);
    if (coalescing_) coalesced_.push_back(work);
    return work;
  }

  c10::intrusive_ptr<Backend> gloo_;
  bool check_;
  std::mutex coalescing_mutex_;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<Work>> coalesced_;
};

}  // namespace

c10::intrusive_ptr<c10d::Backend> make_occl_backend(c10::intrusive_ptr<c10d::Backend> gloo,
                                                    bool check) {
  TORCH_CHECK(gloo, "occl: needs a gloo backend underneath");
  return c10::make_intrusive<OcclBackend>(std::move(gloo), check);
}

void bind_occl_backend(pybind11::module_& m) {
  namespace py = pybind11;
  // Its own Python type (a subclass of torch's Backend): what torch_openreg/distributed.py adds
  // for split_group (`options`) and new_group (`perform_nocolor_split`) goes there.
  py::class_<OcclBackend, Backend, c10::intrusive_ptr<OcclBackend>>(m, "_OcclBackend")
      .def_property_readonly("_gloo", &OcclBackend::gloo)
      .def(
          "perform_nocolor_split",
          [](OcclBackend&, at::Device) {
            // new_group calls it on the ranks left out of a group when the default group can
            // be split (NCCL's ranks must all take part in ncclCommSplit); new_group builds
            // occl groups through the creator, split_group has gloo's split: nothing to do
          },
          py::arg("device"));
}

}  // namespace openreg
