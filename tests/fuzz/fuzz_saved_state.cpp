// fuzz_saved_state.cpp — seeded random fuzzing of what memfit reads from disk: saved state (a
// manifest and a zip archive), its files truncated, flipped, zeroed, cut, grown, replaced or
// deleted, its manifest wrong in every field; and re-signed, so that the archive reader itself
// is reached. The text and JSON readers are fuzz_parsers.cpp's; iterations and seeds:
// fuzz_util.h.
//
// Property: a corrupted state is refused by SavedState::open with the exception its header
// promises, a one-line std::runtime_error; nothing else, no crash, no hang.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "memfit/memfit.h"

namespace memfit {
namespace {

using namespace fuzz;
namespace fs = std::filesystem;
using nlohmann::json;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The records of a zip archive (PyTorch's are stored, uncompressed), from its central
// directory: name, data offset, size.
struct ZipRecord {
  std::string name;
  size_t offset = 0, size = 0;
};

std::vector<ZipRecord> zip_records(const std::string& z) {
  auto u16 = [&](size_t at) {
    return static_cast<size_t>(static_cast<unsigned char>(z[at])) | static_cast<size_t>(static_cast<unsigned char>(z[at + 1])) << 8;
  };
  auto u32 = [&](size_t at) { return u16(at) | u16(at + 2) << 16; };
  std::vector<ZipRecord> out;
  const size_t end = z.rfind(std::string("PK\x05\x06", 4));
  if (end == std::string::npos || end + 22 > z.size()) return out;
  size_t at = u32(end + 16);
  for (size_t i = 0, count = u16(end + 10); i < count && at + 46 <= z.size(); ++i) {
    if (z.compare(at, 4, std::string("PK\x01\x02", 4)) != 0) break;
    const size_t size = u32(at + 20), name_length = u16(at + 28), extra = u16(at + 30), comment = u16(at + 32);
    const size_t local = u32(at + 42);
    if (local + 30 <= z.size()) {
      const size_t data = local + 30 + u16(local + 26) + u16(local + 28);
      if (data + size <= z.size()) out.push_back({z.substr(at + 46, name_length), data, size});
    }
    at += 46 + name_length + extra + comment;
  }
  return out;
}

// Runs `call` in a forked child held to 20 seconds: what it threw (as thrown_by says, "" for
// nothing) and its message; "crashed" with the signal or exit status when the child died.
// LibTorch's TorchScript loader is not hardened against hostile archives, and past a matching
// checksum memfit hands it the bytes.
std::string thrown_in_child(const std::function<void()>& call, std::string* what) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return thrown_by(call, what);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    return thrown_by(call, what);
  }
  if (pid == 0) {
    ::close(pipe_fds[0]);
    ::alarm(20);
    std::string message;
    const std::string kind = thrown_by(call, &message);
    const std::string out = kind + "\n" + message;
    if (::write(pipe_fds[1], out.data(), out.size()) < 0) std::_Exit(3);
    std::_Exit(0);
  }
  ::close(pipe_fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || out.find('\n') == std::string::npos) {
    *what = WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status))
                                : "exit status " + std::to_string(WEXITSTATUS(status));
    return "crashed";
  }
  *what = out.substr(out.find('\n') + 1);
  return out.substr(0, out.find('\n'));
}

TEST(FuzzSavedState, OpenRefusesEveryCorruptedVariant) {
  const uint64_t seed = seed_of(0x5a7ed);
  TextGenerator gen(seed);
  const int64_t random_per_kind = std::max<int64_t>(40, iterations(4000) / 100);
  const fs::path root = fs::temp_directory_path() / ("memfit-fuzz-state-" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path original = root / "original";

  torch::manual_seed(3);
  auto make_model = [] { return torch::nn::Linear(4, 3); };
  torch::nn::Linear model = make_model();
  OptimizerSpec spec;  // AdamW
  auto optimizer = make_optimizer(spec, model->parameters());
  model->forward(torch::randn({5, 4})).pow(2).sum().backward();
  optimizer->step();
  save_state(original, *model, *optimizer, spec, json{{"step", 3}}, c10::kCPU);

  // The head (JSON: meta, optimizer spec, generators) and one part (an archive: a Linear's own
  // parameters and their state).
  const std::vector<fs::path> state_names = {"state-00000003.json", "state-00000003.part-0000.pt"};
  std::map<fs::path, std::string> originals;
  for (const auto& name : state_names) originals[name] = read_bytes(original / name);
  const std::string manifest_text = read_bytes(original / "state.json");
  const json manifest = json::parse(manifest_text);
  ASSERT_EQ(manifest["files"].size(), 2u);
  for (const auto& [name, bytes] : originals) ASSERT_GT(bytes.size(), 100u) << name;

  // The untouched original opens and loads into a fresh model and optimizer.
  {
    SavedState saved = SavedState::open(original);
    EXPECT_EQ(saved.meta().at("step").get<int64_t>(), 3);
    torch::nn::Linear fresh = make_model();
    auto fresh_optimizer = make_optimizer(spec, fresh->parameters());
    saved.load_into(*fresh, *fresh_optimizer, spec, c10::kCPU);
    EXPECT_EQ(weights_sha256(*fresh), weights_sha256(*model));
  }


  int variants = 0, refused = 0, accepted = 0, failures = 0, resigned = 0, resigned_refused = 0, resigned_accepted = 0,
      resigned_crashed = 0;
  int counter = 0;
  std::map<std::string, int> resigned_accepted_kinds;  // "state byte flipped": 12
  std::vector<std::string> resigned_crashes;
  // One variant: DIR is a copy of the original, `change` corrupts it; SavedState::open must
  // throw a one-line std::runtime_error. With `resign`, the manifest is then rewritten to match
  // the corrupted state file: the archive reader itself is fuzzed (in a child process), and may
  // accept (LibTorch checks no CRC of tensor records) but only ever throws a one-line
  // std::runtime_error; a crash there is LibTorch's, counted and printed, not failed.
  // `resign`: the manifest entry of that file (index into state_names) is rewritten.
  auto variant = [&](const std::string& what, const std::function<void(const fs::path&)>& change, int resign = -1) {
    if (failures >= kMaxFailures) return;
    const fs::path dir = root / ("v" + std::to_string(counter++));
    fs::copy(original, dir, fs::copy_options::recursive);
    change(dir);
    bool same = fs::is_regular_file(dir / "state.json") && read_bytes(dir / "state.json") == manifest_text;
    for (const auto& [name, bytes] : originals) same = same && fs::is_regular_file(dir / name) && read_bytes(dir / name) == bytes;
    if (same) {  // a change that changed nothing (zeroes over zeroes): not a variant
      fs::remove_all(dir);
      return;
    }
    ++variants;
    std::string message;
    const std::string kind = thrown_by([&] { (void)SavedState::open(dir); }, &message);
    if (kind.empty()) {
      ++accepted;
      ++failures;
      ADD_FAILURE() << seed_line(seed) << ": SavedState::open accepted a corrupted state: " << what;
    } else if (kind != "runtime_error" || !one_line(message)) {
      ++failures;
      ADD_FAILURE() << seed_line(seed) << ": SavedState::open of a corrupted state (" << what << ") threw " << kind
                    << " with message '" << shown(message) << "'; expected a one-line std::runtime_error";
    } else {
      ++refused;
    }
    if (resign >= 0 && fs::is_regular_file(dir / state_names[static_cast<size_t>(resign)])) {
      const std::string bytes = read_bytes(dir / state_names[static_cast<size_t>(resign)]);
      json m = manifest;
      m["files"][resign]["bytes"] = static_cast<int64_t>(bytes.size());
      m["files"][resign]["sha256"] = sha256_hex(bytes.data(), bytes.size());
      write_bytes(dir / "state.json", m.dump(2) + "\n");
      ++resigned;
      std::string resigned_message;
      const std::string resigned_kind = thrown_in_child(
          [&] {
            SavedState saved = SavedState::open(dir);
            torch::nn::Linear fresh = make_model();
            auto fresh_optimizer = make_optimizer(spec, fresh->parameters());
            saved.load_into(*fresh, *fresh_optimizer, spec, c10::kCPU);
          },
          &resigned_message);
      if (resigned_kind == "crashed") {
        ++resigned_crashed;
        resigned_crashes.push_back(what + ": " + resigned_message);
      } else if (resigned_kind.empty()) {
        ++resigned_accepted;
        std::string kind_of = what;  // the description without its numbers
        kind_of.erase(std::remove_if(kind_of.begin(), kind_of.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }),
                      kind_of.end());
        ++resigned_accepted_kinds[kind_of];
      } else if (resigned_kind != "runtime_error" || !one_line(resigned_message)) {
        ++failures;
        ADD_FAILURE() << seed_line(seed) << ": a re-signed corrupted state (" << what << ") threw " << resigned_kind
                      << " with message '" << shown(resigned_message)
                      << "' from open or load_into; expected a one-line std::runtime_error";
      } else {
        ++resigned_refused;
      }
    }
    fs::remove_all(dir);
  };
  auto edit_state = [&](const fs::path& name, const std::function<void(std::string&)>& edit) {
    return [&, name, edit](const fs::path& dir) {
      std::string bytes = read_bytes(dir / name);
      edit(bytes);
      write_bytes(dir / name, bytes);
    };
  };
  auto edit_manifest = [&](const std::function<void(json&)>& edit) {
    return [&, edit](const fs::path& dir) {
      json m = manifest;
      edit(m);
      write_bytes(dir / "state.json", m.dump(2) + "\n");
    };
  };
  auto position = [&](size_t size) { return static_cast<size_t>(gen.pick(size)); };

  // Each state file (the head, the part): truncated, flipped (anywhere, and inside tensor
  // records), zeroed, shortened inside a record (bytes cut from the middle, the rest kept), grown.
  for (int f = 0; f < static_cast<int>(state_names.size()); ++f) {
    const fs::path name = state_names[static_cast<size_t>(f)];
    const std::string& state = originals[name];
    const std::string in = name.string() + ": ";
    const bool archive = name.extension() == ".pt";  // the part; the head is JSON
    const std::vector<ZipRecord> records = archive ? zip_records(state) : std::vector<ZipRecord>{};
    std::vector<ZipRecord> tensors;
    for (const auto& r : records) {
      if (r.name.find("/data/") != std::string::npos && r.size > 0) tensors.push_back(r);
    }
    if (archive) ASSERT_FALSE(tensors.empty()) << "no stored tensor records found in " << name << " (" << records.size() << " records)";
    for (int64_t i = 0; i < random_per_kind; ++i) {
      const size_t length = position(state.size());
      variant(in + "truncated to " + std::to_string(length) + " bytes",
              edit_state(name, [length](std::string& b) { b.resize(length); }), f);
    }
    for (int64_t i = 0; i < random_per_kind; ++i) {
      const size_t at = position(state.size());
      const auto mask = static_cast<char>(1 + gen.pick(255));
      variant(in + "byte " + std::to_string(at) + " flipped", edit_state(name, [at, mask](std::string& b) { b[at] ^= mask; }), f);
    }
    for (int64_t i = 0; archive && i < random_per_kind; ++i) {
      const ZipRecord& r = tensors[gen.pick(tensors.size())];
      const size_t at = r.offset + position(r.size);
      const auto mask = static_cast<char>(1 + gen.pick(255));
      variant(in + "byte " + std::to_string(at - r.offset) + " of tensor record " + r.name + " flipped",
              edit_state(name, [at, mask](std::string& b) { b[at] ^= mask; }), f);
    }
    for (int64_t i = 0; i < random_per_kind; ++i) {
      const size_t at = position(state.size());
      const size_t length = 1 + position(std::min<size_t>(64, state.size() - at));
      variant(in + "bytes " + std::to_string(at) + ".." + std::to_string(at + length) + " zeroed",
              edit_state(name, [at, length](std::string& b) { std::fill_n(b.begin() + static_cast<std::ptrdiff_t>(at), length, '\0'); }),
              f);
    }
    for (int64_t i = 0; archive && i < random_per_kind; ++i) {
      const ZipRecord& r = records[gen.pick(records.size())];
      if (r.size < 2) continue;
      const size_t at = r.offset + position(r.size - 1);
      const size_t length = 1 + position(r.offset + r.size - at - 1);
      variant(in + "record " + r.name + " shortened: " + std::to_string(length) + " bytes cut at " + std::to_string(at - r.offset),
              edit_state(name, [at, length](std::string& b) { b.erase(at, length); }), f);
    }
    for (int64_t i = 0; i < random_per_kind / 3; ++i) {
      const size_t at = position(state.size() + 1);
      const std::string junk = gen.text() + "x";
      variant(in + "'" + shown(junk) + "' inserted at " + std::to_string(at),
              edit_state(name, [at, junk](std::string& b) { b.insert(at, junk); }), f);
    }
    variant(in + "emptied", edit_state(name, [](std::string& b) { b.clear(); }));
    variant(in + "deleted", [name](const fs::path& dir) { fs::remove(dir / name); });
    variant(in + "replaced by a directory", [name](const fs::path& dir) {
      fs::remove(dir / name);
      fs::create_directory(dir / name);
    });
  }
  variant("state files replaced by another model's", [&](const fs::path& dir) {
    torch::nn::Linear other(4, 4);
    auto other_optimizer = make_optimizer(spec, other->parameters());
    save_state(root / "other", *other, *other_optimizer, spec, json{{"step", 3}}, c10::kCPU);
    for (const auto& name : state_names) fs::copy_file(root / "other" / name, dir / name, fs::copy_options::overwrite_existing);
    fs::remove_all(root / "other");
  });

  // The manifest: gone, empty, truncated, not JSON, its entry wrong in every field.
  variant("manifest deleted", [&](const fs::path& dir) { fs::remove(dir / "state.json"); });
  variant("manifest emptied", [&](const fs::path& dir) { write_bytes(dir / "state.json", ""); });
  variant("manifest replaced by a directory", [&](const fs::path& dir) {
    fs::remove(dir / "state.json");
    fs::create_directory(dir / "state.json");
  });
  for (int64_t i = 0; i < random_per_kind; ++i) {
    const size_t length = position(manifest_text.size() - 1);  // at least "}\n" cut: never valid JSON
    variant("manifest truncated to " + std::to_string(length) + " bytes",
            [&, length](const fs::path& dir) { write_bytes(dir / "state.json", manifest_text.substr(0, length)); });
  }
  for (const char* text : {"{}", "[]", "null", "0", "\"state-00000003.pt\"", "{\"files\": []}", "{\"files\": {}}",
                           "{\"files\": [null]}", "{\"files\": [[]]}", "{\"files\": [{}]}", "\xff\xfe{", "{\"files\"",
                           "{\"files\": [{\"name\": \"state-00000003.pt\"}]}"}) {
    variant(std::string("manifest is ") + shown(text), [text](const fs::path& dir) { write_bytes(dir / "state.json", text); });
  }
  variant("manifest nested 100000 deep", [](const fs::path& dir) {
    write_bytes(dir / "state.json", std::string(100000, '[') + std::string(100000, ']'));
  });
  const std::string sha = manifest["files"][0]["sha256"].get<std::string>();
  const int64_t size = manifest["files"][0]["bytes"].get<int64_t>();
  std::vector<std::pair<std::string, json>> wrong_sha = {
      {"empty", ""}, {"uppercase", [&] { std::string s = sha; for (char& c : s) c = static_cast<char>(std::toupper(c)); return s; }()},
      {"one character changed", [&] { std::string s = sha; s[gen.pick(s.size())] ^= 1; return s; }()},
      {"63 characters", sha.substr(0, 63)}, {"65 characters", sha + "0"}, {"all zeros", std::string(64, '0')},
      {"a number", 12345}, {"null", nullptr}, {"an array", json::array({sha})}};
  for (const auto& [what, value] : wrong_sha) {
    variant("manifest sha256 " + what, edit_manifest([value = value](json& m) { m["files"][0]["sha256"] = value; }));
  }
  variant("manifest sha256 missing", edit_manifest([](json& m) { m["files"][0].erase("sha256"); }));
  std::vector<std::pair<std::string, json>> wrong_size = {
      {"+1", size + 1}, {"-1", size - 1}, {"0", 0}, {"negative", -size}, {"int64 max", std::numeric_limits<int64_t>::max()},
      {"uint64 max", std::numeric_limits<uint64_t>::max()}, {"1e300", 1e300}, {"size + 0.5", static_cast<double>(size) + 0.5},
      {"a string", std::to_string(size)}, {"true", true}, {"null", nullptr}};
  for (const auto& [what, value] : wrong_size) {
    variant("manifest bytes " + what, edit_manifest([value = value](json& m) { m["files"][0]["bytes"] = value; }));
  }
  variant("manifest bytes missing", edit_manifest([](json& m) { m["files"][0].erase("bytes"); }));
  for (const std::string name : {"../state-00000003.pt", "./state-00000003.pt", "sub/state-00000003.pt", "/tmp/state-00000003.pt",
                                 "..", ".", "", "state-", "state-..", "state-00000004.pt", "state.json", "STATE-00000003.pt",
                                 "state-00000003.pt/", "state-00000003.pt\nx", "state-\n.pt"}) {
    variant("manifest names '" + shown(name) + "'", edit_manifest([name](json& m) { m["files"][0]["name"] = name; }));
  }
  variant("manifest names the state file with a NUL and more after it",
          edit_manifest([](json& m) { m["files"][0]["name"] = std::string("state-00000003.pt\0.bak", 23); }));
  variant("manifest name is a number", edit_manifest([](json& m) { m["files"][0]["name"] = 3; }));
  variant("manifest name missing", edit_manifest([](json& m) { m["files"][0].erase("name"); }));
  variant("manifest files missing", edit_manifest([](json& m) { m.erase("files"); }));
  variant("manifest format 4 (a future memfit's)", edit_manifest([](json& m) { m["format"] = 4; }));
  variant("manifest format 2 (an older memfit's)", edit_manifest([](json& m) { m["format"] = 2; }));
  variant("manifest without its part", edit_manifest([](json& m) { m["files"].erase(1); }));
  variant("manifest with the part twice", edit_manifest([](json& m) { m["files"].push_back(m["files"][1]); }));
  variant("manifest with head and part swapped", edit_manifest([](json& m) { std::swap(m["files"][0], m["files"][1]); }));
  for (const std::string name : {"state-00000003.part-0001.pt", "state-00000003.part-0.pt", "state-00000004.part-0000.pt",
                                 "../state-00000003.part-0000.pt", "state-00000003.pt", "state-00000003.part-0000.pt/"}) {
    variant("manifest names the part '" + shown(name) + "'", edit_manifest([name](json& m) { m["files"][1]["name"] = name; }));
  }
  variant("manifest format 'two'", edit_manifest([](json& m) { m["format"] = "two"; }));
  variant("directory is a file", [](const fs::path& dir) {
    fs::remove_all(dir);
    write_bytes(dir, "not a directory");
  });
  variant("directory missing", [](const fs::path& dir) { fs::remove_all(dir); });

  fs::remove_all(root);
  RecordProperty("variants", variants);
  RecordProperty("refused", refused);
  RecordProperty("accepted", accepted);
  RecordProperty("resigned_variants", resigned);
  RecordProperty("resigned_refused", resigned_refused);
  RecordProperty("resigned_accepted", resigned_accepted);
  RecordProperty("resigned_crashed", resigned_crashed);
  std::printf("saved state: %d variants, %d refused, %d accepted; re-signed (archive reader fuzzed): %d, %d refused, "
              "%d accepted, %d crashed LibTorch's loader\n",
              variants, refused, accepted, resigned, resigned_refused, resigned_accepted, resigned_crashed);
  for (const auto& crash : resigned_crashes) std::printf("  NOTE: re-signed, LibTorch's loader crashed (%s)\n", crash.c_str());
  for (const auto& [kind_of, count] : resigned_accepted_kinds) std::printf("  re-signed and accepted: %d x %s\n", count, kind_of.c_str());
  EXPECT_GE(variants, 200);
  EXPECT_EQ(accepted, 0);
}

}  // namespace
}  // namespace memfit
