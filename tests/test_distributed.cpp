// Sharded data parallel at the library level: the batch and parameter partitions, and two
// ranks as two threads of this process (c10d/Gloo over loopback, no fork needed) compared with
// one AdamW over the summed gradients.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <thread>

#include "distributed_util.h"

namespace memfit {
namespace {

TEST(DistributedTest, RankSlicesCoverTheBatchInOrder) {
  for (int64_t batch = 1; batch <= 20; ++batch) {
    for (int world = 1; world <= std::min<int64_t>(batch, 5); ++world) {
      int64_t next = 0;
      for (int r = 0; r < world; ++r) {
        const BatchSlice s = rank_slice(batch, r, world);
        EXPECT_EQ(s.start, next) << batch << " over " << world;
        EXPECT_GE(s.length, batch / world);
        EXPECT_LE(s.length, batch / world + 1);
        next = s.start + s.length;
      }
      EXPECT_EQ(next, batch);
    }
  }
  EXPECT_THROW(rank_slice(8, 2, 2), std::invalid_argument);
}

TEST(DistributedTest, PartitionIsContiguousAndBalancedByBytes) {
  std::vector<at::Tensor> params;
  for (int64_t n : {4032, 2048, 64, 64, 12288, 192, 4096, 64, 64, 64, 16384, 256, 16384, 64, 4032}) {
    params.push_back(at::zeros({n}));
  }
  int64_t total = 0, largest = 0;
  for (const auto& p : params) {
    total += static_cast<int64_t>(p.nbytes());
    largest = std::max<int64_t>(largest, static_cast<int64_t>(p.nbytes()));
  }
  for (int world = 1; world <= 4; ++world) {
    const auto owner = partition_by_bytes(params, world);
    ASSERT_EQ(owner.size(), params.size());
    std::vector<int64_t> bytes(static_cast<size_t>(world), 0);
    for (size_t i = 0; i < params.size(); ++i) {
      if (i > 0) EXPECT_LE(owner[i - 1], owner[i]) << "ranges are contiguous";
      bytes[static_cast<size_t>(owner[i])] += static_cast<int64_t>(params[i].nbytes());
    }
    // Each end of a range is off its ideal place by at most half a parameter.
    for (int64_t b : bytes) EXPECT_LE(std::abs(b - total / world), largest) << "world " << world;
  }
}

TEST(DistributedTest, BadOptionsAreOneClearLine) {
  DistributedOptions o;
  o.world_size = 2;
  o.rank = 2;
  try {
    validate(o);
    FAIL() << "rank 2 of 2 accepted";
  } catch (const OptionError& e) {
    EXPECT_EQ(e.option(), "distributed.rank") << e.what();
    EXPECT_EQ(e.value(), "2");
  }
  o.rank = 0;
  o.zero_stage = 4;
  EXPECT_THROW(validate(o), std::invalid_argument);
  o.zero_stage = 3;
  EXPECT_NO_THROW(validate(o));
  o.zero_stage = 1;
  for (const char* bad : {"localhost", ":29500", "host:", "host:0", "host:70000", "host:12a"}) {
    o.master = bad;
    EXPECT_THROW(validate(o), std::invalid_argument) << bad;
  }
  EXPECT_EQ(parse_master("127.0.0.1:29500"), std::make_pair(std::string("127.0.0.1"), 29500));
}

// Each backend carries the tensors it can: NCCL CUDA tensors, Gloo CPU ones (a CUDA tensor
// reaches Gloo as a host copy); auto picks by the step's device; each rank on CUDA its own GPU.
TEST(DistributedTest, BackendAndDeviceFollowTheStepsDevice) {
  DistributedOptions o;
  o.world_size = 2;
  EXPECT_EQ(resolve_backend(o), "gloo") << "CPU tensors";
  o.backend = "nccl";
  try {
    resolve_backend(o);
    FAIL() << "nccl accepted for CPU tensors";
  } catch (const OptionError& e) {
    EXPECT_EQ(e.option(), "distributed.backend") << e.what();
  }
  o.device = c10::Device(c10::kCUDA, 1);
  o.backend = "auto";
  EXPECT_EQ(resolve_backend(o), MEMFIT_WITH_CUDA ? "nccl" : "gloo") << "CUDA tensors: NCCL where built with it";
  o.backend = "gloo";
  EXPECT_EQ(resolve_backend(o), "gloo") << "Gloo on CUDA: its tensors go through host copies";
  o.backend = "mpi";
  EXPECT_THROW(resolve_backend(o), OptionError);

  unsetenv("LOCAL_RANK");
  EXPECT_EQ(rank_device(c10::Device(c10::kCUDA), 3), c10::Device(c10::kCUDA, 3)) << "the rank, without LOCAL_RANK";
  setenv("LOCAL_RANK", "1", 1);
  EXPECT_EQ(rank_device(c10::Device(c10::kCUDA), 3), c10::Device(c10::kCUDA, 1)) << "LOCAL_RANK, as launch sets it";
  EXPECT_EQ(rank_device(c10::Device(c10::kCUDA, 0), 3), c10::Device(c10::kCUDA, 0)) << "a GPU named stays";
  EXPECT_EQ(rank_device(c10::Device(c10::kCPU), 3), c10::Device(c10::kCPU));
  setenv("LOCAL_RANK", "one", 1);
  EXPECT_THROW(rank_device(c10::Device(c10::kCUDA), 0), OptionError);
  unsetenv("LOCAL_RANK");
}

// Deterministic parameters and per-rank gradients.

// A chain of one block holding `params` themselves (not copies), in order.
struct ParameterHolder : torch::nn::Module {
  explicit ParameterHolder(const std::vector<at::Tensor>& params) {
    for (size_t i = 0; i < params.size(); ++i) register_parameter("p" + std::to_string(i), params[i]);
  }
  at::Tensor forward(const at::Tensor& x) { return x; }  // never run: the tests set gradients themselves
};

std::shared_ptr<Chain> chain_of(const std::vector<at::Tensor>& params) {
  auto chain = std::make_shared<Chain>();
  chain->add("parameters", std::make_shared<ParameterHolder>(params));
  return chain;
}

std::vector<at::Tensor> make_params() {
  std::vector<at::Tensor> params;
  int i = 0;
  for (auto shape : std::vector<std::vector<int64_t>>{{40, 5}, {100}, {7, 3}, {60}, {30, 2}}) {
    params.push_back((at::linspace(-1, 1, c10::multiply_integers(shape)).reshape(shape) * (0.5 + i++)).requires_grad_());
  }
  return params;
}

at::Tensor gradient(int rank, size_t i, int step, const at::Tensor& p) {
  return at::cos(at::linspace(0, 3, p.numel()) * static_cast<double>(rank + 1) + static_cast<double>(i + step)).reshape(p.sizes()) *
         (0.1 * static_cast<double>(rank + 1));
}

int64_t adamw_state_bytes(torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& [key, state] : optimizer.state()) {
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*state);
    bytes += static_cast<int64_t>(s.exp_avg().nbytes() + s.exp_avg_sq().nbytes());
  }
  return bytes;
}

struct RankOutcome {
  std::vector<at::Tensor> params;
  std::vector<bool> grad_after_reduce;
  std::vector<at::Tensor> reduced;  // the owner's reduced gradient (undefined elsewhere)
  int64_t state_bytes = 0, owned_bytes = 0, total_bytes = 0;
  std::map<size_t, at::Tensor> gathered_exp_avg_sq;  // rank 0: the whole state, gathered
  size_t kept_states = 0, owned_count = 0;
};

TEST(DistributedTest, TwoRanksStage2EqualOneAdamWOverTheSummedGradients) {
  constexpr int kSteps = 3;
  const std::string master = "127.0.0.1:" + std::to_string(test::free_port());
  const auto opts = torch::optim::AdamWOptions(0.05);  // the reference's
  OptimizerSpec spec;                                   // the same: AdamW, lr 0.05, weight decay 0.01
  spec.lr = 0.05;
  std::vector<RankOutcome> outcome(2);
  test::run_ranks(2, [&](int rank) {
    DistributedOptions o;
    o.world_size = 2;
    o.rank = rank;
    o.master = master;
    o.zero_stage = 2;
    o.timeout_seconds = 30;
    auto params = make_params();
    auto chain = chain_of(params);
    ZeroReplicated sdp(std::make_unique<ProcessGroup>(o), *chain, 2);
    auto sharded = make_optimizer(spec, sdp.optimized_parameters());
    torch::optim::Optimizer& adamw = *sharded;
    auto& out = outcome[static_cast<size_t>(rank)];
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = gradient(rank, i, step, params[i]);
      sdp.reduce_gradients();
      if (step == 0) {
        for (size_t i = 0; i < params.size(); ++i) {
          out.grad_after_reduce.push_back(params[i].grad().defined());
          out.reduced.push_back(params[i].grad().defined() ? params[i].grad().clone() : at::Tensor());
        }
      }
      adamw.step();
      zero_grad(adamw, true);
      sdp.finish_step(true);
    }
    out.state_bytes = adamw_state_bytes(adamw);
    out.owned_bytes = sdp.owned_bytes();
    out.total_bytes = sdp.parameter_bytes();
    const auto full = sdp.gather_optimizer_state(adamw, spec);
    EXPECT_EQ(full != nullptr, rank == 0) << "only rank 0 holds the gathered state";
    if (rank == 0) {
      for (size_t i = 0; i < params.size(); ++i) {
        auto it = full->state().find(param_state_key(params[i]));
        if (it == full->state().end()) continue;
        const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
        EXPECT_EQ(s.step(), kSteps);
        out.gathered_exp_avg_sq[i] = s.exp_avg_sq().clone();
      }
    }
    for (auto& p : params) out.params.push_back(p.detach().clone());
    // Resuming: from a whole state, each rank keeps its own parameters' share.
    auto whole = make_optimizer(spec, params);
    auto mine = make_optimizer(spec, sdp.optimized_parameters());
    for (auto& p : params) p.mutable_grad() = at::ones_like(p);
    whole->step();
    sdp.keep_owned_state(*whole, *mine);
    out.kept_states = mine->state().size();
    out.owned_count = sdp.optimized_parameters().size();
  });

  // The reference: one AdamW over every parameter with the gradients of both ranks summed.
  auto params = make_params();
  torch::optim::AdamW reference(params, opts);
  std::vector<at::Tensor> first_sum;
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = gradient(0, i, step, params[i]) + gradient(1, i, step, params[i]);
      if (step == 0) first_sum.push_back(params[i].grad().clone());
    }
    reference.step();
    zero_grad(reference, true);
  }
  const auto owner = partition_by_bytes(params, 2);
  for (size_t i = 0; i < params.size(); ++i) {
    for (int r = 0; r < 2; ++r) {
      const auto& out = outcome[static_cast<size_t>(r)];
      EXPECT_EQ(out.grad_after_reduce[i], owner[i] == r) << "stage 2 keeps only the owner's gradient, parameter " << i;
      if (owner[i] == r) EXPECT_TRUE(at::allclose(out.reduced[i], first_sum[i], 1e-6, 0)) << "reduced gradient " << i;
      EXPECT_TRUE(at::allclose(out.params[i], params[i].detach(), 1e-6, 1e-9)) << "rank " << r << " parameter " << i;
    }
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(
        *reference.state().at(param_state_key(params[i])));
    ASSERT_TRUE(outcome[0].gathered_exp_avg_sq.count(i)) << "rank 0 gathered no state for parameter " << i;
    EXPECT_TRUE(at::allclose(outcome[0].gathered_exp_avg_sq[i], s.exp_avg_sq(), 1e-6, 0)) << "gathered state " << i;
  }
  for (const auto& out : outcome) {
    EXPECT_EQ(out.state_bytes, 2 * out.owned_bytes) << "AdamW state only for the owned parameters";
    EXPECT_LT(out.owned_bytes, out.total_bytes);
    EXPECT_EQ(out.kept_states, out.owned_count);
  }
  EXPECT_EQ(outcome[0].owned_bytes + outcome[1].owned_bytes, outcome[0].total_bytes);
}

// 8-bit state under ZeRO 1: each rank quantizes its own parameters' moments; the result, the
// state gathered on rank 0 and the state kept per rank equal one process's Adam8bit.
std::vector<at::Tensor> make_large_params() {
  std::vector<at::Tensor> params;
  int i = 0;
  for (auto shape : std::vector<std::vector<int64_t>>{{80, 64}, {100}, {5000}, {64, 70}}) {
    params.push_back((at::linspace(-1, 1, c10::multiply_integers(shape)).reshape(shape) * (0.5 + i++)).requires_grad_());
  }
  return params;
}

TEST(DistributedTest, TwoRanksStage1With8BitStateEqualOneProcess) {
  constexpr int kSteps = 3;
  const std::string master = "127.0.0.1:" + std::to_string(test::free_port());
  OptimizerSpec spec;
  spec.lr = 0.05;
  spec.state = StatePrecision::k8Bit;
  std::vector<std::vector<at::Tensor>> final_params(2);
  std::vector<std::map<size_t, std::vector<at::Tensor>>> gathered(2);
  std::vector<size_t> kept(2), owned(2);
  test::run_ranks(2, [&](int rank) {
    DistributedOptions o;
    o.world_size = 2;
    o.rank = rank;
    o.master = master;
    o.zero_stage = 1;
    auto params = make_large_params();
    auto chain = chain_of(params);
    ZeroReplicated sdp(std::make_unique<ProcessGroup>(o), *chain, 1);
    auto sharded = make_optimizer(spec, sdp.optimized_parameters());
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = gradient(rank, i, step, params[i]);
      sdp.reduce_gradients();
      sharded->step();
      zero_grad(*sharded, true);
      sdp.finish_step(true);
    }
    const auto full = sdp.gather_optimizer_state(*sharded, spec);
    if (rank == 0) {
      for (size_t i = 0; i < params.size(); ++i) {
        gathered[0][i] = read_param_state(*full->state().at(param_state_key(params[i]))).tensors;
      }
    }
    for (auto& p : params) final_params[static_cast<size_t>(rank)].push_back(p.detach().clone());
    auto whole = make_optimizer(spec, params);
    auto mine = make_optimizer(spec, sdp.optimized_parameters());
    for (auto& p : params) p.mutable_grad() = at::ones_like(p);
    whole->step();
    sdp.keep_owned_state(*whole, *mine);
    kept[static_cast<size_t>(rank)] = mine->state().size();
    owned[static_cast<size_t>(rank)] = sdp.optimized_parameters().size();
  });
  auto params = make_large_params();
  auto reference = make_optimizer(spec, params);
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = gradient(0, i, step, params[i]) + gradient(1, i, step, params[i]);
    }
    reference->step();
    zero_grad(*reference, true);
  }
  for (size_t i = 0; i < params.size(); ++i) {
    for (int r = 0; r < 2; ++r) {
      EXPECT_TRUE(at::allclose(final_params[static_cast<size_t>(r)][i], params[i].detach(), 1e-6, 1e-9)) << "rank " << r << " parameter " << i;
    }
    const auto expected = read_param_state(*reference->state().at(param_state_key(params[i]))).tensors;
    const auto& got = gathered[0].at(i);
    ASSERT_EQ(got.size(), expected.size());
    for (size_t slot = 0; slot < got.size(); ++slot) {
      ASSERT_EQ(got[slot].defined(), expected[slot].defined()) << "parameter " << i << " slot " << slot;
      if (!got[slot].defined()) continue;
      EXPECT_EQ(got[slot].sizes(), expected[slot].sizes());
      // Codes may differ by one step of the map where a sum rounds differently: compare values.
      if (got[slot].scalar_type() == at::kByte) {
        EXPECT_LE((got[slot].to(at::kInt) - expected[slot].to(at::kInt)).abs().max().item<int>(), 1);
      } else {
        EXPECT_TRUE(at::allclose(got[slot], expected[slot], 1e-5, 1e-9)) << "parameter " << i << " slot " << slot;
      }
    }
  }
  EXPECT_EQ(kept[0], owned[0]);
  EXPECT_EQ(kept[1], owned[1]);
}

TEST(DistributedTest, UnreachableMasterFailsWithinTheTimeout) {
  DistributedOptions o;
  o.world_size = 2;
  o.rank = 1;
  o.master = "127.0.0.1:" + std::to_string(test::free_port());  // nobody listens there
  o.timeout_seconds = 2;
  try {
    ProcessGroup group(o);
    FAIL() << "connected to nobody";
  } catch (const DistributedError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1: cannot reach the rendezvous at " + o.master), std::string::npos) << e.what();
  }
}

// --- ZeRO 3 ---------------------------------------------------------------------------------

// Saving at stage 3, block by block: rank 0 writes the single-process format (files equal to
// one process's save of the same training, tensor for tensor) holding one block's whole
// weights at a time. Resuming from one process's saved files, every rank gets back exactly the
// shards of weights and state that stage 3 training had given it.
TEST(DistributedTest, Zero3SavesBlockByBlockAndResumesFromTheSingleProcessFormat) {
  constexpr int kSteps = 3;
  OptimizerSpec spec;
  spec.lr = 0.05;
  const auto root = std::filesystem::temp_directory_path() / ("memfit-zero3-save-" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  // The reference first: one process, the ranks' slices as micro-batches, saved.
  auto reference_chain = test::small_chain();
  auto reference = make_optimizer(spec, reference_chain->parameters());
  for (int step = 0; step < kSteps; ++step) {
    const Batch batch = test::chain_batch(step);
    for (int r = 0; r < 2; ++r) {
      const BatchSlice s = rank_slice(batch.size(), r, 2);
      test::chain_micro_batch(*reference_chain, batch.slice(s.start, s.length), batch.size());
    }
    reference->step();
    zero_grad(*reference, true);
  }
  save_state(root / "one", *reference_chain, *reference, spec, nlohmann::json{{"step", kSteps}}, c10::kCPU);

  const std::string master = "127.0.0.1:" + std::to_string(test::free_port());
  std::vector<int> writes(2, 0), most_blocks_held(2, 0), reloaded_equal(2, -1);
  test::run_ranks(2, [&](int rank) {
    DistributedOptions o;
    o.world_size = 2;
    o.rank = rank;
    o.master = master;
    o.zero_stage = 3;
    auto chain = test::small_chain();
    ZeroSharded sdp(std::make_unique<ProcessGroup>(o), *chain);
    auto optimizer = make_optimizer(spec, sdp.optimized_parameters());
    for (int step = 0; step < kSteps; ++step) {
      const Batch batch = test::chain_batch(step);
      const BatchSlice mine = rank_slice(batch.size(), rank, 2);
      test::chain_micro_batch(*chain, batch.slice(mine.start, mine.length), batch.size());
      optimizer->step();
      zero_grad(*optimizer, true);
    }
    std::vector<at::Tensor> shards_before = optimizer_state_tensors(*optimizer);
    for (const auto& p : sdp.optimized_parameters()) shards_before.push_back(p.detach().clone());

    std::vector<StatePart> parts = state_parts(*chain);
    std::optional<StateWriter> writer;
    if (rank == 0) writer.emplace(root / "zero3", kSteps);
    sdp.for_each_gathered_block_state(*optimizer, spec, [&](int block, const auto& state) {
      int held = 0;  // blocks whose parameters hold their values now
      for (int k = 0; k < chain->size(); ++k) {
        bool whole = false;
        for (const auto& p : chain->block_parameters(k, k)) whole = whole || p.numel() > 0;
        held += whole ? 1 : 0;
      }
      most_blocks_held[static_cast<size_t>(rank)] = std::max(most_blocks_held[static_cast<size_t>(rank)], held);
      ++writes[static_cast<size_t>(rank)];
      StatePart& part = parts.at(static_cast<size_t>(block));
      put_parameter_state(part, chain->block_parameters(block, block), state);
      writer->write_part(part);
    });
    if (rank == 0) writer->commit(nlohmann::json{{"step", kSteps}}, spec, c10::kCPU);

    const SavedState one = SavedState::open(root / "one");
    const std::vector<StatePart> live = state_parts(*chain);
    auto fresh = make_optimizer(spec, sdp.optimized_parameters());
    sdp.load_block_states(
        [&](int block) {
          const StatePart part = one.read_part(block);
          StatePart on_mine = live.at(static_cast<size_t>(block));
          check_part_fits(part, on_mine, spec, "one");
          copy_part_tensors(part, on_mine);
          on_mine.parameter_state = part.parameter_state;
          return parameter_state_of(on_mine, chain->block_parameters(block, block));
        },
        *fresh, spec);
    std::vector<at::Tensor> after = optimizer_state_tensors(*fresh);
    for (const auto& p : sdp.optimized_parameters()) after.push_back(p.detach());
    bool equal = after.size() == shards_before.size();
    for (size_t i = 0; equal && i < after.size(); ++i) equal = at::equal(after[i], shards_before[i]);
    reloaded_equal[static_cast<size_t>(rank)] = equal;
  });
  EXPECT_EQ(writes, (std::vector<int>{4, 0})) << "rank 0 writes each of the 4 blocks, the other rank none";
  EXPECT_EQ(most_blocks_held[0], 1) << "one block's whole weights at a time";
  EXPECT_EQ(reloaded_equal, (std::vector<int>{1, 1})) << "each rank's shards of weights and state, reloaded";

  // The files rank 0 wrote hold what one process saved, tensor for tensor.
  const SavedState one = SavedState::open(root / "one");
  const SavedState zero3 = SavedState::open(root / "zero3");
  ASSERT_EQ(zero3.parts(), one.parts());
  for (int k = 0; k < one.parts(); ++k) {
    const StatePart a = one.read_part(k), b = zero3.read_part(k);
    ASSERT_EQ(a.parameter_names, b.parameter_names) << "part " << k;
    for (size_t i = 0; i < a.parameters.size(); ++i) {
      EXPECT_TRUE(at::equal(a.parameters[i], b.parameters[i])) << a.parameter_names[i];
      ASSERT_TRUE(a.parameter_state[i].has_value() && b.parameter_state[i].has_value()) << a.parameter_names[i];
      EXPECT_EQ(a.parameter_state[i]->step, kSteps);
      EXPECT_EQ(b.parameter_state[i]->step, kSteps);
      for (size_t j = 0; j < a.parameter_state[i]->tensors.size(); ++j) {
        const at::Tensor& x = a.parameter_state[i]->tensors[j];
        const at::Tensor& y = b.parameter_state[i]->tensors[j];
        EXPECT_EQ(x.defined(), y.defined());
        if (x.defined() && y.defined()) EXPECT_TRUE(at::equal(x, y)) << a.parameter_names[i] << " state slot " << j;
      }
    }
  }
  std::filesystem::remove_all(root);
}

// Tied weights (one module in two blocks) cannot be sharded per block: one clear error on
// every rank, before any training.
TEST(DistributedTest, Zero3RefusesAParameterSharedByTwoBlocks) {
  const std::string master = "127.0.0.1:" + std::to_string(test::free_port());
  std::vector<std::string> errors(2);
  test::run_ranks(2, [&](int rank) {
    DistributedOptions o;
    o.world_size = 2;
    o.rank = rank;
    o.master = master;
    o.zero_stage = 3;
    auto chain = std::make_shared<Chain>();
    auto shared = torch::nn::Linear(4, 4);
    chain->add("first", shared.ptr());
    chain->add("again", shared.ptr());
    try {
      ZeroSharded sdp(std::make_unique<ProcessGroup>(o), *chain);
    } catch (const OptionError& e) {
      errors[static_cast<size_t>(rank)] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_NE(e.find("shares a parameter with another block"), std::string::npos) << e;
}

TEST(DistributedTest, Zero3PredictedStatesArePaddedShardsOfEachBlock) {
  // Blocks of 10 + 3 and 5 floats over 4 ranks. The second parameter starts on the next 64-byte
  // boundary, element 16, so the first block's layout holds 19 elements: shards of ceil(19/4)
  // = 5 and ceil(5/4) = 2.
  const std::vector<at::Tensor> params{at::zeros({10}), at::zeros({3}), at::zeros({5})};
  const auto ranks = predicted_rank_states(params, 4, 3, 2.0, {0, 0, 1});
  ASSERT_EQ(ranks.size(), 4u);
  for (const auto& r : ranks) {
    EXPECT_EQ(r.weights, (5 + 2) * 4);
    EXPECT_EQ(r.gradients, (5 + 2) * 4);
    EXPECT_EQ(r.optimizer_state, 2 * (5 + 2) * 4);
  }
  const auto blocks = gathered_block_bytes({{params[0], params[1]}, {params[2]}}, 4);
  EXPECT_EQ(blocks[0].full, 19 * 4);
  EXPECT_EQ(blocks[0].shard, 5 * 4);
  EXPECT_EQ(blocks[1].shard, 2 * 4);
  EXPECT_THROW(predicted_rank_states(params, 4, 4, 2.0), std::invalid_argument);
}

TEST(DistributedTest, Zero3FlatLayoutStartsEachParameterOn64Bytes) {
  // 64 bytes: 16 floats, 32 halves, 8 doubles; a parameter already on a boundary moves nowhere.
  EXPECT_EQ(flat_layout({at::zeros({10}), at::zeros({3}), at::zeros({16}), at::zeros({1})}).offsets,
            (std::vector<int64_t>{0, 16, 32, 48}));
  EXPECT_EQ(flat_layout({at::zeros({5}, at::kHalf), at::zeros({2, 2}, at::kHalf)}).numel, 32 + 4);
  EXPECT_EQ(flat_layout({at::zeros({1}, at::kDouble), at::zeros({1}, at::kDouble)}).offsets, (std::vector<int64_t>{0, 8}));
  EXPECT_EQ(flat_layout({}).numel, 0);
}

}  // namespace
}  // namespace memfit
