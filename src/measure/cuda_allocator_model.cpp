#include "memfit/measure/cuda_allocator_model.h"

#include <algorithm>
#include <set>
#include <stdexcept>
#include <unordered_map>

namespace memfit {
namespace {

using namespace cuda_sizes;

struct Pool;

// A range of a segment: handed out, cached (free, in its pool) or, in an expandable segment,
// not backed by memory (unmapped). Neighbours in the same segment are linked.
struct Block {
  int64_t address = 0;
  int64_t size = 0;
  int stream = 0;
  Pool* pool = nullptr;
  bool allocated = false;
  bool mapped = true;
  bool expandable = false;
  int64_t segment_base = 0;  // expandable: where the segment's pages start
  int64_t page = 0;          // expandable: its page size (2 MiB small, 20 MiB large)
  Block* prev = nullptr;
  Block* next = nullptr;
  int64_t gc_base = 0;  // the pool's search count when it was cached (its age starts there)
  bool is_split() const { return prev != nullptr || next != nullptr; }
};

struct BySize {  // best fit: same stream, smallest size, lowest address
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return a->address < b->address;
  }
};

struct ByAddress {
  bool operator()(const Block* a, const Block* b) const {
    if (a->stream != b->stream) return a->stream < b->stream;
    return a->address < b->address;
  }
};

struct Pool {
  explicit Pool(bool is_small) : small(is_small) {}
  bool small;
  std::set<Block*, BySize> blocks;        // cached free blocks
  std::set<Block*, ByAddress> unmapped;   // expandable segments' unbacked ranges
  int64_t searches = 0;                   // garbage collection's clock: free-block searches so far
  void cache(Block* b) {
    b->gc_base = searches;
    blocks.insert(b);
  }
  int64_t age(const Block* b) const { return searches - b->gc_base; }
};

int64_t ceil_to(int64_t v, int64_t step) { return (v + step - 1) / step * step; }

// The next of `divisions` equal steps between two powers of two (1200 in 4 steps: 1280).
int64_t next_power2_division(int64_t size, int64_t divisions) {
  if ((size & (size - 1)) == 0) return size;
  const int64_t floor = int64_t{1} << log2_floor(size);
  const int64_t step = floor >> log2_floor(divisions);
  if (step == 0) return floor << 1;
  const int64_t below = size & ~(step - 1);
  return below == size ? size : below + step;
}

Block* search_key(int stream, int64_t size) {
  static thread_local Block key;
  key.stream = stream;
  key.size = size;
  key.address = std::numeric_limits<int64_t>::min();
  return &key;
}

}  // namespace

int64_t cuda_round_size(int64_t bytes, CudaAllocatorRules rules, const CudaAllocatorConf& conf) {
  if (bytes < kMinBlockSize) return kMinBlockSize;
  const int64_t to_512 = ceil_to(bytes, kMinBlockSize);
  if (rules == CudaAllocatorRules::k1_13) {
    if (bytes > conf.roundup_bypass_threshold) return to_512;
    const int64_t divisions = conf.roundup_power2_divisions[0];
    if (divisions <= 0 || bytes <= kMinBlockSize * divisions) return to_512;
    // 1.13 returns the size itself for one division (not even rounded to 512 B).
    return bytes <= 4 || divisions <= 1 ? bytes : next_power2_division(bytes, divisions);
  }
  const int interval = std::clamp(log2_floor(bytes) - 20, 0, kRoundupIntervals - 1);
  const int64_t divisions = conf.roundup_power2_divisions[static_cast<size_t>(interval)];
  if (divisions > 1 && bytes > kMinBlockSize * divisions) return next_power2_division(bytes, divisions);
  return to_512;
}

int64_t cuda_segment_size(int64_t rounded_bytes) {
  if (rounded_bytes <= kSmallSize) return kSmallBuffer;
  if (rounded_bytes < kMinLargeAlloc) return kLargeBuffer;
  return ceil_to(rounded_bytes, kRoundLarge);
}

struct CudaAllocatorModel::Impl {
  explicit Impl(CudaAllocatorModelOptions options) : o(std::move(options)) {}
  ~Impl();

  CudaAllocatorModelOptions o;
  Pool small{true}, large{false};
  std::unordered_map<int64_t, Block*> handed_out;
  int64_t next_id = 1;
  int64_t next_address = int64_t{1} << 40;  // simulated addresses: only their order matters
  int64_t allocated = 0, reserved = 0, peak_allocated = 0, peak_reserved = 0;
  int64_t retries = 0, ooms = 0, segments = 0;

  bool v2() const { return o.rules == CudaAllocatorRules::k2; }
  bool expandable() const { return v2() && o.conf.expandable_segments; }
  bool gc_on() const { return o.limit_bytes > 0 && o.conf.garbage_collection_threshold > 0; }
  Pool& pool_for(int64_t size) { return size <= kSmallSize ? small : large; }
  void note_peaks() {
    peak_allocated = std::max(peak_allocated, allocated);
    peak_reserved = std::max(peak_reserved, reserved);
  }

  int64_t malloc(int64_t bytes, int stream);
  void free(int64_t id);
  Block* find_free(Pool& pool, int64_t size, int stream);
  bool should_split(const Block* b, int64_t size) const;
  int64_t hand_out(Block* b, int64_t size);
  Block* grow(Pool& pool, int64_t size, int stream);
  Block* new_segment(Pool& pool, int64_t size, int stream, bool retry);
  bool release_oversize(Pool& pool, int64_t size, int stream);
  void release_cached();
  void release_pool(Pool& pool);
  void release_block(Block* b);
  void garbage_collect();
  int64_t merge(Block* dst, Block* src);
  // Expandable segments (2.x).
  Block* expandable_block(Pool& pool, int64_t size, int stream);
  Block* find_expandable(Pool& pool, int64_t size, int stream);
  Block* new_expandable_segment(Pool& pool, int stream);
  bool map(Block* b, int64_t size);
  void unmap_free_pages(Block* b);
};

CudaAllocatorModel::Impl::~Impl() {
  for (Pool* pool : {&small, &large}) {
    for (Block* b : pool->blocks) delete b;
    for (Block* b : pool->unmapped) delete b;
  }
  for (auto& [id, b] : handed_out) delete b;
}

int64_t CudaAllocatorModel::Impl::malloc(int64_t bytes, int stream) {
  const int64_t size = cuda_round_size(bytes, o.rules, o.conf);
  Pool& pool = pool_for(size);
  Block* b = find_free(pool, size, stream);
  if (b == nullptr) b = grow(pool, size, stream);
  if (b == nullptr) {
    ++ooms;
    return 0;
  }
  return hand_out(b, size);
}

// Best fit among the cached blocks of this stream, with the oversize rules.
Block* CudaAllocatorModel::Impl::find_free(Pool& pool, int64_t size, int stream) {
  if (gc_on()) ++pool.searches;
  auto it = pool.blocks.lower_bound(search_key(stream, size));
  if (it == pool.blocks.end() || (*it)->stream != stream) return nullptr;
  if ((*it)->expandable) {
    // A block that can grow into its segment's unmapped tail counts as that large: a fixed
    // block that fits is preferred to it.
    const auto growable = [](const Block* b) { return b->size + (b->next && !b->next->mapped ? b->next->size : 0); };
    for (auto next = std::next(it); (*it)->expandable && next != pool.blocks.end() && (*next)->stream == stream &&
                                    growable(*next) < growable(*it);
         ++next) {
      it = next;
    }
  }
  Block* b = *it;
  const int64_t max_split = o.conf.max_split_size;
  if (size < max_split && b->size >= max_split) return nullptr;
  if (size >= max_split && b->size >= size + o.conf.max_non_split_rounding) return nullptr;
  pool.blocks.erase(it);
  return b;
}

bool CudaAllocatorModel::Impl::should_split(const Block* b, int64_t size) const {
  const int64_t rest = b->size - size;
  if (b->pool->small || expandable()) return rest >= kMinBlockSize;
  return size < o.conf.max_split_size && rest > kSmallSize;
}

// Hands out the front of `b` (split off when the rules say so; the rest is cached).
int64_t CudaAllocatorModel::Impl::hand_out(Block* b, int64_t size) {
  if (should_split(b, size)) {
    Block* rest = b;
    b = new Block(*rest);
    b->size = size;
    b->next = rest;
    if (b->prev) b->prev->next = b;
    rest->prev = b;
    rest->address += size;
    rest->size -= size;
    rest->pool->cache(rest);
  }
  b->allocated = true;
  allocated += b->size;
  note_peaks();
  const int64_t id = next_id++;
  handed_out[id] = b;
  return id;
}

// No cached block fits: collect garbage, then a new segment; on the limit free cached blocks
// and retry, as the allocator does.
Block* CudaAllocatorModel::Impl::grow(Pool& pool, int64_t size, int stream) {
  if (gc_on()) garbage_collect();
  Block* b = new_segment(pool, size, stream, false);
  if (b == nullptr && release_oversize(pool, size, stream)) b = new_segment(pool, size, stream, false);
  if (b == nullptr) {
    release_cached();
    b = new_segment(pool, size, stream, true);
  }
  return b;
}

Block* CudaAllocatorModel::Impl::new_segment(Pool& pool, int64_t size, int stream, bool retry) {
  if (retry) ++retries;
  const int64_t segment = cuda_segment_size(size);
  if (o.limit_bytes > 0 && reserved + segment > o.limit_bytes) return nullptr;
  if (expandable()) return expandable_block(pool, size, stream);
  if (reserved + segment > o.device_bytes) return nullptr;  // cudaMalloc fails
  Block* b = new Block;
  b->address = next_address;
  b->size = segment;
  b->stream = stream;
  b->pool = &pool;
  next_address += segment;
  reserved += segment;
  ++segments;
  note_peaks();
  return b;
}

// Frees one cached oversize block large enough, or the largest ones until enough is freed.
bool CudaAllocatorModel::Impl::release_oversize(Pool& pool, int64_t size, int stream) {
  const int64_t max_split = o.conf.max_split_size;
  if (max_split == kNoLimit) return false;
  const int64_t wanted = std::max(size, max_split);
  auto it = pool.blocks.lower_bound(search_key(stream, wanted));
  if (it != pool.blocks.end() && (*it)->stream == stream) {
    if ((*it)->is_split() || (*it)->expandable) return false;
    release_block(*it);
    return true;
  }
  if (it == pool.blocks.begin()) return false;
  int64_t released = 0;
  --it;
  while (released < wanted && (*it)->size >= max_split && (*it)->stream == stream && !(*it)->is_split() &&
         !(*it)->expandable) {
    Block* b = *it;
    released += b->size;
    const bool last = it == pool.blocks.begin();
    if (!last) --it;
    release_block(b);
    if (last) break;
  }
  return released >= wanted;
}

void CudaAllocatorModel::Impl::release_cached() {
  release_pool(large);
  release_pool(small);
}

// Frees every cached block that is a whole segment; in expandable segments unmaps free pages.
void CudaAllocatorModel::Impl::release_pool(Pool& pool) {
  std::vector<Block*> to_unmap;
  for (auto it = pool.blocks.begin(); it != pool.blocks.end();) {
    Block* b = *it++;
    if (b->expandable) {
      to_unmap.push_back(b);
    } else if (!b->is_split()) {
      release_block(b);
    }
  }
  for (Block* b : to_unmap) {
    unmap_free_pages(b);
    if (!b->is_split() && !b->mapped) {  // the whole segment is free: its address space goes too
      pool.unmapped.erase(b);
      --segments;
      delete b;
    }
  }
}

void CudaAllocatorModel::Impl::release_block(Block* b) {
  b->pool->blocks.erase(b);
  reserved -= b->size;
  --segments;
  delete b;
}

// Frees unsplit cached large blocks, the long-unused first, until reserved bytes are back
// under garbage_collection_threshold x the limit.
void CudaAllocatorModel::Impl::garbage_collect() {
  const auto threshold = static_cast<int64_t>(o.conf.garbage_collection_threshold * static_cast<double>(o.limit_bytes));
  if (reserved <= threshold) return;
  const int64_t target = reserved - threshold;
  int64_t age_sum = 0, count = 0;
  for (const Block* b : large.blocks) {
    if (!b->is_split()) age_sum += large.age(b), ++count;
  }
  int64_t reclaimed = 0;
  for (bool freed = true; reclaimed < target && freed && count > 0;) {
    const double age_threshold = static_cast<double>(age_sum) / static_cast<double>(count);
    freed = false;
    for (auto it = large.blocks.begin(); it != large.blocks.end();) {
      Block* b = *it++;
      if (b->is_split() || static_cast<double>(large.age(b)) < age_threshold) continue;
      freed = true;
      reclaimed += b->size;
      age_sum -= large.age(b);
      --count;
      release_block(b);
    }
  }
}

// Joins the free neighbour `src` (same segment, both mapped or both not) into `dst`.
int64_t CudaAllocatorModel::Impl::merge(Block* dst, Block* src) {
  if (src == nullptr || src->allocated || src->mapped != dst->mapped) return 0;
  if (dst->prev == src) {
    dst->address = src->address;
    dst->prev = src->prev;
    if (dst->prev) dst->prev->next = dst;
  } else {
    dst->next = src->next;
    if (dst->next) dst->next->prev = dst;
  }
  dst->size += src->size;
  if (src->mapped) {
    dst->pool->blocks.erase(src);
  } else {
    dst->pool->unmapped.erase(src);
  }
  const int64_t subsumed = src->size;
  delete src;
  return subsumed;
}

void CudaAllocatorModel::Impl::free(int64_t id) {
  auto it = handed_out.find(id);
  if (it == handed_out.end()) throw std::invalid_argument("CudaAllocatorModel::free: unknown block " + std::to_string(id));
  Block* b = it->second;
  handed_out.erase(it);
  allocated -= b->size;
  b->allocated = false;
  merge(b, b->prev);
  merge(b, b->next);
  b->pool->cache(b);
}

// --- Expandable segments (2.x) ---

// Maps pages at the lowest address of this stream's segment with room (free and unmapped
// ranges together), or of a new segment; returns the free block of at least `size` made.
Block* CudaAllocatorModel::Impl::expandable_block(Pool& pool, int64_t size, int stream) {
  Block* c = find_expandable(pool, size, stream);
  if (!c->mapped && !map(c, std::min(c->size, size))) return nullptr;
  while (c->size < size) {
    Block* n = c->next;
    if (n->mapped) {  // a free mapped range follows: take it as it is
      pool.blocks.erase(n);
      merge(n, c);
      pool.cache(n);
    } else if (!map(n, std::min(size - c->size, n->size))) {
      return nullptr;
    }
    c = n;
  }
  pool.blocks.erase(c);
  return c;
}

Block* CudaAllocatorModel::Impl::find_expandable(Pool& pool, int64_t size, int stream) {
  const auto free_range = [](const Block* b) { return b != nullptr && !b->allocated; };
  const auto has_room = [&](const Block* b) {
    int64_t bytes = 0;
    for (; bytes < size && free_range(b); b = b->next) bytes += b->size;
    return bytes >= size;
  };
  for (auto it = pool.unmapped.lower_bound(search_key(stream, 0)); it != pool.unmapped.end() && (*it)->stream == stream;
       ++it) {
    Block* c = free_range((*it)->prev) ? (*it)->prev : *it;
    if (has_room(c)) return c;
  }
  return new_expandable_segment(pool, stream);
}

Block* CudaAllocatorModel::Impl::new_expandable_segment(Pool& pool, int stream) {
  Block* b = new Block;
  b->page = pool.small ? kSmallBuffer : kLargeBuffer;
  b->address = b->segment_base = next_address;
  b->size = ceil_to(o.device_bytes + o.device_bytes / 8, b->page);  // address space for 9/8 of the device
  b->stream = stream;
  b->pool = &pool;
  b->mapped = false;
  b->expandable = true;
  next_address += b->size;
  ++segments;
  pool.unmapped.insert(b);
  return b;
}

// Backs the first `size` bytes of the unmapped range `b` with whole pages; the rest stays unmapped.
bool CudaAllocatorModel::Impl::map(Block* b, int64_t size) {
  const int64_t bytes = ceil_to(size, b->page);
  if (reserved + bytes > o.device_bytes) return false;
  Pool& pool = *b->pool;
  pool.unmapped.erase(b);
  b->mapped = true;
  if (bytes < b->size) {
    Block* rest = new Block(*b);
    rest->mapped = false;
    rest->address = b->address + bytes;
    rest->size = b->size - bytes;
    rest->prev = b;
    if (rest->next) rest->next->prev = rest;
    b->next = rest;
    b->size = bytes;
    pool.unmapped.insert(rest);
  }
  merge(b, b->prev);
  merge(b, b->next);
  pool.cache(b);
  reserved += bytes;
  note_peaks();
  return true;
}

// Gives back the whole pages inside the cached block `b`; slivers of partial pages stay cached.
void CudaAllocatorModel::Impl::unmap_free_pages(Block* b) {
  const int64_t base = b->segment_base, page = b->page;
  const int64_t first = ceil_to(b->address - base, page), end = (b->address + b->size - base) / page * page;
  if (first >= end) return;
  Pool& pool = *b->pool;
  pool.blocks.erase(b);
  const auto sliver = [&](int64_t address, int64_t size, Block* prev, Block* next) {
    Block* s = new Block(*b);
    s->address = address;
    s->size = size;
    s->prev = prev;
    s->next = next;
    if (prev) prev->next = s;
    if (next) next->prev = s;
    pool.cache(s);
  };
  const int64_t start = base + first, bytes = end - first;
  if (start > b->address) sliver(b->address, start - b->address, b->prev, b);
  if (start + bytes < b->address + b->size) sliver(start + bytes, b->address + b->size - start - bytes, b, b->next);
  b->address = start;
  b->size = bytes;
  b->mapped = false;
  merge(b, b->prev);
  merge(b, b->next);
  pool.unmapped.insert(b);
  reserved -= bytes;
}

// --- the public face ---

CudaAllocatorModel::CudaAllocatorModel(CudaAllocatorModelOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
CudaAllocatorModel::~CudaAllocatorModel() = default;

int64_t CudaAllocatorModel::malloc(int64_t bytes, int stream) { return impl_->malloc(bytes, stream); }
void CudaAllocatorModel::free(int64_t id) { impl_->free(id); }
void CudaAllocatorModel::empty_cache() { impl_->release_cached(); }
int64_t CudaAllocatorModel::allocated() const { return impl_->allocated; }
int64_t CudaAllocatorModel::reserved() const { return impl_->reserved; }
int64_t CudaAllocatorModel::peak_allocated() const { return impl_->peak_allocated; }
int64_t CudaAllocatorModel::peak_reserved() const { return impl_->peak_reserved; }
void CudaAllocatorModel::reset_peaks() {
  impl_->peak_allocated = impl_->allocated;
  impl_->peak_reserved = impl_->reserved;
}
int64_t CudaAllocatorModel::num_alloc_retries() const { return impl_->retries; }
int64_t CudaAllocatorModel::num_ooms() const { return impl_->ooms; }
int64_t CudaAllocatorModel::segments() const { return impl_->segments; }
int64_t CudaAllocatorModel::block_size(int64_t id) const { return impl_->handed_out.at(id)->size; }
int64_t CudaAllocatorModel::block_address(int64_t id) const { return impl_->handed_out.at(id)->address; }

AllocationReplay replay_allocations(CudaAllocatorModel& model, const std::vector<AllocationEvent>& events,
                                    size_t first_series_event) {
  AllocationReplay r;
  std::unordered_map<const void*, int64_t> live;  // the trace's live pointers -> block (0: not allocated)
  for (size_t i = 0; i < events.size(); ++i) {
    const AllocationEvent& e = events[i];
    if (i == first_series_event) r.reserved_series.push_back(model.reserved());
    if (e.delta > 0) {
      live[e.ptr] = model.malloc(e.delta, e.stream);
    } else {
      auto it = live.find(e.ptr);
      if (it == live.end()) continue;
      if (it->second > 0) model.free(it->second);
      live.erase(it);
    }
    if (i >= first_series_event) r.reserved_series.push_back(model.reserved());
  }
  if (first_series_event >= events.size()) r.reserved_series.push_back(model.reserved());
  r.peak_reserved = model.peak_reserved();
  r.peak_allocated = model.peak_allocated();
  r.final_reserved = model.reserved();
  r.num_alloc_retries = model.num_alloc_retries();
  r.num_ooms = model.num_ooms();
  return r;
}

}  // namespace memfit
