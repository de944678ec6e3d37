// activation_offload.h — a block's saved activations in host memory between its forward and its
// backward (as torchtune's OffloadActivations does from Python): every tensor autograd saves
// while the block runs forward is copied to the host space (memory_space.h) as it is saved, so
// its device memory goes once the forward is done with it; when backward reaches the block's
// output, all of them come back to the device at once, before the block's backward runs. Run one
// block ahead (prefetch_when_reached), they start coming back when backward reaches the block
// after it, beside that block's backward (a side stream on CUDA, an inter-op thread on the CPU).
//
//   device: block k's output only, until block k+1's backward     host: what block k's graph saved
//
// Autograd's saved-tensor hooks do the moving: the pack/unpack pair PyTorch's
// torch.autograd.graph.saved_tensors_hooks installs from Python. In C++ the autograd engine
// hands out those hooks, so memfit installs an engine that hands out its own while a block runs
// offloaded (a process whose default engine is Python's cannot: there, use the Python hooks).
//
// What moves: storage made during the block's forward (with a MemoryTracker installed; else any
// but `stay`'s). What stays on the device: what existed before (parameters, autocast's cached
// weight copies, the block's input: alive anyway), the tensors in `stay` (the block's parameters
// and buffers), and the block's output (the block after reads it). A storage saved through
// several views moves once, as one copy.
//
//   std::shared_ptr<memfit::OffloadedActivations> saved;
//   at::Tensor y = memfit::run_offloaded([&](const at::Tensor& in) { return block(in); }, x, params, &saved);
//   at::Tensor z = next_block(y);
//   memfit::prefetch_when_reached(z, saved);
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <vector>

namespace memfit {

// What one block run offloaded saved (its graph and the prefetch hook share it).
class OffloadedActivations;

// Whether run_offloaded can move anything in this process (false where Python's autograd engine
// is the default: run_offloaded then runs the block as it is and keeps everything on the device).
bool activation_offload_available();

// Runs `block(x)` with its saved activations offloaded to the host until its backward. Without
// grad (nothing saved) it just runs the block, and `activations` stays null.
at::Tensor run_offloaded(const std::function<at::Tensor(const at::Tensor&)>& block, const at::Tensor& x,
                         const std::vector<at::Tensor>& stay = {},
                         std::shared_ptr<OffloadedActivations>* activations = nullptr);

// When backward reaches `later` (the output of the part that ran after the offloaded block),
// `activations` start coming back to the device, so that they are there, or nearly, when
// backward reaches their own block. Nothing where either is missing or `later` needs no grad.
void prefetch_when_reached(const at::Tensor& later, std::shared_ptr<OffloadedActivations> activations);

}  // namespace memfit
