#include "memfit/train/zero_sharded.h"

#include <ATen/autocast_mode.h>
#include <c10/core/InferenceMode.h>
#include <torch/torch.h>

#include <set>

#include "memfit/errors.h"
#include "memfit/measure/size.h"
#include "memfit/plan/rank_states.h"
#include "memfit/techniques/checkpoint.h"
#include "memfit/train/saved_state.h"

namespace memfit {

ZeroSharded::ZeroSharded(std::unique_ptr<ProcessGroup> group, Chain& chain) : Strategy(std::move(group), chain) {
  start_from_rank0_weights(this->group(), chain_.parameters(), 3);
  at::NoGradGuard no_grad;
  shard_of_block_.assign(static_cast<size_t>(chain_.size()), -1);
  std::set<const void*> seen;  // a parameter shared by two blocks (tied weights) cannot be in two shards
  for (int i = 0; i < chain_.size(); ++i) {
    for (const auto& p : chain_.block_parameters(i, i)) {
      check_option(seen.insert(p.unsafeGetTensorImpl()).second, "zero_stage", 3,
                   "block " + std::to_string(i) + " (" + chain_.block(i).name +
                       ") shares a parameter with another block (tied weights): ZeRO 3 gathers one block at a time");
    }
  }
  for (int i = 0; i < chain_.size(); ++i) {
    if (chain_.block_parameters(i, i).empty()) continue;
    BlockShard b = make_shard(i);
    for (const auto& p : b.params) total_bytes_ += static_cast<int64_t>(p.nbytes());  // before release empties them
    owned_bytes_ += static_cast<int64_t>(b.shard.nbytes());
    release(b);
    shard_of_block_[static_cast<size_t>(i)] = static_cast<int>(shards_.size());
    shards_.push_back(std::move(b));
  }
  install_runner();
}

// (Gathers and a reduction still in flight are waited for by their PendingCollectives, which
// report no error while unwinding from another.)
ZeroSharded::~ZeroSharded() { chain_.set_block_runner({}); }  // the runner points here

// Block i's parameters laid out flat; this rank's range of them becomes its shard.
ZeroSharded::BlockShard ZeroSharded::make_shard(int i) {
  BlockShard b;
  b.block = i;
  b.params = chain_.block_parameters(i, i);
  for (const auto& p : b.params) {
    check_option(p.scalar_type() == b.params.front().scalar_type() && p.device() == b.params.front().device(), "zero_stage", 3,
                 "the parameters of block " + std::to_string(i) + " (" + chain_.block(i).name +
                     ") must share one dtype and device to be sharded flat");
    check_option(p.requires_grad(), "zero_stage", 3,
                 "every parameter must require grad; block " + std::to_string(i) + " has a frozen one");
    b.shapes.push_back(p.sizes().vec());
  }
  FlatLayout layout = flat_layout(b.params);
  b.offsets = std::move(layout.offsets);
  b.numel = layout.numel;
  b.shard_numel = shard_numel(b.numel, world_size());
  b.shard = own_range(b, laid_out_flat(b, b.params)).requires_grad_(true);
  return b;
}

// One tensor per parameter (any shape), laid out at the block's offsets; the gaps are zero.
at::Tensor ZeroSharded::laid_out_flat(const BlockShard& b, const std::vector<at::Tensor>& parts) {
  at::Tensor flat = at::zeros({b.numel}, parts.front().options().requires_grad(false));
  for (size_t i = 0; i < parts.size(); ++i) flat.narrow(0, b.offsets[i], parts[i].numel()).copy_(parts[i].detach().reshape({-1}));
  return flat;
}

void ZeroSharded::release_after(BlockShard& b, const std::function<void()>& use) {
  try {
    use();
  } catch (...) {
    release(b);
    throw;
  }
  release(b);
}

void ZeroSharded::install_runner() {
  chain_.set_block_runner([this](int index, const at::Tensor& x, const BlockFn& run) { return run_block(index, x, run); });
}

ZeroSharded::Prefetch ZeroSharded::start_gather(const BlockShard& b) {
  at::NoGradGuard no_grad;
  c10::InferenceMode normal_tensors(false);  // the parameters' data outlives an evaluation's inference mode
  const int64_t s = b.shard_numel;
  Prefetch f;
  f.flat = at::empty({s * world_size()}, at::TensorOptions().dtype(b.shard.scalar_type()).device(b.shard.device()));
  f.flat.narrow(0, rank() * s, s).copy_(b.shard.detach());
  f.shard_version = b.shard._version();
  f.pending = std::make_unique<PendingCollectives>(group(), "gathering a block's weights (ZeRO 3)");
  for (int r = 0; r < world_size(); ++r) f.pending->broadcast(f.flat.narrow(0, r * s, s), r);
  return f;
}

void ZeroSharded::gather(BlockShard& b) {
  at::NoGradGuard no_grad;
  std::optional<Prefetch> f;
  if (auto it = prefetched_.find(b.block); it != prefetched_.end()) {
    f = std::move(it->second);
    prefetched_.erase(it);
    f->pending->wait();  // every rank started it: wait even when it is stale
    if (f->shard_version != b.shard._version()) f.reset();
  }
  if (!f) {
    f = start_gather(b);
    f->pending->wait();
  }
  at::autocast::clear_cache();  // a cached cast of a parameter is of its previous (released) value
  set_views(b, f->flat);
}

void ZeroSharded::gather_in_pass(int k, GatherFor pass) {
  // A backward that failed part-way (out of memory: the micro-batch is redone) leaves its
  // reduction unfinished; its gradients must not count.
  if (pass == GatherFor::kForward && reduction_.pending) drop_reduction();
  gather(shards_[static_cast<size_t>(k)]);
  const int step = pass == GatherFor::kForward ? 1 : -1;
  for (int t = 1; t <= prefetch_depth_; ++t) {
    const int next = k + step * t;
    if (next < 0 || next >= static_cast<int>(shards_.size())) break;
    const BlockShard& b = shards_[static_cast<size_t>(next)];
    if (prefetched_.count(b.block) == 0) prefetched_.emplace(b.block, start_gather(b));
  }
}

void ZeroSharded::drop_reduction() {
  Reduction r = std::move(reduction_);
  reduction_ = Reduction{};
  r.pending->wait();  // every rank started it
}

void ZeroSharded::drop_prefetched() {
  for (auto& [block, f] : prefetched_) f.pending->wait();
  prefetched_.clear();
}

bool ZeroSharded::optimizer_step(torch::optim::Optimizer& optimizer, const StepOptions& options) {
  drop_prefetched();
  finish_reduction();
  return Strategy::optimizer_step(optimizer, options);
}

// One allocation for the block, freed when all its parameters are released.
void ZeroSharded::set_views(BlockShard& b, const at::Tensor& flat) {
  for (size_t i = 0; i < b.params.size(); ++i) {
    b.params[i].set_data(flat.narrow(0, b.offsets[i], c10::multiply_integers(b.shapes[i])).view(b.shapes[i]));
  }
}

at::Tensor ZeroSharded::own_range(const BlockShard& b, const at::Tensor& flat) const {
  const int64_t first = std::min<int64_t>(b.numel, rank() * b.shard_numel);
  const int64_t last = std::min<int64_t>(b.numel, (rank() + 1) * b.shard_numel);
  at::Tensor mine = at::zeros({b.shard_numel}, flat.options());  // the padding stays zero
  mine.narrow(0, 0, last - first).copy_(flat.narrow(0, first, last - first));
  return mine;
}

void ZeroSharded::release(BlockShard& b) {
  at::NoGradGuard no_grad;
  const auto empty = at::TensorOptions().dtype(b.shard.scalar_type()).device(b.shard.device());
  for (auto& p : b.params) {
    p.set_data(at::empty({0}, empty));
    p.mutable_grad().reset();  // (profiling the whole model leaves full gradients)
  }
}

// Each owner's range [r*s, (r+1)*s) of the flat layout is summed along a chain in rank order,
// 0 -> 1 -> ... -> N-1, then sent to its owner: ((g0 + g1) + g2) + ..., the order in which one
// process accumulates the ranks' micro-batches, so the sums are bit-equal to single-process
// training for any world size (Gloo's reduce sums in an order of its own; it has no
// reduce_scatter). c10d point-to-point sends, one range at a time on every rank.
at::Tensor ZeroSharded::flat_gradients(const BlockShard& b, std::vector<at::Tensor> full_grads) const {
  at::Tensor flat = at::zeros({world_size() * b.shard_numel}, b.shard.options());
  for (size_t i = 0; i < b.params.size(); ++i) {
    if (!full_grads[i].defined()) continue;  // no gradient: zeros take part
    flat.narrow(0, b.offsets[i], full_grads[i].numel()).copy_(full_grads[i].reshape({-1}));
    full_grads[i] = at::Tensor();
  }
  return flat;
}

at::Tensor ZeroSharded::reduce_to_shard(BlockShard& b, std::vector<at::Tensor> full_grads) {
  at::NoGradGuard no_grad;
  const int64_t s = b.shard_numel;
  const at::Tensor flat = flat_gradients(b, std::move(full_grads));
  // Range by range: one chain of messages per owner; only the running sum is allocated.
  at::Tensor shard_grad;
  for (int r = 0; r < world_size(); ++r) {
    at::Tensor sum = sum_in_rank_order(flat.narrow(0, r * s, s), r);
    if (rank() == r) shard_grad = sum.clone();  // (the owner's sum may be a view of the flat gradients)
  }
  return shard_grad;
}

// One piece's chain: this rank adds its part to the sum of the ranks before it and passes
// it on; the owner gets the total (on other ranks the result is meaningless).
at::Tensor ZeroSharded::sum_in_rank_order(at::Tensor mine, int owner) {
  const char* what = "summing a block's gradients for their owner (ZeRO 3)";
  const int last = world_size() - 1;
  at::Tensor sum = mine;
  if (rank() > 0) {
    sum = at::empty_like(mine);
    group().receive(sum, rank() - 1, what);
    sum.add_(mine);
  }
  if (rank() < last) {
    group().send(sum, rank() + 1, what);
  } else if (owner != last) {
    group().send(sum, owner, what);
  }
  if (rank() == owner && owner != last) group().receive(sum, last, what);
  return sum;
}

at::Tensor ZeroSharded::reduce_in_flight(int k, std::vector<at::Tensor> full_grads) {
  finish_reduction();
  start_reduction(k, std::move(full_grads));
  if (k == 0) finish_reduction();  // the backward's last block with parameters
  return at::Tensor();
}

// This rank's piece of every other rank's range goes to that rank (a send per parameter
// piece, tagged by the parameter), and the other ranks' pieces of this rank's range come in.
void ZeroSharded::start_reduction(int k, std::vector<at::Tensor> full_grads) {
  at::NoGradGuard no_grad;
  BlockShard& b = shards_[static_cast<size_t>(k)];
  const int64_t s = b.shard_numel;
  Reduction r;
  r.shard = k;
  r.flat_grads = flat_gradients(b, std::move(full_grads));
  r.pieces = at::empty({world_size(), s}, b.shard.options());
  r.pending = std::make_unique<PendingCollectives>(group(), "sending a block's gradients to their owners (ZeRO 3)");
  // One message per pair of ranks: each owner's range of the flat layout is contiguous.
  for (int owner = 0; owner < world_size(); ++owner) {
    const at::Tensor mine = r.flat_grads.narrow(0, owner * s, s);
    if (owner != rank()) {
      r.pending->send(mine, owner, 0);
      continue;
    }
    r.pieces[rank()].copy_(mine);
    for (int from = 0; from < world_size(); ++from) {
      if (from != rank()) r.pending->receive(r.pieces[from], from, 0);
    }
  }
  reduction_ = std::move(r);
}

void ZeroSharded::finish_reduction() {
  if (!reduction_.pending) return;
  at::NoGradGuard no_grad;
  Reduction r = std::move(reduction_);
  reduction_ = Reduction{};
  r.pending->wait();
  r.flat_grads = at::Tensor();
  // ((g0 + g1) + g2) + ...: the chain's order, so the same bits.
  at::Tensor sum = r.pieces[0].clone();
  for (int from = 1; from < world_size(); ++from) sum.add_(r.pieces[from]);
  r.pieces = at::Tensor();
  at::Tensor& grad = shards_[static_cast<size_t>(r.shard)].shard.mutable_grad();
  if (grad.defined()) {
    grad.add_(sum);
  } else {
    grad = sum;
  }
}

at::Tensor ZeroSharded::run_block(int index, const at::Tensor& x, const BlockFn& run) {
  const int k = shard_of_block_.at(static_cast<size_t>(index));
  if (k < 0) return run(x);  // nothing to gather: an ordinary block
  GatheredParams g;
  g.params = shards_[static_cast<size_t>(k)].params;
  g.gather = [this, k](GatherFor pass) { gather_in_pass(k, pass); };
  g.release = [this, k] { release(shards_[static_cast<size_t>(k)]); };
  g.reduce = [this, k](std::vector<at::Tensor> grads) {
    return prefetch_depth_ > 0 ? reduce_in_flight(k, std::move(grads)) : reduce_to_shard(shards_[static_cast<size_t>(k)], std::move(grads));
  };
  return checkpoint_gathered(run, x, shards_[static_cast<size_t>(k)].shard, std::move(g), chain_.block_buffers(index, index),
                             chain_.input_writes(index));
}

std::vector<GatheredBlockBytes> ZeroSharded::block_bytes() const {
  std::vector<GatheredBlockBytes> out(static_cast<size_t>(chain_.size()));
  for (const auto& b : shards_) {
    const auto element = static_cast<int64_t>(b.shard.element_size());
    out[static_cast<size_t>(b.block)] = {b.numel * element, b.shard_numel * element, world_size() * b.shard_numel * element};
  }
  return out;
}

void ZeroSharded::for_each_gathered_block(const std::function<void(const std::vector<at::Tensor>&)>& visit) {
  for (auto& b : shards_) {
    gather(b);
    release_after(b, [&] { visit(b.params); });
  }
}

// Rank 0: every rank's piece of s elements, in rank order (the flat block, padded); the other
// ranks send theirs and get an undefined tensor.
at::Tensor ZeroSharded::gather_to_rank0(const at::Tensor& piece, int64_t s, const char* what) {
  if (rank() != 0) {
    group().send(piece.contiguous(), 0, what);
    return at::Tensor();
  }
  at::Tensor flat = at::empty({s * world_size()}, piece.options());
  flat.narrow(0, 0, s).copy_(piece);
  for (int r = 1; r < world_size(); ++r) group().receive(flat.narrow(0, r * s, s), r, what);
  return flat;
}

// Rank 0: the block's whole weights (set as its parameters' values) and each parameter's
// state, in the block's parameter order; other ranks send theirs and get records to ignore.
ZeroSharded::BlockState ZeroSharded::gather_state_to_rank0(BlockShard& b, torch::optim::Optimizer& sharded,
                                                                          const char* what) {
  const at::Tensor weights = gather_to_rank0(b.shard.detach(), b.shard_numel, what);
  if (rank() == 0) set_views(b, weights);
  BlockState state(b.params.size());
  auto it = sharded.state().find(param_state_key(b.shard));
  if (it == sharded.state().end()) return state;  // not stepped yet: on every rank alike
  const ParamStateRecord mine = read_param_state(*it->second);
  for (auto& s : state) s = ParamStateRecord{mine.step, {}};
  for (const at::Tensor& slot : mine.tensors) {
    const at::Tensor flat = slot.defined() ? gather_to_rank0(slot, b.shard_numel, what) : at::Tensor();
    for (size_t i = 0; i < b.params.size(); ++i) {
      const int64_t numel = c10::multiply_integers(b.shapes[i]);
      state[i]->tensors.push_back(flat.defined() ? flat.narrow(0, b.offsets[i], numel).view(b.shapes[i]) : at::Tensor());
    }
  }
  return state;
}

void ZeroSharded::for_each_gathered_block_state(torch::optim::Optimizer& sharded, const OptimizerSpec& spec,
                                                        const std::function<void(int block, const BlockState& state)>& write) {
  check_option(spec.state != StatePrecision::k8Bit, "optimizer.state", "8bit",
               "saving at ZeRO 3 needs fp32 state (8-bit blocks would straddle parameters)");
  at::NoGradGuard no_grad;
  const char* what = "gathering a block's weights and optimizer state on rank 0 to save (ZeRO 3)";
  for (int block = 0; block < chain_.size(); ++block) {
    const int k = shard_of_block_.at(static_cast<size_t>(block));
    if (k < 0) {
      if (rank() == 0) write(block, {});
      continue;
    }
    BlockShard& b = shards_[static_cast<size_t>(k)];
    const BlockState state = gather_state_to_rank0(b, sharded, what);
    if (rank() == 0) release_after(b, [&] { write(block, state); });
  }
}

// This rank's range of a gathered block (whole values in its parameters) and of its saved
// state, into its shard and `sharded`'s state of it.
void ZeroSharded::keep_own_state(BlockShard& b, const BlockState& state, torch::optim::Optimizer& sharded,
                                         const OptimizerSpec& spec) {
  at::NoGradGuard no_grad;
  b.shard.detach().copy_(own_range(b, laid_out_flat(b, b.params)));
  sharded.state().erase(param_state_key(b.shard));
  const bool stepped = !state.empty() && state.front().has_value();
  for (const auto& r : state) {
    if (r.has_value() != stepped || (stepped && r->step != state.front()->step)) {
      throw std::runtime_error("cannot resume at ZeRO 3: block " + std::to_string(b.block) +
                               "'s parameters were saved after unequal numbers of optimizer steps (a shard has one)");
    }
  }
  if (!stepped) return;  // saved before any step
  ParamStateRecord mine{state.front()->step, {}};
  for (size_t slot = 0; slot < state.front()->tensors.size(); ++slot) {
    if (!state.front()->tensors[slot].defined()) {
      mine.tensors.emplace_back();
      continue;
    }
    std::vector<at::Tensor> parts;
    for (const auto& r : state) parts.push_back(r->tensors.at(slot));
    mine.tensors.push_back(own_range(b, laid_out_flat(b, parts)));
  }
  sharded.state()[param_state_key(b.shard)] = make_param_state(spec, mine);
}

void ZeroSharded::load_block_states(const std::function<BlockState(int block)>& load, torch::optim::Optimizer& sharded,
                                            const OptimizerSpec& spec) {
  check_option(spec.state != StatePrecision::k8Bit, "optimizer.state", "8bit",
               "resuming at ZeRO 3 needs fp32 state (8-bit blocks would straddle parameters)");
  for (int block = 0; block < chain_.size(); ++block) {
    const int k = shard_of_block_.at(static_cast<size_t>(block));
    if (k < 0) {
      load(block);  // its buffers
      continue;
    }
    BlockShard& b = shards_[static_cast<size_t>(k)];
    gather(b);  // whole parameters to load into
    release_after(b, [&] { keep_own_state(b, load(block), sharded, spec); });
  }
}

// Every block gathered and the chain running plainly, for the life of the scope.
class ZeroSharded::GatheredModel : public Strategy::WholeModelScope {
 public:
  explicit GatheredModel(ZeroSharded& z) : z_(z) {
    z_.chain_.set_block_runner({});
    for (auto& b : z_.shards_) z_.gather(b);
  }
  ~GatheredModel() override {
    for (auto& b : z_.shards_) z_.release(b);
    z_.install_runner();
  }

 private:
  ZeroSharded& z_;
};

std::unique_ptr<Strategy::WholeModelScope> ZeroSharded::whole_model() { return std::make_unique<GatheredModel>(*this); }

std::string ZeroSharded::describe() const {
  return "rank " + std::to_string(rank()) + " of " + std::to_string(world_size()) + " (" + group().backend_name() + " via " +
         group().options().master + "), ZeRO stage 3: the optimizer steps " + format_bytes(owned_bytes_) +
         " of the parameters (this rank's shards)";
}

std::vector<at::Tensor> ZeroSharded::optimized_parameters() const {
  std::vector<at::Tensor> shards;
  for (const auto& b : shards_) shards.push_back(b.shard);
  return shards;
}

void ZeroSharded::add_to_plan_request(PlanRequest& request, const MeasuredCosts& costs, const StateUse& state) const {
  request.gathered_blocks = block_bytes();
  const int pinned = group().options().prefetch_depth;
  request.prefetch_depths = pinned >= 0 ? std::vector<int>{pinned} : std::vector<int>{2, 1, 0};
  request.gradient_bytes = owned_bytes_;
  request.checkpoint = CheckpointPlan::all(chain_.size());  // what gathering does anyway
  if (state.saves || state.resumes) request.optimizer_alternatives.clear();  // fp32 state: saving splits it by parameter
  if (!(primary() && state.saves)) return;
  // Saving: rank 0 holds the largest block's whole weights and state beside its shards.
  const double per_byte =
      static_cast<double>(costs.optimizer.front().state_bytes) / static_cast<double>(std::max<int64_t>(1, owned_bytes_));
  int64_t largest = 0;
  for (const auto& b : block_bytes()) largest = std::max(largest, b.full);
  request.extra_bytes = largest + std::llround(per_byte * static_cast<double>(largest));
}

// Block by block: rank 0 gathers one block's weights and state, writes its part of the
// single-process format and lets it go.
void ZeroSharded::save(const SaveRequest& r) {
  std::vector<StatePart> parts = state_parts(chain_);
  std::optional<StateWriter> writer;
  if (primary()) writer.emplace(r.dir, r.meta.at("step").get<int64_t>());
  for_each_gathered_block_state(r.optimizer, r.spec, [&](int block, const BlockState& state) {
    StatePart& part = parts.at(static_cast<size_t>(block));
    put_parameter_state(part, chain_.block_parameters(block, block), state);
    writer->write_part(part);
    put_parameter_state(part, {}, {});  // let the gathered state go
  });
  if (primary()) writer->commit(r.meta, r.spec, r.device);
}

// Block by block: every rank reads block k's part and keeps its shards of it.
void ZeroSharded::resume(SavedState& saved, torch::optim::Optimizer& optimizer, const OptimizerSpec& spec,
                         c10::Device device) {
  const std::vector<StatePart> live = state_parts(chain_);
  if (saved.parts() != static_cast<int>(live.size())) {
    throw std::runtime_error("cannot resume: " + saved.file().string() + " holds " + std::to_string(saved.parts()) +
                             " parts, this model has " + std::to_string(live.size()) + " blocks");
  }
  load_block_states(
      [&](int block) {
        const StatePart part = saved.read_part(block);
        const StatePart& mine = live.at(static_cast<size_t>(block));
        check_part_fits(part, mine, spec, saved.file().string() + " (block " + std::to_string(block) + ")");
        copy_part_tensors(part, mine);
        StatePart saved_on_mine = mine;  // the saved state, found by this model's tensors
        saved_on_mine.parameter_state = part.parameter_state;
        return parameter_state_of(saved_on_mine, chain_.block_parameters(block, block));
      },
      optimizer, spec);
  saved.restore_generators(device);
}

// The same bytes, in the same order, as a single process's: one block gathered at a time.
std::string ZeroSharded::weights_sha256(const std::string& dump_path) {
  WeightsDump dump(primary() ? dump_path : "");
  return memfit::weights_sha256([&](const ParameterVisitor& visit) {
    for_each_gathered_block([&](const std::vector<at::Tensor>& params) {
      for (const auto& p : params) {
        visit(p);
        dump.write(p);
      }
    });
  });
}
StrategyEntry zero_sharded_entry() {
  return {"ZeRO 3", [](const DistributedOptions& o) { return o.enabled() && o.zero_stage == 3; },
          [](const StrategyAsk& a) {
            check_option(!((a.state.saves || a.state.resumes) && a.step.optimizer.state == StatePrecision::k8Bit),
                         "optimizer.state", "8bit", "saving and resuming at ZeRO 3 need fp32 state (8-bit blocks would straddle parameters)");
            check_option(!(a.checkpoint_pinned && a.step.checkpoint.recomputed_blocks().size() != static_cast<size_t>(a.blocks)),
                         "checkpoint", a.step.checkpoint.describe(), "ZeRO 3 recomputes every block: expected all");
            check_option(a.offload == OffloadMode::kNone, "offload", offload_mode_name(a.offload),
                         "ZeRO 3 shards the optimizer's state instead: offload runs at stages 0-2");
          },
          [](const DistributedOptions& o, Chain& chain) -> std::unique_ptr<Strategy> {
            auto group = std::make_unique<ProcessGroup>(o);  // joined first: a bad master fails before any work
            return std::make_unique<ZeroSharded>(std::move(group), chain);
          }};
}

}  // namespace memfit
