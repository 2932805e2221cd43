// The launch memo's C side (see launch_memo.py for the contract): an argument-metadata key, and
// the replay of a recorded plan -- output allocations and TVM-FFI calls of compiled kernels --
// without Python.  Built on first use against the installed torch and tvm_ffi.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <ATen/DLConvertor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/SmallVector.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kMaxPlans = 4096;  // a full memo is emptied, so it stays bounded
// Addresses are keyed by alignment up to 16 B: the most any check or compiled kernel assumes
// (compiler.fake_tensor refuses more), so a key does not split on alignment nothing reads.
constexpr int kMaxAlignLog2 = 4;

PyObject* g_miss = nullptr;         // lookup's answer for metadata not seen yet: record the call
PyObject* g_skip = nullptr;         // and for metadata whose calls cannot be replayed
PyTypeObject* g_tensor_type = nullptr;
PyTypeObject* g_parameter_type = nullptr;
uint64_t g_hits = 0, g_misses = 0;
bool g_enabled = true;  // set_enabled: the dispatcher kernels replay (the Python side checks its own flag)

enum SrcKind : int8_t { kInput = 0, kAlloc = 1 };

struct TensorArg {  // a view of an input or an allocation, as DLPack describes it
  SrcKind kind;
  int32_t index;
  int64_t byte_offset;
  std::vector<int64_t> shape, strides;
  DLDataType dtype;
};

struct Arg {
  int32_t type_index;  // kTVMFFIDLTensorPtr, kTVMFFIInt, kTVMFFIBool, kTVMFFIFloat or kTVMFFINone
  int64_t i = 0;
  double f = 0.0;
  TensorArg t;
};

struct Call {
  TVMFFIObjectHandle fn = nullptr;
  std::vector<Arg> args;
  Call() = default;
  Call(const Call&) = delete;
  Call(Call&& o) noexcept : fn(o.fn), args(std::move(o.args)) { o.fn = nullptr; }
  ~Call() {
    if (fn) TVMFFIObjectDecRef(fn);
  }
};

struct Alloc {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

struct Result {  // a returned tensor: an allocation, or a view of one
  int32_t alloc;
  bool whole;  // the allocation itself
  std::vector<int64_t> sizes, strides;
  int64_t storage_offset;
};

struct Plan {
  c10::Device device{c10::DeviceType::CPU};
  std::vector<Alloc> allocs;
  std::vector<Call> calls;
  int result_kind;  // 0: None, 1: one tensor, 2: tuple
  std::vector<Result> results;
};

// Never destroyed: at exit, releasing the plans' function handles could call into a finalized
// interpreter (a Python-defined TVM-FFI function).
// Plans are shared: a replay keeps its own reference, as wrapping its outputs can run Python
// (a garbage collection) that clears the memo.
auto& g_plans = *new std::unordered_map<std::string, std::shared_ptr<const Plan>>();  // null: not replayable

// The tensors among an op's arguments, by position (null for the others).
using Inputs = c10::SmallVector<const at::Tensor*, 16>;

template <typename T>
void put(std::string& key, T v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

bool is_plain_tensor(PyObject* o) {
  PyTypeObject* t = Py_TYPE(o);
  return t == g_tensor_type || t == g_parameter_type;
}

// The key: op id and every argument's type and value, a tensor by its metadata (dtype, device,
// sizes, strides, alignment class of its address, aliasing with earlier inputs).  Built one
// argument at a time, from Python objects (``lookup``, ``store``) or from the dispatcher's
// IValues (``MemoKernel``): both give the same bytes for the same call.
class KeyBuilder {
 public:
  KeyBuilder(std::string& key, Inputs* inputs, int64_t op, int32_t num_args) : key_(key), inputs_(inputs) {
    key_.clear();
    put(key_, op);
    put(key_, num_args);
  }

  // False: a tensor the memo does not handle.
  bool tensor(const at::Tensor& t, int32_t index, bool parameter) {
    if (t.layout() != c10::kStrided || t.is_nested() || t.is_neg() || t.is_conj() || !t.has_storage() ||
        t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
      return false;
    }
    key_.push_back(parameter ? 'P' : 'T');
    put(key_, static_cast<int8_t>(t.scalar_type()));
    put(key_, static_cast<int8_t>(t.device().type()));
    put(key_, static_cast<int8_t>(t.device().index()));
    put(key_, static_cast<int8_t>(t.dim()));
    for (int64_t s : t.sizes()) put(key_, s);
    for (int64_t s : t.strides()) put(key_, s);
    auto ptr = reinterpret_cast<uintptr_t>(t.data_ptr());
    int align = ptr == 0 ? kMaxAlignLog2 + 1 : std::min(__builtin_ctzll(ptr), kMaxAlignLog2);
    put(key_, static_cast<int8_t>(align));
    // Inputs sharing storage: the first such input and the byte distance to it, so that a
    // replay sees the same aliasing the recorded call saw (kernel arguments are recorded as
    // offsets from the first input of their storage).
    const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    int32_t first = -1;
    uintptr_t first_ptr = ptr;
    for (const auto& [other_storage, other_index, other_ptr] : storages_) {
      if (other_storage == storage) {
        first = other_index;
        first_ptr = other_ptr;
        break;
      }
    }
    put(key_, first);
    put(key_, static_cast<int64_t>(ptr - first_ptr));
    if (first < 0) storages_.emplace_back(storage, index, ptr);
    if (inputs_) inputs_->push_back(&t);
    return true;
  }
  void none() { scalar('N'); }
  void boolean(bool v) { scalar(v ? 'y' : 'n'); }
  void integer(int64_t v) {
    scalar('i');
    put(key_, v);
  }
  void real(double v) {
    scalar('f');
    put(key_, v);
  }
  void text(const char* s, size_t len) {
    scalar('s');
    put(key_, static_cast<int64_t>(len));
    key_.append(s, len);
  }

 private:
  void scalar(char tag) {
    key_.push_back(tag);
    if (inputs_) inputs_->push_back(nullptr);
  }
  std::string& key_;
  Inputs* inputs_;
  c10::SmallVector<std::tuple<const c10::StorageImpl*, int32_t, uintptr_t>, 8> storages_;
};

// The key of a call from Python.  False: an argument the memo does not handle.
bool make_key(int64_t op, PyObject* args, std::string& key, Inputs* inputs) {
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  KeyBuilder b(key, inputs, op, static_cast<int32_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args, i);
    if (a == Py_None) {
      b.none();
    } else if (is_plain_tensor(a)) {
      if (!b.tensor(THPVariable_Unpack(a), static_cast<int32_t>(i), Py_TYPE(a) == g_parameter_type)) return false;
    } else if (PyBool_Check(a)) {
      b.boolean(a == Py_True);
    } else if (PyLong_CheckExact(a)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (overflow) return false;
      b.integer(static_cast<int64_t>(v));
    } else if (PyFloat_CheckExact(a)) {
      b.real(PyFloat_AS_DOUBLE(a));
    } else if (PyUnicode_CheckExact(a)) {
      Py_ssize_t len = 0;
      const char* s = PyUnicode_AsUTF8AndSize(a, &len);
      if (s == nullptr) {
        PyErr_Clear();
        return false;
      }
      b.text(s, static_cast<size_t>(len));
    } else {
      return false;
    }
  }
  return true;
}

bool debug_mode() {
  const char* d = std::getenv("CUTE_MOE_DEBUG");  // debug checks read data: never replayed
  return d != nullptr && std::strcmp(d, "1") == 0;
}

// The error a TVM-FFI call raised, as the Python exception of the same kind (a builtin
// exception type of that name, else RuntimeError), as the Python path would raise it.
[[noreturn]] void raise_ffi_error() {
  if (PyErr_Occurred()) throw python_error();  // raised in Python (a Python-defined function)
  TVMFFIObjectHandle err = nullptr;
  TVMFFIErrorMoveFromRaised(&err);
  if (err == nullptr) TORCH_CHECK(false, "cute_moe launch memo: a TVM-FFI call failed without an error");
  TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(err);
  std::string kind(cell->kind.data, cell->kind.size);
  std::string msg(cell->message.data, cell->message.size);
  TVMFFIObjectDecRef(err);
  PyObject* type = PyDict_GetItemString(PyEval_GetBuiltins(), kind.c_str());  // borrowed
  if (type == nullptr || !PyType_Check(type) ||
      !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(type), reinterpret_cast<PyTypeObject*>(PyExc_Exception))) {
    type = PyExc_RuntimeError;
    msg = kind + ": " + msg;
  }
  PyErr_SetString(type, msg.c_str());
  throw python_error();
}

void* current_cuda_stream(c10::DeviceIndex index) {
  // torch's current stream through the virtual device guard: no CUDA headers needed
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(c10::Device(c10::DeviceType::CUDA, index)).native_handle();
}

using Outputs = c10::SmallVector<at::Tensor, 4>;

// Runs a plan on new inputs: its allocations, then its kernel calls on torch's current stream;
// returns the op's results (none, one, or the tuple's).
Outputs replay(const Plan& p, const Inputs& inputs) {
  c10::SmallVector<at::Tensor, 8> allocs;
  allocs.reserve(p.allocs.size());
  for (const Alloc& a : p.allocs) {
    allocs.push_back(at::empty_strided(a.sizes, a.strides, at::TensorOptions().dtype(a.dtype).device(p.device)));
  }
  const bool cuda = p.device.is_cuda();
  TVMFFIStreamHandle previous = nullptr;
  if (cuda && TVMFFIEnvSetStream(kDLCUDA, p.device.index(), current_cuda_stream(p.device.index()), &previous) != 0) {
    raise_ffi_error();
  }
  int rc = 0;
  c10::SmallVector<DLTensor, 16> dl;  // no heap allocation per call for up to 16 arguments
  c10::SmallVector<TVMFFIAny, 16> any;
  for (const Call& c : p.calls) {
    dl.assign(c.args.size(), DLTensor{});
    any.assign(c.args.size(), TVMFFIAny{});
    for (size_t i = 0; i < c.args.size(); ++i) {
      const Arg& a = c.args[i];
      any[i].type_index = a.type_index;
      if (a.type_index == kTVMFFIDLTensorPtr) {
        const TensorArg& t = a.t;
        const at::Tensor& src = t.kind == kInput ? *inputs[t.index] : allocs[t.index];
        DLTensor& d = dl[i];
        d.data = static_cast<char*>(src.data_ptr()) + t.byte_offset;
        d.device = DLDevice{cuda ? kDLCUDA : kDLCPU, static_cast<int32_t>(cuda ? p.device.index() : 0)};
        d.ndim = static_cast<int32_t>(t.shape.size());
        d.dtype = t.dtype;
        d.shape = const_cast<int64_t*>(t.shape.data());
        d.strides = const_cast<int64_t*>(t.strides.data());
        d.byte_offset = 0;
        any[i].v_ptr = &d;
      } else if (a.type_index == kTVMFFIFloat) {
        any[i].v_float64 = a.f;
      } else {
        any[i].v_int64 = a.i;
      }
    }
    TVMFFIAny ret;
    ret.type_index = kTVMFFINone;
    ret.zero_padding = 0;
    ret.v_int64 = 0;
    rc = TVMFFIFunctionCall(c.fn, any.data(), static_cast<int32_t>(any.size()), &ret);
    if (rc != 0) break;
    if (ret.type_index >= kTVMFFIStaticObjectBegin) TVMFFIObjectDecRef(ret.v_obj);
  }
  if (cuda) TVMFFIEnvSetStream(kDLCUDA, p.device.index(), previous, nullptr);
  if (rc != 0) raise_ffi_error();

  Outputs outputs;
  for (const Result& r : p.results) {
    outputs.push_back(r.whole ? allocs[r.alloc] : allocs[r.alloc].as_strided(r.sizes, r.strides, r.storage_offset));
  }
  return outputs;
}

PyObject* to_python(const Plan& p, Outputs&& outputs) {
  if (p.result_kind == 0) Py_RETURN_NONE;
  if (p.result_kind == 1) return THPVariable_Wrap(std::move(outputs[0]));
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(outputs.size()));
  if (tuple == nullptr) return nullptr;
  for (size_t i = 0; i < outputs.size(); ++i) {
    PyObject* o = THPVariable_Wrap(std::move(outputs[i]));
    if (o == nullptr) {
      Py_DECREF(tuple);
      return nullptr;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), o);
  }
  return tuple;
}

// lookup(op_id, args) -> the op's outputs, replayed; or MISS (record this call) or SKIP (run it)
PyObject* lookup(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  HANDLE_TH_ERRORS
  if (argc != 2 || !PyTuple_Check(argv[1])) {
    PyErr_SetString(PyExc_TypeError, "lookup(op_id: int, args: tuple)");
    return nullptr;
  }
  thread_local std::string key;
  Inputs inputs;  // not thread_local: wrapping the outputs can run Python that calls an op again
  int64_t op = PyLong_AsLongLong(argv[0]);
  if (op == -1 && PyErr_Occurred()) return nullptr;
  if (debug_mode() || !make_key(op, argv[1], key, &inputs)) {
    if (PyErr_Occurred()) return nullptr;
    ++g_misses;
    Py_INCREF(g_skip);
    return g_skip;
  }
  auto it = g_plans.find(key);
  if (it == g_plans.end()) {
    ++g_misses;
    Py_INCREF(g_miss);
    return g_miss;
  }
  if (it->second == nullptr) {
    ++g_misses;
    Py_INCREF(g_skip);
    return g_skip;
  }
  ++g_hits;
  std::shared_ptr<const Plan> plan = it->second;
  return to_python(*plan, replay(*plan, inputs));
  END_HANDLE_TH_ERRORS
}

int64_t as_int(PyObject* o) {
  int64_t v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw python_error();
  return v;
}

const at::Tensor& as_tensor(PyObject* o) {
  if (!THPVariable_Check(o)) throw torch::TypeError("cute_moe launch memo: expected a tensor");
  return THPVariable_Unpack(o);
}

// A recorded kernel argument: (kind, index, view) for a tensor, else the scalar itself.
Arg encode_arg(PyObject* o, const Inputs& inputs, const std::vector<at::Tensor>& allocs) {
  Arg a;
  if (PyTuple_Check(o)) {
    TORCH_CHECK(PyTuple_GET_SIZE(o) == 3, "cute_moe launch memo: bad tensor argument");
    a.type_index = kTVMFFIDLTensorPtr;
    a.t.kind = static_cast<SrcKind>(as_int(PyTuple_GET_ITEM(o, 0)));
    a.t.index = static_cast<int32_t>(as_int(PyTuple_GET_ITEM(o, 1)));
    const at::Tensor& view = as_tensor(PyTuple_GET_ITEM(o, 2));
    TORCH_CHECK(a.t.index >= 0 && a.t.index < static_cast<int32_t>(a.t.kind == kInput ? inputs.size() : allocs.size()),
                "cute_moe launch memo: bad tensor argument");
    const at::Tensor* src = a.t.kind == kInput ? inputs[a.t.index] : &allocs[a.t.index];
    TORCH_CHECK(src != nullptr, "cute_moe launch memo: tensor argument from a non-tensor input");
    a.t.byte_offset = static_cast<char*>(view.data_ptr()) - static_cast<char*>(src->data_ptr());
    DLManagedTensor* m = at::toDLPack(view);  // the shape, strides and dtype torch exports
    a.t.shape.assign(m->dl_tensor.shape, m->dl_tensor.shape + m->dl_tensor.ndim);
    if (m->dl_tensor.strides != nullptr) {
      a.t.strides.assign(m->dl_tensor.strides, m->dl_tensor.strides + m->dl_tensor.ndim);
    } else {
      auto strides = c10::contiguous_strides(view.sizes());
      a.t.strides.assign(strides.begin(), strides.end());
    }
    a.t.dtype = m->dl_tensor.dtype;
    m->deleter(m);
  } else if (o == Py_None) {
    a.type_index = kTVMFFINone;
  } else if (PyBool_Check(o)) {
    a.type_index = kTVMFFIBool;
    a.i = o == Py_True;
  } else if (PyLong_CheckExact(o)) {
    a.type_index = kTVMFFIInt;
    a.i = as_int(o);
  } else if (PyFloat_CheckExact(o)) {
    a.type_index = kTVMFFIFloat;
    a.f = PyFloat_AS_DOUBLE(o);
  } else {
    throw torch::TypeError("cute_moe launch memo: unsupported kernel argument");
  }
  return a;
}

// store(op_id, args, allocs, calls, result_kind, results): the plan a recorded call followed.
//   allocs: the tensors it allocated; calls: [(function handle, [encoded argument])];
//   results: [(alloc index, returned tensor)].  store(op_id, args): calls with this metadata
//   cannot be replayed.
PyObject* store(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(argc == 6 || argc == 2, "store(op_id, args[, allocs, calls, result_kind, results])");
  std::string key;
  Inputs inputs;
  if (!make_key(as_int(argv[0]), argv[1], key, &inputs)) Py_RETURN_FALSE;
  if (g_plans.size() >= kMaxPlans) g_plans.clear();
  if (argc == 2) {
    g_plans[key] = nullptr;
    Py_RETURN_TRUE;
  }
  auto plan = std::make_unique<Plan>();
  std::vector<at::Tensor> allocs;
  bool have_device = false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(argv[2]); ++i) {
    const at::Tensor& t = as_tensor(PyList_GET_ITEM(argv[2], i));
    allocs.push_back(t);
    plan->allocs.push_back(Alloc{t.sizes().vec(), t.strides().vec(), t.scalar_type()});
    TORCH_CHECK(!have_device || t.device() == plan->device, "cute_moe launch memo: allocations on two devices");
    plan->device = t.device();
    have_device = true;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(argv[3]); ++i) {
    PyObject* c = PyList_GET_ITEM(argv[3], i);
    Call call;
    PyObject* cargs = PyTuple_GET_ITEM(c, 1);
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(cargs); ++j) {
      call.args.push_back(encode_arg(PyList_GET_ITEM(cargs, j), inputs, allocs));
      const Arg& a = call.args.back();
      if (a.type_index != kTVMFFIDLTensorPtr) continue;
      const at::Tensor& src = a.t.kind == kInput ? *inputs[a.t.index] : allocs[a.t.index];
      TORCH_CHECK(!have_device || src.device() == plan->device, "cute_moe launch memo: arguments on two devices");
      plan->device = src.device();
      have_device = true;
    }
    call.fn = reinterpret_cast<TVMFFIObjectHandle>(as_int(PyTuple_GET_ITEM(c, 0)));
    TVMFFIObjectIncRef(call.fn);
    plan->calls.push_back(std::move(call));
  }
  plan->result_kind = static_cast<int>(as_int(argv[4]));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(argv[5]); ++i) {
    PyObject* r = PyList_GET_ITEM(argv[5], i);
    int32_t index = static_cast<int32_t>(as_int(PyTuple_GET_ITEM(r, 0)));
    const at::Tensor& out = as_tensor(PyTuple_GET_ITEM(r, 1));
    const at::Tensor& alloc = allocs.at(index);
    TORCH_CHECK(out.scalar_type() == alloc.scalar_type(), "cute_moe launch memo: a result of another dtype");
    bool whole = out.sizes().equals(alloc.sizes()) && out.strides().equals(alloc.strides()) &&
                 out.storage_offset() == alloc.storage_offset();
    plan->results.push_back(Result{index, whole, out.sizes().vec(), out.strides().vec(), out.storage_offset()});
  }
  g_plans[key] = std::move(plan);
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// The dispatcher's side: a kernel on the BackendSelect key of a memoized op (the key every call
// passes just before its backend's kernel, after Python modes, subclasses and autograd), so that
// a torch.ops call whose metadata was seen is replayed without entering Python.  Anything else --
// a miss, metadata that cannot be replayed, an argument the key does not hold, a call bound for
// another backend than the memoized kernel's (e.g. Meta), the memo switched off -- goes on to the
// op's kernel for that backend (for the memoized one, ``launch_memo.memoized``'s Python function,
// which records).  The key is built as ``lookup`` builds it from the Python arguments that kernel
// receives: without the trailing arguments left at their defaults.  A kernel registered on the
// backend later by someone else is not seen by replays of metadata recorded before (as with
// ``ops.call``).
struct MemoKernel final : c10::OperatorKernel {
  int64_t op_id;
  size_t num_returns;
  c10::DispatchKey backend;  // the key of the memoized kernel (CUDA for the ops)
  MemoKernel(int64_t op_id, size_t num_returns, c10::DispatchKey backend)
      : op_id(op_id), num_returns(num_returns), backend(backend) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    const auto next = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);
    if (next.highestPriorityTypeId() == backend) {
      pybind11::gil_scoped_acquire gil;  // the memo is shared with Python callers
      try {
        if (g_enabled && !debug_mode() && replay_from_stack(op, stack)) return;
      } catch (python_error& e) {
        e.persist();  // the Python error travels with the exception, not in this thread's state
        throw;
      }
    }
    op.redispatchBoxed(next, stack);
  }

  bool replay_from_stack(const c10::OperatorHandle& op, torch::jit::Stack* stack) const {
    const auto& schema = op.schema().arguments();
    const size_t n = schema.size();
    auto args = torch::jit::last(*stack, n);
    // as torch's Python kernels get them: trailing arguments equal to their defaults left out
    size_t count = n;
    while (count > 0 && !args[count - 1].isTensor() && schema[count - 1].default_value().has_value() &&
           !(*schema[count - 1].default_value() != args[count - 1])) {
      --count;
    }
    thread_local std::string key;
    Inputs inputs;
    KeyBuilder b(key, &inputs, op_id, static_cast<int32_t>(count));
    for (size_t i = 0; i < count; ++i) {
      const c10::IValue& a = args[i];
      if (a.isNone()) {
        b.none();
      } else if (a.isTensor()) {
        const at::Tensor& t = a.toTensor();
        PyObject* o = THPVariable_Wrap(t);  // the Python object the Python kernel would see
        if (o == nullptr) throw python_error();
        const bool plain = is_plain_tensor(o), parameter = Py_TYPE(o) == g_parameter_type;
        Py_DECREF(o);
        if (!plain || !b.tensor(t, static_cast<int32_t>(i), parameter)) return false;
      } else if (a.isBool()) {
        b.boolean(a.toBool());
      } else if (a.isInt()) {
        b.integer(a.toInt());
      } else if (a.isDouble()) {
        b.real(a.toDouble());
      } else if (a.isString()) {
        const std::string& s = a.toStringRef();
        b.text(s.data(), s.size());
      } else {
        return false;
      }
    }
    auto it = g_plans.find(key);
    if (it == g_plans.end() || it->second == nullptr) return false;
    std::shared_ptr<const Plan> plan = it->second;
    if (plan->results.size() != num_returns || (num_returns == 1 && plan->result_kind != 1)) return false;
    ++g_hits;
    Outputs outputs = replay(*plan, inputs);
    torch::jit::drop(*stack, n);
    for (at::Tensor& t : outputs) stack->emplace_back(std::move(t));
    return true;
  }
};

// register_dispatch("ns::name", op_id, "CUDA"): the op's torch.ops calls bound for that backend's
// kernel (the memoized one) replay through ``MemoKernel``; a second registration of a name
// replaces the first.  Only ops whose arguments the key can hold and whose results are tensors;
// False otherwise.
PyObject* register_dispatch(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(argc == 3 && PyUnicode_Check(argv[0]) && PyUnicode_Check(argv[2]),
              "register_dispatch(qualname: str, op_id: int, dispatch_key: str)");
  const std::string qualname = PyUnicode_AsUTF8(argv[0]);
  const int64_t op_id = as_int(argv[1]);
  const c10::DispatchKey backend = c10::parseDispatchKey(PyUnicode_AsUTF8(argv[2]));
  const auto sep = qualname.find("::");
  TORCH_CHECK(sep != std::string::npos, "register_dispatch: expected ns::name, got ", qualname);
  auto handle = c10::Dispatcher::singleton().findSchema({qualname, ""});
  TORCH_CHECK(handle.has_value(), "register_dispatch: no op ", qualname);
  const auto& schema = handle->schema();
  for (const auto& a : schema.arguments()) {
    auto type = a.real_type();
    if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
    const auto kind = type->kind();
    if (a.kwarg_only() || (kind != c10::TypeKind::TensorType && kind != c10::TypeKind::IntType &&
                           kind != c10::TypeKind::SymIntType && kind != c10::TypeKind::FloatType &&
                           kind != c10::TypeKind::BoolType && kind != c10::TypeKind::StringType)) {
      Py_RETURN_FALSE;
    }
  }
  for (const auto& r : schema.returns()) {
    if (r.real_type()->kind() != c10::TypeKind::TensorType) Py_RETURN_FALSE;
  }
  // Never destroyed at exit, like the plans; replaced when the name is registered again.
  static auto& libraries = *new std::unordered_map<std::string, std::unique_ptr<torch::Library>>();
  auto& lib = libraries[qualname];
  lib.reset();  // the previous registration first: a key holds one kernel per library
  lib = std::make_unique<torch::Library>(torch::Library::IMPL, qualname.substr(0, sep),
                                         c10::DispatchKey::BackendSelect, __FILE__, __LINE__);
  lib->impl(qualname.substr(sep + 2).c_str(), torch::CppFunction::makeFromBoxedFunctor(std::make_unique<MemoKernel>(
                                                  op_id, schema.returns().size(), backend)));
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyObject* init(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 4 || !PyType_Check(argv[2]) || !PyType_Check(argv[3])) {
    PyErr_SetString(PyExc_TypeError, "init(miss, skip, torch.Tensor, torch.nn.Parameter)");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < 4; ++i) Py_INCREF(argv[i]);  // held for the process's life
  g_miss = argv[0];
  g_skip = argv[1];
  g_tensor_type = reinterpret_cast<PyTypeObject*>(argv[2]);
  g_parameter_type = reinterpret_cast<PyTypeObject*>(argv[3]);
  Py_RETURN_NONE;
}

PyObject* set_enabled(PyObject*, PyObject* on) {
  g_enabled = PyObject_IsTrue(on) == 1;
  Py_RETURN_NONE;
}

PyObject* clear(PyObject*, PyObject*) {
  g_plans.clear();
  g_hits = g_misses = 0;
  Py_RETURN_NONE;
}

PyObject* stats(PyObject*, PyObject*) {
  return Py_BuildValue("(nKK)", static_cast<Py_ssize_t>(g_plans.size()), static_cast<unsigned long long>(g_hits),
                       static_cast<unsigned long long>(g_misses));
}

PyMethodDef kMethods[] = {
    {"init", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(init)), METH_FASTCALL, nullptr},
    {"lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(lookup)), METH_FASTCALL, nullptr},
    {"store", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(store)), METH_FASTCALL, nullptr},
    {"register_dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(register_dispatch)), METH_FASTCALL,
     nullptr},
    {"set_enabled", set_enabled, METH_O, nullptr},
    {"clear", clear, METH_NOARGS, nullptr},
    {"stats", stats, METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_launch_memo", nullptr, -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__launch_memo() { return PyModule_Create(&kModule); }
