// Bindings of measure/: the budget allocator, the memory tracker and its analysis, sizes, the
// CUDA memory fraction, and the random state checkpointing restores.
#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>
#include <c10/util/intrusive_ptr.h>

#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include "bindings.h"
#include "memfit/errors.h"
#include "memfit/measure/budget_allocator.h"
#include "memfit/measure/cuda_budget.h"
#include "memfit/measure/memory_tracker.h"
#include "memfit/plan/peak_moments.h"
#include "memfit/measure/size.h"
#include "memfit/report/document.h"
#include "memfit/report/html_report.h"
#include "memfit/techniques/rng.h"
#include "tracker.h"

namespace py = pybind11;

namespace memfit::python {
namespace {

Phase phase_from_name(const std::string& name) {
  for (int p = 0; p < kNumPhases; ++p) {
    if (name == phase_name(static_cast<Phase>(p))) return static_cast<Phase>(p);
  }
  throw std::invalid_argument("invalid phase " + name + ": expected other, data, forward, backward, recompute, optimizer or eval");
}


// The tracker installed on this thread until close() (TrackerScope's lifetime, driven by Python).
struct TrackerInstall {
  std::unique_ptr<TrackerScope> scope;
  explicit TrackerInstall(const Tracker& t) : scope(std::make_unique<TrackerScope>(t.tracker)) {}
  void close() { scope.reset(); }
};

// An analysed recording, and the HTML report of it.
struct Analysis {
  StepAnalysis result;
  std::vector<std::string> group_names;

  py::dict categories() const {
    const Categories& c = result.at_peak;
    py::dict d;
    d["weights"] = c.weights + c.buffers;  // a module's parameters and buffers
    d["gradients"] = c.gradients;
    d["optimizer_state"] = c.optimizer_state;
    d["activations"] = c.activations;
    d["other"] = c.other;
    return d;
  }
  py::dict details() const {
    const Categories& c = result.at_peak;
    py::dict d;
    d["parameters"] = c.weights;
    d["buffers"] = c.buffers;
    d["autocast_cache"] = c.autocast_cache;
    return d;
  }
  ReportDocument document(const std::string& title, const std::string& device, std::optional<int64_t> budget) const {
    ReportDocument doc;
    doc.title = title;
    doc.device = device;
    doc.budget_bytes = budget;
    doc.step = result;
    doc.block_names = group_names;
    doc.block_recomputed.assign(group_names.size(), false);
    return doc;
  }
};

struct FractionGuard {
  std::unique_ptr<CudaMemoryFractionGuard> guard;
  FractionGuard(int64_t cap, int device) : guard(std::make_unique<CudaMemoryFractionGuard>(cap, device)) {}
  void close() { guard.reset(); }
};

// Whether the storage's memory came from the installed BudgetAllocator (then the budget counts it).
bool counted_by_budget(const at::Tensor& t) {
  const BudgetAllocator* a = BudgetAllocator::installed();
  if (a == nullptr || !t.defined() || !t.has_storage() || t.storage().data() == nullptr) return false;
  return t.storage().data_ptr().get_deleter() == a->raw_deleter();
}

// Whether a tensor's storage is still alive, without keeping it alive.
struct StorageWatch {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  explicit StorageWatch(const at::Tensor& t) : storage(t.storage().getWeakStorageImpl()) {}
  bool alive() const { return !storage.expired(); }
};

// A size as Python gives it: bytes as an int (unbounded in Python: checked here, before any cast)
// or an integer float, or a text parse_size reads; an OptionError naming `name` otherwise.
int64_t size_bytes(py::handle size, const std::string& name) {
  const std::string shown = py::repr(size).cast<std::string>();
  const std::string expected = "expected bytes as an int or a size such as '2GiB' or '800MB'";
  int64_t bytes = 0;
  if (py::isinstance<py::str>(size)) {
    try {
      bytes = parse_size(size.cast<std::string>());
    } catch (const OptionError& e) {
      throw OptionError(name, shown, e.expected());
    }
  } else if (py::isinstance<py::int_>(size) && !py::isinstance<py::bool_>(size)) {
    int overflow = 0;
    bytes = PyLong_AsLongLongAndOverflow(size.ptr(), &overflow);
    check_option(overflow == 0, name, shown, "expected at most 9223372036854775807 bytes");
  } else if (py::isinstance<py::float_>(size)) {
    const double value = size.cast<double>();
    check_option(std::isfinite(value) && value == std::floor(value) && std::abs(value) <= 9.0e18, name, shown, expected);
    bytes = static_cast<int64_t>(value);
  } else {
    throw OptionError(name, shown, expected);
  }
  check_option(bytes > 0, name, shown, "expected a positive number of bytes");
  return bytes;
}


// The CPU budget allocator and sizes.
void bind_budget(py::module_& m) {
  m.def("install_budget_allocator", [] { BudgetAllocator::install(); },
        "Installs memfit's BudgetAllocator as LibTorch's CPU allocator (idempotent).");
  m.def("budget_bytes", [] { return BudgetAllocator::install().budget(); });
  m.def("set_budget_bytes", [](int64_t bytes) { BudgetAllocator::install().set_budget(bytes); });
  m.def("allocated_bytes", [] { return BudgetAllocator::install().allocated(); });
  m.def("allocator_peak_bytes", [] { return BudgetAllocator::install().peak(); });
  m.def("reset_allocator_peak", [] { BudgetAllocator::install().reset_peak(); });
  m.def("oom_count", [] { return BudgetAllocator::install().oom_count(); });
  m.def("fail_allocation_after", [](int64_t n) { BudgetAllocator::install().fail_allocation_after(n); });
  m.def("unlimited_bytes", [] { return BudgetAllocator::kUnlimited; });
  m.def("counted_by_budget", &counted_by_budget);
  m.def("parse_size", &parse_size);
  m.def("size_bytes", &size_bytes, py::arg("size"), py::arg("name"));
  m.def("format_bytes", &format_bytes);
}

void bind_tracker(py::module_& m) {
  py::class_<StorageWatch>(m, "StorageWatch").def(py::init<const at::Tensor&>()).def("alive", &StorageWatch::alive);

  // A tracker of one device: Tracker("cpu"), Tracker("cuda:0"); its counts are that device's.
  py::class_<Tracker>(m, "Tracker")
      .def(py::init<const std::string&>(), py::arg("device"))
      .def_property_readonly("device", [](const Tracker& t) { return t.device.str(); })
      .def("current", [](const Tracker& t) { return t.tracker->current(t.counted); })
      .def("peak", [](const Tracker& t) { return t.tracker->peak(t.counted); })
      .def("reset_peak", [](Tracker& t) { t.tracker->reset_peak(); })
      .def("start_recording", [](Tracker& t) { t.snapshots.clear(); t.tracker->start_recording(); })
      .def("stop_recording", [](Tracker& t) { t.tracker->stop_recording(); })
      .def("event_count", [](const Tracker& t) { return t.tracker->events().size(); })
      // The moments (plan/peak_moments.h) of the recorded events [first, last) on the tracker's device.
      .def("peak_moments",
           [](const Tracker& t, size_t first, size_t last, int64_t start_live, int64_t offset, int64_t peak) {
             return peak_moments(t.tracker->events(), first, last, t.counted, start_live, offset, peak);
           })
      .def("adopt", [](Tracker& t, const std::vector<at::Tensor>& tensors) { adopt_tensors(*t.tracker, tensors); })
      .def("snapshot", &Tracker::snapshot, py::arg("weights"), py::arg("buffers"), py::arg("gradients"),
           py::arg("optimizer_state"))
      .def("live_bytes_by_tag", &Tracker::live_bytes_by_tag)
      .def("analyze",
           [](const Tracker& t, const std::vector<int>& tag_group, const std::vector<std::string>& groups) {
             py::gil_scoped_release release;
             Analysis a;
             a.result = analyze_recording(*t.tracker, t.snapshots, tag_group, static_cast<int>(groups.size()), t.counted);
             a.group_names = groups;
             return a;
           });

  py::class_<TrackerInstall>(m, "TrackerInstall").def(py::init<const Tracker&>()).def("close", &TrackerInstall::close);

  m.def("set_phase", [](const std::string& name) -> std::string {
    MemoryTracker* t = MemoryTracker::active();
    return t ? phase_name(t->set_phase(phase_from_name(name))) : "other";
  });
  m.def("set_tag", [](int tag) -> int {
    MemoryTracker* t = MemoryTracker::active();
    return t ? t->set_block(static_cast<int16_t>(tag)) : kNoBlock;
  });
}

// What a recording analyzed holds: the peak, its categories and phases, the report.
void bind_analysis(py::module_& m) {
  py::class_<Analysis>(m, "Analysis")
      .def_property_readonly("peak_bytes", [](const Analysis& a) { return a.result.peak_bytes; })
      .def_property_readonly("peak_phase", [](const Analysis& a) { return std::string(phase_name(a.result.peak_phase)); })
      .def_property_readonly("peak_tag", [](const Analysis& a) { return a.result.peak_block; })
      .def_property_readonly("peak_seconds", [](const Analysis& a) { return a.result.peak_t_ns * 1e-9; })
      .def("categories", &Analysis::categories)
      .def("details", &Analysis::details)
      .def("group_activation_bytes", [](const Analysis& a) { return a.result.block_activation_bytes; })
      .def("phase_peaks", [](const Analysis& a) {
        py::list out;
        for (const auto& s : a.result.phases) {
          out.append(py::make_tuple(phase_name(s.phase), s.start_ns * 1e-9, s.end_ns * 1e-9, s.peak_bytes));
        }
        return out;
      })
      .def("document_json",
           [](const Analysis& a, const std::string& title, const std::string& device, std::optional<int64_t> budget) {
             return a.document(title, device, budget).to_json().dump();
           })
      .def("write_html", [](const Analysis& a, const std::string& path, const std::string& title, const std::string& device,
                            std::optional<int64_t> budget) {
        const nlohmann::json doc = a.document(title, device, budget).to_json();
        py::gil_scoped_release release;
        write_html_report(path, doc);
      });
}

// On CUDA: memory outside the allocator, its fraction cap; the RNG states a step restores.
void bind_device_state(py::module_& m) {
  // Device memory the caching allocator does not hold (the CUDA context, cuBLAS's handle): what
  // a budget on CUDA leaves the allocator less of. Measured once per device by the caller.
  m.def("measure_outside_memory", [](int device) {
    const OutsideMemory o = measure_outside_memory(device);
    py::dict d;
    d["device_total"] = o.device_total;
    d["context_and_others"] = o.context_and_others;
    d["cublas"] = o.cublas;
    d["total"] = o.total();
    return d;
  });
  py::class_<FractionGuard>(m, "CudaMemoryFraction")
      .def(py::init<int64_t, int>())
      .def("close", &FractionGuard::close)
      .def_property_readonly("active", [](const FractionGuard& g) { return g.guard && g.guard->active(); })
      .def_property_readonly("limit_bytes", [](const FractionGuard& g) { return g.guard ? g.guard->limit_bytes() : 0; });

  py::class_<RngState>(m, "RngState")
      .def_property_readonly("cpu_bytes", [](const RngState& s) { return static_cast<int64_t>(s.cpu.storage().nbytes()); });
  m.def("capture_rng", [](const std::string& device) { return capture_rng(c10::Device(device)); });
  m.def("restore_rng", &restore_rng);
}

}  // namespace

void bind_measure(py::module_& m) {
  bind_budget(m);
  bind_tracker(m);
  bind_analysis(m);
  bind_device_state(m);
}

}  // namespace memfit::python
