// schedule.h — the optimal checkpointing schedule of a chain under a memory limit, by dynamic
// programming (after rotor, Beaumont et al., "Optimal checkpointing for heterogeneous chains").
//
// A schedule cuts the chain into units: a plain block (all its activations kept for backward),
// a checkpointed segment [first, last] (only the segment's input kept; the segment is run
// again, keeping everything, when backward reaches it), or, where the costs allow it, an
// offloaded block (its activations kept on the host, copied there in its forward and back while
// the unit after it runs its backward, prefetched: the time of two copies instead of a
// recompute, the overlap not counted). Among all schedules whose modelled peak fits the limit,
// the DP finds one with the least recompute time. State: (next block, bytes held by the blocks
// before it, in slots, whether the block before it is offloaded); transitions: the next unit.
// Pure arithmetic: the numbers come from profiling (planner.h).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace memfit {

// What one block costs, measured at one micro-batch size. Bytes are tensor storage bytes.
struct BlockCost {
  double forward_seconds = 0;
  double backward_seconds = 0;
  int64_t output_bytes = 0;      // its output x_i
  bool output_kept = false;      // in a plain run, x_i stays alive for the next block's backward
  bool keeps_own_output = false; // its own graph keeps x_i (a last op saving its result:
                                 // ReLU(inplace=True), sigmoid): alive in its own backward too
  int64_t kept_bytes = 0;        // allocated in its forward and alive at the end of forward, plain run
                                 // (includes output_bytes when output_kept)
  int64_t forward_peak = 0;      // above the live bytes at its start, during its forward (with grad)
  int64_t recompute_peak = -1;   // the same while its block alone runs (what a recompute runs: not
                                 // the model's own code after the block); -1: forward_peak
  int64_t forward_nograd_peak = 0;  // the same without grad (inside a checkpointed segment)
  int64_t forward_left_bytes = 0;   // what its forward leaves alive until forward ends, besides its
                                    // kept bytes and output: a model's own leftovers (a Python
                                    // model's locals, key/value caches returned with its output),
                                    // alive under the later blocks' forward, gone by backward (a
                                    // recompute makes and drops them); net, may be negative
  int64_t backward_peak = 0;     // above the live bytes at its backward's start, its parameters'
                                 // gradients made by it (a step's first micro-batch; incl. them);
                                 // counts the gradient arriving for its output; that gradient and
                                 // its input freed once the block's graph is done with them
  int64_t backward_peak_accumulating = 0;  // the same with the gradients there before, added into
                                           // (later micro-batches, kept gradients: temporaries only)
  int64_t backward_peak_streamed = -1;  // the same with each gradient leaving once made (the
                                        // optimizer offloaded: one parameter's on the device at a
                                        // time); -1: not measured (then backward_peak, the safe side)
  int64_t backward_held_input_bytes = 0;       // what its backward's peak grows by when its input
                                               // outlives it (a segment's saved input; an output the
                                               // block before keeps in its own graph)
  int64_t backward_held_by_segment_bytes = 0;  // ... when it ends a checkpointed segment: the gradient
                                               // that arrived and the recomputed output are held
  int64_t backward_held_all_bytes = 0;         // ... both
  int64_t recompute_start_extra_bytes = 0;  // live beyond the model's count when a non-reentrant
                                            // checkpoint recomputes the segment it ends (at its
                                            // backward's first read of a saved tensor): the
                                            // gradient arriving for its output, gradient parts of
                                            // shared weights waiting to be summed, and gradients
                                            // made before that read (a residual add casting the
                                            // gradient of a bf16 branch)
  int64_t param_bytes = 0;       // its parameters (their gradients appear in its backward)
  int64_t cast_bytes = 0;        // autocast's low-precision copies of its weights (0 in fp32): a
                                 // step makes all of them before forward and caches them until
                                 // forward ends (plain blocks' copies then live on in the graph)
  bool recomputable = true;      // false: never in a checkpointed segment (a part of the step its
                                 // caller cannot run again alone, such as the code before the
                                 // first block of a Python model); in the JSON only when false
  int64_t input_copy_bytes = 0;  // a block that writes into its input (an in-place first op) runs on
                                 // a copy of an input kept by someone else: a checkpointed segment's
                                 // saved input (forward and recompute), the chain's input (block 0)
  bool input_copy_kept = false;  // its graph keeps that copy for backward (not as its output)
  // Inside a checkpointed segment: what its part keeps to the end of forward all the same (the
  // tensors that the model's own code between blocks saves: it runs with grad and is never
  // recomputed; 0 for a chain, whose blocks are the whole model), besides its output; and
  // whether that code keeps its output (a U-Net's skip read by a later block, pooled first).
  int64_t segment_kept_bytes = 0;
  bool segment_output_kept = false;
  // Inside a checkpointed segment: what its recording holds of the tensors handed to the block
  // besides its input that the step's forward made (not the batch, not a parameter): a T5 block's
  // position bias made by the stack's first block, a U-Net up block's skip. Alive to the segment's
  // backward, each storage once per segment: `handed_new_bytes` is the part not handed to the
  // block before it too.
  int64_t handed_bytes = 0;
  int64_t handed_new_bytes = 0;
  // Its block's own output twice once its segment is recomputed: the forward's, which the model's
  // code after the block keeps (a U-Net's skip, pooled), and the recompute's, which the block's
  // own graph saves (a last ReLU): the second copy's bytes, alive until its backward.
  int64_t recomputed_output_copy_bytes = 0;
  int64_t shared_gradient_bytes = 0;  // parts of gradients of parameters shared with later blocks
                                      // (tied weights), waiting to be summed during its backward
                                      // when gradients are already there (in place otherwise)
};

struct ChainCosts {
  std::vector<BlockCost> blocks;
  int64_t fixed_bytes = 0;          // alive all step: weights, optimizer state, the batch, ...
  bool gradients_present = false;   // all gradients exist from the start (accumulation, keep-grads)
  bool gradients_streamed = false;  // each block's gradients leave once its backward is done
                                    // (offloaded to the host): none are carried to later blocks
  int64_t segment_overhead_bytes = 0;  // what each checkpointed segment keeps besides its input (RNG state)
  int64_t loss_bytes = 0;           // alive at the end of forward besides the blocks' (loss, logits' helpers)
  // How a checkpointed segment's backward holds memory. false: memfit's checkpoint (checkpoint.h)
  // keeps the segment's recomputed output and the gradient that arrived for it until the
  // segment's backward returns. true: a non-reentrant checkpoint (torch.utils.checkpoint's, and
  // the Python package's) hands the recomputed tensors to the graph built in forward, so each
  // block's backward holds only the gradient arriving for its output, as a plain block's does.
  bool non_reentrant = false;
  // Blocks may be offloaded (techniques/activation_offload.h), at this copy bandwidth (bytes per
  // second, each way; 0: copies cost nothing in the model).
  bool activation_offload = false;
  double copy_bytes_per_second = 0;
};

struct Schedule {
  std::vector<std::pair<int, int>> segments;  // checkpointed segments, sorted
  std::vector<int> offloaded;        // blocks whose activations go to the host, sorted
  bool feasible = false;
  int64_t peak_bytes = 0;            // modelled
  int64_t host_bytes = 0;            // the offloaded activations, all on the host at the end of forward
  // The host's peak in a pass that starts without gradients where they are streamed there
  // (ChainCosts::gradients_streamed): the activations not yet back, and the gradients of the
  // blocks whose backward has run (each block's counted from its backward's start).
  int64_t host_first_pass_bytes = 0;
  double seconds = 0;                // modelled forward + backward + recompute + copies
  double recompute_seconds = 0;
  double copy_seconds = 0;
  std::vector<int> recomputed_blocks() const;
};

// The modelled peak and time of a given schedule (segments sorted and disjoint; offloaded blocks
// sorted, in no segment).
Schedule evaluate_schedule(const ChainCosts& costs, const std::vector<std::pair<int, int>>& segments,
                           const std::vector<int>& offloaded = {});

// The schedule of least extra time (recompute, and copies of offloaded blocks where the costs
// allow them) whose modelled peak is <= limit_bytes. Memory is discretized
// into `slots` units of limit_bytes / slots (rounding sizes up, so what it returns fits);
// slots = 0 picks enough slots to lose under 0.5% of the limit to rounding.
// `pinned`: the checkpointed segments are these; only which other blocks are offloaded is chosen.
Schedule solve_schedule(const ChainCosts& costs, int64_t limit_bytes, int slots = 0,
                        const std::vector<std::pair<int, int>>* pinned = nullptr);

// The smallest peak any schedule reaches (every block its own segment is not always it).
int64_t smallest_peak(const ChainCosts& costs);

}  // namespace memfit
